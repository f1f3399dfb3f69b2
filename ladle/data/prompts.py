"""`ladle data prepare --task prompts`: the prompts of the reinforcement-learning recipes (GRPO,
PPO), which generate the responses themselves.

A record is a jsonl line or Parquet row with a `prompt`, a string (one user message) or a message
list ending with a user (or tool) message, and any other fields (`answer`, `solution`, `tests`,
...), which the rewards read. The prompt is rendered with the chat template and its generation
prompt and tokenized; the record itself is kept verbatim, one JSON line per prompt in order:

    OUT/meta.json              "task": "prompts", tokenizer, splits, bad records
    OUT/train_00000.bin/.idx   the prompts' token ids (ladle/data/indexed.py)
    OUT/train_records.jsonl    the records, line i for prompt i

Bad records are skipped, counted and named with file and line, like SFT's: invalid JSON, no
`prompt`, a prompt that is neither a string nor messages (or whose roles do not alternate), a
prompt longer than `--max-prompt-len` tokens (never truncated: a cut prompt asks another
question). `--strict` stops at the first.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ladle.data.driver import BadRecord, ChatTask, prepare_with
from ladle.data.folder import (
    load_meta,
)
from ladle.data.indexed import IndexedDataset
from ladle.data.sft import ChatEncoder, check_roles
from ladle.errors import DataError

TASK = "prompts"
SPLITS = ("train", "val")


def to_prompt(obj: dict) -> tuple[list[dict], str]:
    """(the prompt's messages, the record's shape: string or messages), or BadRecord."""
    if "prompt" not in obj:
        raise BadRecord("missing field 'prompt'")
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRecord("empty prompt")
        return [{"role": "user", "content": prompt}], "string"
    if not isinstance(prompt, list) or not prompt:
        raise BadRecord("'prompt' must be a string or a non-empty message list")
    messages = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRecord(f"message {i} of 'prompt' has no 'role'")
        messages.append({"role": m["role"], "content": m.get("content")})
    if messages[-1]["role"] not in ("user", "tool"):
        raise BadRecord(
            f"the prompt ends with a {messages[-1]['role']!r} message; it must end with the user's"
        )
    # the roles' order, checked as a chat that the assistant answers next
    check_roles([*messages, {"role": "assistant", "content": ""}])
    return messages, "messages"


class PromptsTask(ChatTask):
    """Prompts rendered with the generation prompt, their records kept verbatim."""

    name = TASK
    nouns = "prompts"
    nouns_key = "prompts"
    masked = False
    keeps_records = True

    def __init__(self, template, max_prompt_len, **kw):
        super().__init__(**kw)
        self.template, self.max_prompt_len = template, max_prompt_len
        self.shapes: Counter[str] = Counter()

    def check(self) -> None:
        if self.max_prompt_len < 1:
            raise DataError(f"--max-prompt-len must be at least 1, got {self.max_prompt_len}")

    def start(self, tok) -> None:
        self.encoder = ChatEncoder(tok, self.template)

    def encode(self, obj: dict):
        try:
            messages, shape = to_prompt(obj)
            ids = self.encoder.tok.encode(self.encoder.render(messages, add_generation_prompt=True))
            if len(ids) > self.max_prompt_len:
                raise BadRecord(f"prompt longer than --max-prompt-len {self.max_prompt_len} tokens")
            line = json.dumps(obj, ensure_ascii=False)
        except BadRecord:
            raise
        except (TypeError, ValueError) as e:  # a Parquet value JSON cannot hold
            raise BadRecord(f"a field cannot be kept as JSON ({e})") from None
        self.shapes[shape] += 1
        return [(np.asarray(ids), None)], line

    def split_fields(self, split, tokens, masks) -> dict:
        return {"prompts": tokens.documents, "records": f"{split}_records.jsonl"}

    def stats(self) -> dict:
        return {"record_shapes": dict(self.shapes)}

    def meta(self, tok, dtype, inputs, stats) -> dict:
        options = {"max_prompt_len": self.max_prompt_len}
        return self.chat_meta(tok, dtype, inputs, self.encoder.template_name, options, stats)

    def summary(self, meta: dict, out: Path, seconds: float) -> str:
        tr, va = meta["splits"]["train"], meta["splits"]["val"]
        shapes = ", ".join(f"{k} {v:,}" for k, v in meta["record_shapes"].items())
        return (
            f"prepared {tr['prompts'] + va['prompts']:,} prompts ({shapes}; template {meta['template']}): "
            f"train {tr['prompts']:,} / {tr['tokens']:,} tokens, val {va['prompts']:,} / {va['tokens']:,} tokens, "
            f"in {seconds:.1f}s -> {out}"
        )


def prepare_prompts(
    inputs: Sequence[str | os.PathLike],
    *,
    tokenizer: str | os.PathLike,
    output: str | os.PathLike,
    template: str | None = None,
    max_prompt_len: int = 1024,
    glob: str | None = None,
    exclude: list[str] | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    strict: bool = False,
    shard_tokens: int = 2**28,
    progress: bool = True,
) -> dict:
    """Tokenize the prompts of `inputs` into the folder `output` (written beside it and renamed
    into place when complete); return its meta.json."""
    task = PromptsTask(
        template,
        max_prompt_len,
        val_fraction=val_fraction,
        seed=seed,
        strict=strict,
        shard_tokens=shard_tokens,
    )
    return prepare_with(
        task,
        inputs,
        tokenizer=tokenizer,
        output=output,
        glob=glob,
        exclude=exclude,
        val_fraction=val_fraction,
        progress=progress,
    )


class PromptSplit:
    """The prompts of one split of a prepared prompts folder: `get(i)` -> (prompt ids, the record)."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        meta = load_meta(data_dir)
        if meta.get("task") != TASK:
            raise DataError(
                f"{data_dir} holds {meta.get('task', 'pretrain')} data, not prompts; prepare it with "
                "`ladle data prepare --task prompts`"
            )
        info = meta["splits"][split]
        root = Path(data_dir)
        self.tokens = [IndexedDataset(root / s) for s in info["shards"]]
        self._index = [(k, j) for k, d in enumerate(self.tokens) for j in range(len(d))]
        self.lengths = np.concatenate([d.sequence_lengths for d in self.tokens] or [[]]).astype(np.int64)
        path = root / info["records"]
        self.records_path = path  # its records, line i + 1 for prompt i
        self.records, where = [], str(path)
        try:
            with path.open(encoding="utf-8") as f:
                for n, line in enumerate(f, start=1):
                    where = f"{path}:{n}"
                    self.records.append(json.loads(line))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{where}: unreadable ({e}); prepare the prompts again") from None
        if len(self.records) != len(self._index):
            raise DataError(
                f"{path} holds {len(self.records)} records for {len(self._index)} prompts; prepare again"
            )
        self.meta = meta

    def __len__(self) -> int:
        return len(self._index)

    def get(self, i: int) -> tuple[np.ndarray, dict]:
        k, j = self._index[i]
        return self.tokens[k][j].astype(np.int64), self.records[i]


class PromptSamples:
    """The prompts of a split as loader rows: `prompt` (max_len,) ids left-padded with `pad_id`,
    `prompt_len`, and `index` (the prompt's index in the split: the key of its rollouts and of
    its record)."""

    unit = "prompts"  # what `documents(i)` counts, in a report

    def __init__(self, split: PromptSplit, max_len: int, pad_id: int = 0, name: str = "train"):
        longest = int(split.lengths.max()) if len(split) else 0
        if longest > max_len:
            raise DataError(
                f"the {name} split holds a prompt of {longest} tokens, longer than {max_len} "
                "(data.seq_len - grpo.max_response_len): raise data.seq_len, or shorten the prompts "
                "(--max-prompt-len) or the responses"
            )
        self.split, self.max_len, self.pad_id, self.name = split, max_len, pad_id, name

    def __len__(self) -> int:
        return len(self.split)

    def documents(self, i: int) -> list[int]:
        return [i]

    def get(self, i: int) -> dict[str, np.ndarray]:
        ids, _ = self.split.get(i)
        row = np.full(self.max_len, self.pad_id, dtype=np.int64)
        row[self.max_len - len(ids) :] = ids
        return {"prompt": row, "prompt_len": np.array(len(ids)), "index": np.array(i)}
