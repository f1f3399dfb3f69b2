"""`ladle data prepare --task preference`: preference pairs (a prompt, a chosen and a rejected
completion) to token ids plus a loss mask on the completion, for reward models and DPO.

Records are jsonl lines or Parquet rows in the shapes people have; each record's shape is told
from its fields:
    prompt    {"prompt": "...", "chosen": "...", "rejected": "..."}
    messages  {"chosen": [messages], "rejected": [messages]}: the shared first turns are the
              prompt, the one assistant message after them each side's completion
              (UltraFeedback-binarized; a "prompt" field beside them is ignored)
    prompt_messages {"prompt": [messages], "chosen": [one message], "rejected": [one message]}
    hh        {"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": "..."} (HH-RLHF):
              the strings are split into turns, then read as `messages`

Both sides are rendered with the chat template (ladle/data/chat.py) as prompt + completion and
tokenized once; the mask marks the completion's tokens (with its end-of-turn token), never the
prompt's. A pair is two documents of the split's shards, chosen then rejected, so the folder has
the SFT layout (ladle/data/sft.py: token and mask shards) with `"task": "preference"`.

Bad records are skipped, counted and named with file and line: invalid JSON, a missing field,
chosen identical to rejected, chosen and rejected whose prompts differ, a completion empty after
truncation (`--max-len`, `--overlong truncate`: the end of a side is cut). `--strict` stops at
the first.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ladle.data.driver import BadRecord, ChatTask, prepare_with
from ladle.data.sft import OVERLONG, ChatEncoder, SFTSplit, check_roles
from ladle.errors import DataError

TASK = "preference"
_HH_TURN = re.compile(r"\n\n(Human|Assistant):[ \t]?")


def to_pair(obj: dict) -> tuple[list[dict], dict, dict, str]:
    """(prompt messages, chosen message, rejected message, the record's shape), or BadRecord."""
    for key in ("chosen", "rejected"):
        if key not in obj:
            raise BadRecord(f"missing field '{key}'")
    chosen, rejected, prompt = obj["chosen"], obj["rejected"], obj.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:
            if not (_HH_TURN.search(chosen) and _HH_TURN.search(rejected)):
                raise BadRecord("missing field 'prompt' (and chosen/rejected are not HH-RLHF turns)")
            return (*_shared_prompt(parse_hh(chosen), parse_hh(rejected)), "hh")
        prompt_msgs = _prompt(prompt)
        pair = (prompt_msgs, _assistant(chosen), _assistant(rejected), "prompt")
    elif isinstance(chosen, list) and isinstance(rejected, list):
        single = len(chosen) == 1 and len(rejected) == 1
        if single and prompt is not None:  # the prompt beside one-message completions
            c, r = _message(chosen[0], "chosen"), _message(rejected[0], "rejected")
            pair = (_prompt(prompt), c, r, "prompt_messages")
        else:
            c = [_message(m, "chosen") for m in chosen]
            r = [_message(m, "rejected") for m in rejected]
            return (*_shared_prompt(c, r), "messages")
    else:
        raise BadRecord("'chosen' and 'rejected' must both be strings or both message lists")
    _check(*pair[:3])
    return pair


def parse_hh(text: str) -> list[dict]:
    """HH-RLHF's '\\n\\nHuman: ...\\n\\nAssistant: ...' as messages."""
    parts = _HH_TURN.split("\n\n" + text.lstrip("\n") if not text.startswith("\n\n") else text)
    if parts[0].strip():
        raise BadRecord("text before the first '\\n\\nHuman:' turn")
    roles = {"Human": "user", "Assistant": "assistant"}
    return [
        {"role": roles[who], "content": body.strip()}
        for who, body in zip(parts[1::2], parts[2::2], strict=True)
    ]


def _shared_prompt(chosen: list[dict], rejected: list[dict]) -> tuple[list[dict], dict, dict]:
    """The shared first turns are the prompt; after them each side has one assistant message."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == len(chosen) == len(rejected):
        raise BadRecord("chosen identical to rejected")
    n = min(n, len(chosen) - 1, len(rejected) - 1)  # a side that is a prefix of the other has no completion
    if len(chosen) != n + 1 or len(rejected) != n + 1 or chosen[:n] != rejected[:n]:
        raise BadRecord("chosen and rejected prompts differ (they must share all turns but the last)")
    pair = (chosen[:n], chosen[n], rejected[n])
    _check(*pair)
    return pair


def _check(prompt: list[dict], chosen: dict, rejected: dict) -> None:
    if not prompt:
        raise BadRecord("empty prompt")
    for side, m in (("chosen", chosen), ("rejected", rejected)):
        if m["role"] != "assistant":
            raise BadRecord(f"the {side} completion is a {m['role']!r} message, not the assistant's")
        check_roles([*prompt, m])
    if chosen["content"] == rejected["content"]:
        raise BadRecord("chosen identical to rejected")


def _prompt(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        return [_message(m, "prompt") for m in prompt]
    raise BadRecord("'prompt' must be a string or a message list")


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def _message(m, field: str) -> dict:
    if isinstance(m, str):  # a bare completion string in a one-element list
        return _assistant(m)
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRecord(f"a message of '{field}' has no 'role'")
    return {"role": m["role"], "content": m.get("content")}


# -- the prepared folder ------------------------------------------------------------------------
class PreferenceTask(ChatTask):
    """Pairs to two sequences each, chosen then rejected, with their completions' loss masks."""

    name = TASK
    nouns = "preference pairs"
    nouns_key = "pairs"

    def __init__(self, template, max_len, overlong, **kw):
        super().__init__(**kw)
        self.template, self.max_len, self.overlong = template, max_len, overlong
        self.shapes: Counter[str] = Counter()

    def check(self) -> None:
        if self.overlong not in OVERLONG:
            raise DataError(f"--overlong {self.overlong!r}: choose one of {', '.join(OVERLONG)}")
        if self.max_len < 2:
            raise DataError(f"--max-len must be at least 2, got {self.max_len}")

    def start(self, tok) -> None:
        self.encoder = ChatEncoder(tok, self.template, mask="last_turn")

    def encode(self, obj: dict):
        prompt, chosen, rejected, shape = to_pair(obj)
        sides = [self.encoder.encode([*prompt, m]) for m in (chosen, rejected)]
        over = any(len(ids) > self.max_len for ids, _ in sides)
        if over and self.overlong == "drop":
            self.counts["dropped_overlong"] += 1
            return None
        sides = [(ids[: self.max_len], mask[: self.max_len]) for ids, mask in sides]
        if not all(mask[1:].any() for _, mask in sides):  # the first token is never a target
            raise BadRecord("a completion is empty after truncation (raise --max-len)")
        self.counts["truncated"] += over
        self.shapes[shape] += 1
        return sides, None

    def split_fields(self, split, tokens, masks) -> dict:
        return {
            "mask_shards": masks.shards,
            "pairs": tokens.documents // 2,
            "trained_tokens": self.counts.pop(f"{split}_trained_tokens", 0),
        }

    def stats(self) -> dict:
        return {
            "record_shapes": dict(self.shapes),
            "truncated": self.counts["truncated"],
            "dropped_overlong": self.counts["dropped_overlong"],
        }

    def meta(self, tok, dtype, inputs, stats) -> dict:
        options = {"max_len": self.max_len, "overlong": self.overlong}
        return self.chat_meta(tok, dtype, inputs, self.encoder.template_name, options, stats)

    def summary(self, meta: dict, out: Path, seconds: float) -> str:
        tr, va = meta["splits"]["train"], meta["splits"]["val"]
        shapes = ", ".join(f"{k} {v:,}" for k, v in meta["record_shapes"].items())
        return (
            f"prepared {tr['pairs'] + va['pairs']:,} preference pairs ({shapes}; template {meta['template']}): "
            f"train {tr['pairs']:,} / {tr['tokens']:,} tokens, val {va['pairs']:,} / {va['tokens']:,} tokens; "
            f"{meta['truncated']} truncated, {meta['dropped_overlong']} dropped as over {meta['max_len']} tokens, "
            f"in {seconds:.1f}s -> {out}"
        )


def prepare_preference(
    inputs: Sequence[str | os.PathLike],
    *,
    tokenizer: str | os.PathLike,
    output: str | os.PathLike,
    template: str | None = None,
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
    """Tokenize the preference pairs of `inputs` into the folder `output` (written beside it and
    renamed into place when complete); return its meta.json."""
    task = PreferenceTask(
        template,
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


class PreferenceSplit:
    """The pairs of one split of a prepared preference folder: `get(i)` -> (chosen ids, chosen
    mask, rejected ids, rejected mask)."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train"):
        self.docs = SFTSplit(data_dir, split, task=TASK)
        if len(self.docs) % 2:
            raise DataError(f"{data_dir}: the {split} split holds an odd number of sequences; prepare again")
        self.meta = self.docs.meta
        self.lengths = self.docs.lengths.reshape(-1, 2)  # (pairs, [chosen, rejected])

    def __len__(self) -> int:
        return len(self.docs) // 2

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return (*self.docs.get(2 * i), *self.docs.get(2 * i + 1))
