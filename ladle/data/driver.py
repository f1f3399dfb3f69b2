"""The one driver of `ladle data prepare`: inputs, tokenizer, the folder written beside its place
and renamed in when complete (ladle/data/folder.py `FolderWriter`), the refusal of a folder with
nothing usable, and the summary. What differs per `--task` is a `Task`: its options' checks, how
its records become sequences, and what its meta.json and summary say. Pretraining text
(ladle/data/prepare.py) writes its own shards on worker processes; the chat-template tasks (sft,
preference, prompts) share `ChatTask`'s loop over records, each with its own `encode`.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ladle.data.folder import (
    BadRecords,
    FolderWriter,
    SplitWriter,
    bad_reasons,
    bad_summary,
    chat_meta,
    in_val,
)
from ladle.data.indexed import dtype_for_vocab
from ladle.data.sources import iter_files, iter_rows, no_files_message
from ladle.data.tokenizer import Tokenizer, load_tokenizer
from ladle.errors import DataError

SPLITS = ("train", "val")


class BadRecord(ValueError):
    """A record that cannot be encoded: skipped and counted by its reason (the first line of the
    message), or with --strict the end of the prepare."""


class Task:
    """One kind of prepared data."""

    name = "pretrain"
    nouns = "documents"  # what the summary counts

    def check(self) -> None:
        """Refuses bad options (DataError), before anything is read."""

    def start(self, tok: Tokenizer) -> None:
        """The tokenizer is loaded: refuse it or build what encodes with it."""

    def write(
        self, folder: Path, inputs: list[str], glob, exclude, skip: list, tok: Tokenizer, dtype
    ) -> dict:
        """Writes the shards under `folder`; returns the stats meta.json records."""
        raise NotImplementedError

    def meta(self, tok: Tokenizer, dtype, inputs: list[str], stats: dict) -> dict:
        raise NotImplementedError

    def empty(self, meta: dict, inputs: list[str]) -> str | None:
        """The refusal when the train split holds nothing usable, else None."""
        raise NotImplementedError

    def summary(self, meta: dict, out: Path, seconds: float) -> str:
        raise NotImplementedError


def prepare_with(
    task: Task,
    inputs: Sequence[str | os.PathLike] | str | os.PathLike,
    *,
    tokenizer: str | os.PathLike,
    output: str | os.PathLike,
    glob: str | None = None,
    exclude: list[str] | None = None,
    val_fraction: float = 0.0,
    progress: bool = True,
    summary: bool | None = None,
) -> dict:
    """Prepares `inputs` as `task` into the folder `output`; returns its meta.json. Written beside
    `output` and renamed into place when complete: a failure leaves `output` as it was. The
    summary goes to stderr with `progress` (or as `summary` says)."""
    inputs = [str(i) for i in ([inputs] if isinstance(inputs, str | os.PathLike) else inputs)]
    task.check()
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
    tok = load_tokenizer(tokenizer)
    task.start(tok)
    out = FolderWriter(output)
    if next(iter_files(inputs, glob, exclude, skip=out.skip), None) is None:
        raise DataError(no_files_message(inputs, glob, exclude))
    dtype = dtype_for_vocab(tok.vocab_size)
    t0 = time.perf_counter()
    with out:
        stats = task.write(out.tmp, inputs, glob, exclude, out.skip, tok, dtype)
        meta = task.meta(tok, dtype, inputs, stats)
        refusal = task.empty(meta, inputs)
        if refusal:
            raise DataError(refusal)
        out.commit(meta)
    if progress if summary is None else summary:
        print(task.summary(meta, out.out, time.perf_counter() - t0), file=sys.stderr)
        if bad := bad_summary(meta):
            print(bad, file=sys.stderr)
    return meta


class ChatTask(Task):
    """A task of chat-template records: each record becomes one or more token sequences (with a
    loss mask when `masked`), and its line is kept verbatim when `keeps_records`."""

    masked = True
    keeps_records = False
    nouns_key = "documents"  # the split field that counts them

    def __init__(self, val_fraction: float, seed: int, strict: bool, shard_tokens: int):
        self.val_fraction, self.seed, self.strict, self.shard_tokens = (
            val_fraction,
            seed,
            strict,
            shard_tokens,
        )
        self.counts: Counter[str] = Counter()  # the task's own counts (truncated, dropped, ...)

    def encode(self, obj: dict) -> tuple[list[tuple[np.ndarray, np.ndarray | None]], str | None] | None:
        """(the record's sequences as (ids, mask), its line to keep or None), or None when the
        record is dropped (and counted) without being bad. Raises BadRecord."""
        raise NotImplementedError

    def split_fields(self, split: str, tokens: SplitWriter, masks: SplitWriter | None) -> dict:
        """What a split's entry in meta.json holds besides its shards, documents and tokens."""
        return {}

    def stats(self) -> dict:
        """The task's counts for meta.json, after the splits."""
        return {}

    def write(self, folder, inputs, glob, exclude, skip, tok, dtype) -> dict:
        tokens = {s: SplitWriter(folder, s, dtype, self.shard_tokens) for s in SPLITS}
        masks = {s: SplitWriter(folder, f"{s}_mask", np.uint8, self.shard_tokens) for s in SPLITS}
        records = (
            {s: (folder / f"{s}_records.jsonl").open("w", encoding="utf-8") for s in SPLITS}
            if self.keeps_records
            else {}
        )
        writers = [*tokens.values(), *(masks.values() if self.masked else ())]
        bad = BadRecords(self.strict)
        try:
            rows = iter_rows(inputs, glob=glob, exclude=exclude, skip=skip)
            for ordinal, (source, obj, reason) in enumerate(rows, start=1):
                if reason is not None:
                    bad(source, reason)
                    continue
                try:
                    got = self.encode(obj)
                except BadRecord as e:
                    # Only the first line of a reason is its kind: counts stay few and readable.
                    bad(source, str(e))
                    continue
                if got is None:
                    continue
                sequences, line = got
                split = (
                    "val" if self.val_fraction and in_val(self.seed, ordinal, self.val_fraction) else "train"
                )
                for ids, mask in sequences:
                    tokens[split].add(ids.astype(dtype))
                    if self.masked:
                        masks[split].add(mask.astype(np.uint8))
                        self.counts[f"{split}_trained_tokens"] += int(mask[1:].sum())
                if self.keeps_records:
                    records[split].write(line + "\n")
            for w in writers:
                w.close()
        except BaseException:
            for w in writers:
                w.abort()
            raise
        finally:
            for f in records.values():
                f.close()
        splits = {
            s: {**w.summary(), **self.split_fields(s, w, masks[s] if self.masked else None)}
            for s, w in tokens.items()
        }
        return {"splits": splits, **self.stats(), **bad.meta()}

    def chat_meta(self, tok, dtype, inputs, template: str, options: dict, stats: dict) -> dict:
        return chat_meta(
            self.name, tok, dtype, template, inputs, self.seed, self.val_fraction, **options, **stats
        )

    def empty(self, meta: dict, inputs: list[str]) -> str | None:
        if meta["splits"]["train"][self.nouns_key]:
            return None
        reasons = bad_reasons(meta)
        return f"no usable {self.nouns} in {', '.join(inputs)}: {reasons or 'the files hold no records'}"
