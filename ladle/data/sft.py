"""`ladle data prepare --task sft`: chat records to token ids plus a loss mask, in memory-mapped
shards, so that a finetuning run starts without tokenizing anything.

Records are jsonl lines or Parquet rows in one of three shapes (`--format`, or detected from the
first record that has one of their keys):
    messages    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
    sharegpt    {"conversations": [{"from": "human"|"gpt"|"system"|"tool"|..., "value": "..."}, ...]}
    alpaca      {"instruction": "...", "input": "..." (optional), "output": "...", "system": (optional)}

Each chat is rendered with a chat template (the tokenizer's own, or a built-in `chatml`, `qwen`,
`llama3`; ladle/data/chat.py) and tokenized once. The loss mask marks the tokens the model learns
to produce: by default the assistant turns, each with its end-of-turn token (so the model learns
to stop), never the prompt or the markers that open a turn. A turn's span is found by rendering
the chat up to the turn with the generation prompt and up to its end: the characters between
are the assistant's; a token is trained when it starts inside such a span. `last_turn` trains
only the last assistant turn, `all` (train_on_prompt) every token.

A prepared folder holds, per split, `{split}_NNNNN.bin/.idx` (token ids, one sequence per chat,
Megatron's indexed format) beside `{split}_mask_NNNNN.bin/.idx` (one uint8 per token), and
meta.json with `"task": "sft"` and the counts: samples, trained tokens, truncated and dropped
over-long samples, samples without a trained token, bad records by reason with `file:line`
examples.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ladle.data.chat import BUILTIN, MARKERS, ChatTemplate
from ladle.data.driver import BadRecord, ChatTask, prepare_with
from ladle.data.folder import load_meta
from ladle.data.indexed import IndexedDataset
from ladle.data.tokenizer import Tokenizer
from ladle.errors import DataError

FORMATS = ("auto", "messages", "sharegpt", "alpaca")
MASKS = ("assistant", "last_turn", "all")
OVERLONG = ("truncate", "drop")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
    "observation": "tool",
    "function": "tool",
}


def detect_format(obj: dict) -> str | None:
    if "messages" in obj:
        return "messages"
    if "conversations" in obj:
        return "sharegpt"
    if "instruction" in obj and "output" in obj:
        return "alpaca"
    return None


def to_messages(obj: dict, fmt: str) -> list[dict]:
    """The record as role/content messages, or BadRecord."""
    if fmt == "messages":
        msgs = obj.get("messages")
        if not isinstance(msgs, list):
            raise BadRecord("'messages' is not a list")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRecord(f"message {i} has no 'role'")
            out.append({"role": m["role"], "content": m.get("content")})
    elif fmt == "sharegpt":
        turns = obj.get("conversations")
        if not isinstance(turns, list):
            raise BadRecord("'conversations' is not a list")
        out = []
        for i, t in enumerate(turns):
            who = t.get("from") if isinstance(t, dict) else None
            if who not in SHAREGPT_ROLES:
                raise BadRecord(f"turn {i}: 'from' is {who!r}, expected one of {', '.join(SHAREGPT_ROLES)}")
            out.append({"role": SHAREGPT_ROLES[who], "content": t.get("value")})
        if isinstance(obj.get("system"), str) and obj["system"] and out[:1] != [{"role": "system"}]:
            out.insert(0, {"role": "system", "content": obj["system"]})
    elif fmt == "alpaca":
        instruction, output = obj.get("instruction"), obj.get("output")
        if not isinstance(instruction, str) or not isinstance(output, str):
            raise BadRecord("'instruction' and 'output' must be strings")
        extra = obj.get("input")
        prompt = f"{instruction}\n\n{extra}" if isinstance(extra, str) and extra.strip() else instruction
        out = [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
        if isinstance(obj.get("system"), str) and obj["system"]:
            out.insert(0, {"role": "system", "content": obj["system"]})
    else:
        raise BadRecord(f"no record format ({', '.join(FORMATS[1:])}) matches its keys {sorted(obj)[:6]}")
    check_roles(out)
    return out


def check_roles(messages: list[dict]) -> None:
    """System first if at all, then user and assistant in turn; tool results answer an assistant
    (tool call) and are followed by the assistant or more tool results. At least one assistant."""
    prev = None
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise BadRecord(f"message {i}: unknown role {role!r}; roles are {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise BadRecord(f"message {i} ({role}): content is not a string")
        allowed = {
            "system": (None,),
            "user": (None, "system", "assistant"),
            "assistant": ("user", "tool"),
            "tool": ("assistant", "tool"),
        }[role]
        if prev not in allowed:
            after = f"after {prev!r}" if prev else "first"
            raise BadRecord(f"message {i}: role {role!r} {after}: roles must alternate user/assistant")
        prev = role
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no assistant message")


# -- messages to tokens and loss mask -----------------------------------------------------------
class ChatEncoder:
    """Renders, tokenizes and masks chats with one template."""

    def __init__(self, tok: Tokenizer, template: str | None = None, mask: str = "assistant"):
        if mask not in MASKS:
            raise DataError(f"loss mask {mask!r}: expected one of {', '.join(MASKS)}")
        self.tok, self.mask = tok, mask
        if template is None:
            if tok.chat_template is None:
                raise DataError(
                    f"tokenizer {tok.path} has no chat_template; name a built-in one with --template "
                    f"({', '.join(BUILTIN)})"
                )
            self.template, self.template_name = tok.chat_template, "tokenizer"
        elif template in BUILTIN:
            missing = [t for t in MARKERS[template] if tok.token_to_id(t) is None]
            if missing:
                raise DataError(
                    f"template {template!r} needs the special tokens {', '.join(missing)}, which tokenizer "
                    f"{tok.path} does not have; choose another --template"
                )
            special = {"bos_token": tok.decode([tok.bos_id], False) if tok.bos_id is not None else ""}
            self.template, self.template_name = (
                ChatTemplate(BUILTIN[template], special, f"built-in template {template!r}"),
                template,
            )
        else:
            raise DataError(f"unknown template {template!r}; built-in templates are {', '.join(BUILTIN)}")

    def render(self, messages, **kw) -> str:
        try:
            return self.template.render(messages, **kw)
        except DataError as e:
            raise BadRecord(str(e)) from None

    def spans(self, messages: list[dict], text: str) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in `text`, the rendered chat."""
        out = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(self.render(messages[:i], add_generation_prompt=True))
            upto = self.render(messages[: i + 1])
            if not text.startswith(upto) or len(upto) < start:
                raise BadRecord(
                    f"the chat template renders the chat up to message {i} differently once later turns "
                    "follow, so its assistant tokens cannot be told apart; use --template or --mask all"
                )
            end = len(upto.rstrip())  # through the end-of-turn token, not the newline after it
            out.append((start, max(start, end)))
        return out

    def encode(self, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, loss mask) of a chat; mask True = the model learns this token."""
        text = self.render(messages)
        ids, offsets = self.tok.encode_with_offsets(text)
        mask = np.zeros(len(ids), dtype=bool)
        if self.mask == "all":
            mask[:] = True
        else:
            spans = self.spans(messages, text)
            if self.mask == "last_turn":
                spans = spans[-1:]
            starts = np.array([o[0] for o in offsets], dtype=np.int64)
            eos = False
            for a, b in spans:
                turn = np.flatnonzero((starts >= a) & (starts < b))
                mask[turn] = True
                if not len(turn) or ids[turn[-1]] in self.tok.special_ids:  # <|im_end|>, <|eot_id|>
                    continue
                # The template ends the assistant's turn with no token of its own (GLM-4: the next
                # role's marker ends it, and <|user|> is among its stop tokens): the model must
                # still learn to stop. Train the special token that follows, or, where the chat
                # ends with this turn, an end-of-text token appended to it.
                nxt = turn[-1] + 1
                if nxt < len(ids) and ids[nxt] in self.tok.special_ids:
                    mask[nxt] = True
                elif not text[b:].strip() and self.tok.eos_id is not None:
                    eos = True
            if eos:
                ids, mask = [*ids, self.tok.eos_id], np.append(mask, True)
        return np.asarray(ids, dtype=np.int64), mask


# -- the prepared folder ------------------------------------------------------------------------
class SFTTask(ChatTask):
    """Chats to token ids and a loss mask (see the module's docstring)."""

    name = "sft"
    nouns = "chats"

    def __init__(self, fmt, template, mask, max_len, overlong, **kw):
        super().__init__(**kw)
        self.fmt, self.template, self.mask, self.max_len, self.overlong = (
            fmt,
            template,
            mask,
            max_len,
            overlong,
        )
        self.detected = None if fmt == "auto" else fmt

    def check(self) -> None:
        if self.fmt not in FORMATS:
            raise DataError(f"unknown SFT format {self.fmt!r}; choose one of {', '.join(FORMATS)}")
        if self.overlong not in OVERLONG:
            raise DataError(f"--overlong {self.overlong!r}: choose one of {', '.join(OVERLONG)}")
        if self.max_len < 2:
            raise DataError(f"--max-len must be at least 2, got {self.max_len}")

    def start(self, tok: Tokenizer) -> None:
        self.encoder = ChatEncoder(tok, self.template, self.mask)

    def encode(self, obj: dict):
        if self.detected is None:
            self.detected = detect_format(obj)
        messages = to_messages(obj, self.detected or "unknown")
        ids, mask = self.encoder.encode(messages)
        if len(ids) > self.max_len:
            if self.overlong == "drop":
                self.counts["dropped_overlong"] += 1
                return None
            ids, mask = ids[: self.max_len], mask[: self.max_len]
            self.counts["truncated"] += 1
        if not mask[1:].any():  # the first token is never a target
            self.counts["no_trained_tokens"] += 1
            raise BadRecord("no trained tokens (all masked, or truncated away)")
        return [(ids, mask)], None

    def split_fields(self, split, tokens, masks) -> dict:
        return {"mask_shards": masks.shards, "trained_tokens": self.counts.pop(f"{split}_trained_tokens", 0)}

    def stats(self) -> dict:
        c = self.counts
        return {
            "truncated": c["truncated"],
            "dropped_overlong": c["dropped_overlong"],
            "no_trained_tokens": c["no_trained_tokens"],
        }

    def meta(self, tok, dtype, inputs, stats) -> dict:
        options = {
            "mask": self.mask,
            "record_format": self.detected,
            "max_len": self.max_len,
            "overlong": self.overlong,
        }
        return self.chat_meta(tok, dtype, inputs, self.encoder.template_name, options, stats)

    def empty(self, meta: dict, inputs: list[str]) -> str | None:
        refusal = super().empty(meta, inputs)
        return refusal and f"{refusal}; fix the data or the --format/--template options"

    def summary(self, meta: dict, out: Path, seconds: float) -> str:
        tr, va = meta["splits"]["train"], meta["splits"]["val"]
        return (
            f"prepared {tr['documents'] + va['documents']:,} chats ({meta['record_format']}, template "
            f"{meta['template']}, mask {meta['mask']}): train {tr['documents']:,} / {tr['tokens']:,} tokens "
            f"({tr['trained_tokens']:,} trained), val {va['documents']:,} / {va['tokens']:,} tokens; "
            f"{meta['truncated']} truncated, {meta['dropped_overlong']} dropped as over {meta['max_len']} "
            f"tokens, in {seconds:.1f}s -> {out}"
        )


def prepare_sft(
    inputs: Sequence[str | os.PathLike],
    *,
    tokenizer: str | os.PathLike,
    output: str | os.PathLike,
    fmt: str = "auto",
    template: str | None = None,
    mask: str = "assistant",
    max_len: int = 4096,
    overlong: str = "truncate",
    glob: str | None = None,
    exclude: list[str] | None = None,
    val_fraction: float = 0.0,
    seed: int = 0,
    strict: bool = False,
    shard_tokens: int = 2**28,
    progress: bool = True,
) -> dict:
    """Tokenize the chats of `inputs` into the SFT data folder `output`; return its meta.json.

    Written beside `output` and renamed into place when complete (a failure leaves `output` as it
    was). Bad records and samples without a trained token are skipped and counted; with `strict`
    the first bad record raises.
    """
    task = SFTTask(
        fmt,
        template,
        mask,
        max_len,
        overlong,
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


class SFTSplit:
    """The chats of one split of a prepared SFT folder: `lengths`, `get(i)` -> (ids, mask). Also
    the sequences of a folder of another masked task (`task`: preference pairs)."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train", task: str = "sft"):
        meta = load_meta(data_dir)
        if meta.get("task") != task:
            raise DataError(
                f"{data_dir} holds {meta.get('task', 'pretrain')} data, not {task} data; prepare it with "
                f"`ladle data prepare --task {task}`"
            )
        info = meta["splits"][split]
        root = Path(data_dir)
        self.tokens = [IndexedDataset(root / s) for s in info["shards"]]
        self.masks = [IndexedDataset(root / s) for s in info["mask_shards"]]
        for t, m in zip(self.tokens, self.masks, strict=True):
            if not np.array_equal(t.sequence_lengths, m.sequence_lengths):
                raise DataError(
                    f"{m.prefix} does not match {t.prefix} (a sequence length differs); prepare again"
                )
        self._index = [(k, j) for k, d in enumerate(self.tokens) for j in range(len(d))]
        self.lengths = np.concatenate([d.sequence_lengths for d in self.tokens] or [[]]).astype(np.int64)
        self.meta = meta

    def __len__(self) -> int:
        return len(self._index)

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        k, j = self._index[i]
        return self.tokens[k][j].astype(np.int64), self.masks[k][j].astype(bool)
