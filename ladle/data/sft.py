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
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from ladle.data.chat import BUILTIN, MARKERS, ChatTemplate
from ladle.data.folder import (
    BadRecords,
    FolderWriter,
    SplitWriter,
    bad_reasons,
    bad_summary,
    chat_meta,
    in_val,
    load_meta,
)
from ladle.data.indexed import IndexedDataset, dtype_for_vocab
from ladle.data.sources import iter_files, iter_rows, no_files_message
from ladle.data.tokenizer import Tokenizer, load_tokenizer
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


class BadRecord(ValueError):
    """A record that cannot become a training sample; the message is the reason."""


# -- records to messages ------------------------------------------------------------------------
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
    if isinstance(inputs, str | os.PathLike):
        inputs = [inputs]
    inputs = [str(i) for i in inputs]
    if fmt not in FORMATS:
        raise DataError(f"unknown SFT format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if overlong not in OVERLONG:
        raise DataError(f"--overlong {overlong!r}: choose one of {', '.join(OVERLONG)}")
    if max_len < 2:
        raise DataError(f"--max-len must be at least 2, got {max_len}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    tok = load_tokenizer(tokenizer)
    encoder = ChatEncoder(tok, template, mask)
    out = FolderWriter(output)
    if next(iter_files(inputs, glob, exclude, skip=out.skip), None) is None:
        raise DataError(no_files_message(inputs, glob, exclude))

    dtype = dtype_for_vocab(tok.vocab_size)
    t0 = time.perf_counter()
    with out:
        rows = iter_rows(inputs, glob=glob, exclude=exclude, skip=out.skip)
        stats = _encode_into(
            out.tmp, rows, encoder, fmt, dtype, max_len, overlong, val_fraction, seed, strict, shard_tokens
        )
        meta = chat_meta(
            "sft",
            tok,
            dtype,
            encoder.template_name,
            inputs,
            seed,
            val_fraction,
            mask=mask,
            record_format=stats.pop("record_format"),
            max_len=max_len,
            overlong=overlong,
            **stats,
        )
        if not meta["splits"]["train"]["documents"]:
            reasons = bad_reasons(meta)
            raise DataError(
                f"no usable chats in {', '.join(inputs)}: {reasons or 'the files hold no records'}; "
                "fix the data or the --format/--template options"
            )
        out.commit(meta)
    if progress:
        _print_summary(meta, out.out, time.perf_counter() - t0)
    return meta


def _encode_into(
    folder, rows: Iterator, encoder, fmt, dtype, max_len, overlong, val_fraction, seed, strict, shard_tokens
):
    tokens = {s: SplitWriter(folder, s, dtype, shard_tokens) for s in ("train", "val")}
    masks = {s: SplitWriter(folder, f"{s}_mask", np.uint8, shard_tokens) for s in ("train", "val")}
    skip = BadRecords(strict)
    counts = Counter()
    ordinal = 0
    detected = None if fmt == "auto" else fmt

    try:
        for source, obj, reason in rows:
            ordinal += 1
            if reason is not None:
                skip(source, reason)
                continue
            if detected is None:
                detected = detect_format(obj)
            try:
                messages = to_messages(obj, detected or "unknown")
                ids, mask = encoder.encode(messages)
            except BadRecord as e:
                # Only the first line of a reason is its kind: counts stay few and readable.
                skip(source, str(e))
                continue
            if len(ids) > max_len:
                if overlong == "drop":
                    counts["dropped_overlong"] += 1
                    continue
                ids, mask = ids[:max_len], mask[:max_len]
                counts["truncated"] += 1
            if not mask[1:].any():  # the first token is never a target
                skip(source, "no trained tokens (all masked, or truncated away)")
                counts["no_trained_tokens"] += 1
                continue
            split = "val" if val_fraction and in_val(seed, ordinal, val_fraction) else "train"
            tokens[split].add(ids.astype(dtype))
            masks[split].add(mask.astype(np.uint8))
            counts[f"{split}_trained_tokens"] += int(mask[1:].sum())
        for w in (*tokens.values(), *masks.values()):
            w.close()
    except BaseException:
        for w in (*tokens.values(), *masks.values()):
            w.abort()
        raise
    splits = {s: {**w.summary(), "mask_shards": masks[s].shards} for s, w in tokens.items()}
    for s in splits:
        splits[s]["trained_tokens"] = counts.pop(f"{s}_trained_tokens", 0)
    return {
        "splits": splits,
        "record_format": detected,
        "truncated": counts["truncated"],
        "dropped_overlong": counts["dropped_overlong"],
        "no_trained_tokens": counts["no_trained_tokens"],
        **skip.meta(),
    }


def _print_summary(meta: dict, out: Path, seconds: float) -> None:
    import sys

    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    print(
        f"prepared {tr['documents'] + va['documents']:,} chats ({meta['record_format']}, template "
        f"{meta['template']}, mask {meta['mask']}): train {tr['documents']:,} / {tr['tokens']:,} tokens "
        f"({tr['trained_tokens']:,} trained), val {va['documents']:,} / {va['tokens']:,} tokens; "
        f"{meta['truncated']} truncated, {meta['dropped_overlong']} dropped as over {meta['max_len']} "
        f"tokens, in {seconds:.1f}s -> {out}",
        file=sys.stderr,
    )
    if summary := bad_summary(meta):
        print(summary, file=sys.stderr)


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
