"""Train a byte-level BPE tokenizer, and load any Hugging Face `tokenizer.json` folder.

`train_tokenizer` makes a GPT-2 style byte-level BPE: every byte is in the initial alphabet, so any
text (any Unicode, any bytes decoded as UTF-8) encodes without an unknown token and decodes back
exactly. Its special tokens come first: `<|bos|>` = 0, `<|eos|>` = 1, `<|pad|>` = 2, and the ChatML
turn markers `<|im_start|>` = 3, `<|im_end|>` = 4; the 256 byte tokens follow, then the merges.
Nothing is added by `encode`: callers place bos/eos themselves. The folder's chat template is
ChatML (`ladle.data.chat.CHATML`), so a model pretrained with it can be finetuned on chats.

The saved folder (`tokenizer.json` + `tokenizer_config.json`) loads with `load_tokenizer` and with
`transformers.AutoTokenizer.from_pretrained`, which gives the same ids.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from collections.abc import Iterable, Iterator
from itertools import chain
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ladle.data.bpe_cache import CachedBPE
from ladle.data.sources import format_of, iter_documents, iter_files, no_files_message
from ladle.errors import DataError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0-4 in a trained tokenizer
# When tokenizer_config.json does not say, the first of these names found in the vocabulary.
FALLBACK_NAMES = {
    "bos": (BOS, "<s>", "<|begin_of_text|>", "<|endoftext|>"),
    "eos": (EOS, "</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>"),
    "pad": (PAD, "<pad>", "<|finetune_right_pad_id|>"),
}
NO_MAX_LENGTH = int(1e30)  # transformers' own value for "no model_max_length"
TRAIN_CHUNK_CHARS = 1 << 20


def train_tokenizer(
    inputs: list[str],
    *,
    vocab_size: int,
    output: str,
    glob: str | None = None,
    exclude: list[str] | None = None,
    min_frequency: int = 2,
    fmt: str = "auto",
    text_field: str = "text",
    model_max_length: int | None = None,
) -> Path:
    """Train a byte-level BPE on the files of `inputs` (see `ladle.data.sources.iter_files`) and save
    it into the folder `output`; return that folder.

    Text files are streamed in chunks of lines (undecodable bytes become U+FFFD, harmless for
    training); jsonl and parquet files contribute their `text_field`, as `ladle data prepare` reads
    them.
    """
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise DataError(
            f"vocab_size {vocab_size} is too small: a byte-level BPE needs at least {minimum} "
            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    files = iter_files(inputs, glob, exclude)
    first = next(files, None)
    if first is None:
        raise DataError(no_files_message(inputs, glob, exclude))

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    tok.train_from_iterator(_training_texts(chain([first], files), fmt, text_field), trainer=trainer)

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    from ladle.data.chat import CHATML

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "chat_template": CHATML,
        "model_max_length": model_max_length or NO_MAX_LENGTH,
        # Decoding must give back the text exactly, not "cleaned up" spaces before punctuation.
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _training_texts(files: Iterable[Path], fmt: str, text_field: str) -> Iterator[str]:
    for path in files:
        if format_of(path, fmt) == "text":
            with open(path, encoding="utf-8", errors="replace", newline="") as f:
                # Chunks end at line ends, so pre-tokenization sees the same words as for the whole file.
                while lines := f.readlines(TRAIN_CHUNK_CHARS):
                    yield "".join(lines)
        else:
            for record in iter_documents([path], fmt=fmt, text_field=text_field):
                if record.text is not None:
                    yield record.text


class Tokenizer:
    """A loaded Hugging Face `tokenizer.json`, with the special ids ladle needs."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        file = path if path.is_file() else path / "tokenizer.json"
        self.path = file.parent
        data = file.read_bytes()
        self.hash = hashlib.sha256(data).hexdigest()
        try:
            self._tok = HFTokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # the tokenizers library raises plain Exception on a bad file
            raise DataError(f"cannot load tokenizer {file}: {e}") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        config = _read_config(self.path / "tokenizer_config.json")
        self.bos_id = self._special_id(config, "bos")
        self.eos_id = self._special_id(config, "eos")
        self.pad_id = self._special_id(config, "pad")
        self._config = config

    def _special_id(self, config: dict, kind: str) -> int | None:
        key = f"{kind}_token"
        if key in config:  # an explicit null means "none" (Qwen has bos_token: null)
            value = config[key]
            if isinstance(value, dict):
                value = value.get("content")
            return self._tok.token_to_id(value) if isinstance(value, str) else None
        for name in FALLBACK_NAMES[kind]:
            if (token_id := self._tok.token_to_id(name)) is not None:
                return token_id
        return None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`add_special_tokens`: what tokenizer.json's post-processor adds (a Llama 3 BOS), as
        `transformers` encodes by default (lm-eval's `hf` model does)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's (start, end) character span in `text`."""
        e = self._tok.encode(text, add_special_tokens=False)
        return e.ids, e.offsets

    @functools.cached_property
    def _fast(self) -> CachedBPE | None:
        return CachedBPE.for_tokenizer(self._tok)  # built on first encode_batch (see bpe_cache)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of many texts, as `encode` gives them; the bulk path of `ladle data prepare`."""
        out = [self._fast.encode(t) for t in texts] if self._fast else [None] * len(texts)
        rest = [i for i, ids in enumerate(out) if ids is None]
        if rest:
            # encode_batch_fast skips the character offsets, which nothing here needs.
            encoded = self._tok.encode_batch_fast([texts[i] for i in rest], add_special_tokens=False)
            for i, e in zip(rest, encoded, strict=True):
                out[i] = e.ids
        return out

    @functools.cached_property
    def chat_template(self):
        """The folder's chat template (`ladle.data.chat.ChatTemplate`), or None; compiled once. A
        `chat_template.jinja` file wins over tokenizer_config.json's, as in `transformers`."""
        from ladle.data.chat import ChatTemplate

        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return ChatTemplate.from_config(self._config, source=str(jinja), template=jinja.read_text())
        return ChatTemplate.from_config(self._config, source=str(self.path / "tokenizer_config.json"))

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = False, **kw
    ) -> list[int]:
        """Token ids of a rendered chat, as `transformers`' `apply_chat_template(tokenize=True)`."""
        template = self.chat_template
        if template is None:
            raise DataError(f"tokenizer {self.path} has no chat_template in tokenizer_config.json")
        return self.encode(template.render(messages, add_generation_prompt=add_generation_prompt, **kw))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON: {e}") from e
    return config if isinstance(config, dict) else {}


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer folder (or its tokenizer.json file directly)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path.is_file() and path.suffix == ".json"):
        what = "has no tokenizer.json" if path.is_dir() else "does not exist"
        raise DataError(
            f"tokenizer folder {path} {what}; train one with `ladle tokenizer train ...` "
            "or point tokenizer.path at a Hugging Face tokenizer folder"
        )
    return Tokenizer(path)
