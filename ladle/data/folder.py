"""A prepared data folder: its meta.json, its shards' writers, and the atomic writing of the whole.

Every `ladle data prepare` task (pretraining text, SFT chats, preference pairs) writes through
`FolderWriter` and is read through `load_meta`, so the format checks, the bad-record summary and
the guarantee that a reader never sees half a folder live here once.

    OUT/meta.json            format, version, task, tokenizer hash, splits, bad records, options
    OUT/train_00000.bin/.idx Megatron-format shards of each split (`ladle/data/indexed.py`)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from ladle.config.schema import LadleConfig
from ladle.data.indexed import IndexedDatasetWriter
from ladle.errors import DataError

FORMAT = "megatron-mmidx"
VERSION = 1
SPLITS = ("train", "val")
MAX_EXAMPLES = 5  # `file:line` examples kept per bad-record reason


def load_meta(data_dir: str | os.PathLike) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.is_file():
        raise DataError(
            f"data folder {data_dir} not found (or has no meta.json): run `ladle data prepare` first"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise DataError(f"{path} is not valid JSON ({e}): run `ladle data prepare` again") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(
            f"{path} is not a {FORMAT} version {VERSION} meta file: run `ladle data prepare` again"
        )
    # the files it names are the folder's own: a crafted one must not point elsewhere
    for name in _named_files(meta):
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise DataError(
                f"{path} names the file {name!r}, which is not a file of the folder itself; "
                "run `ladle data prepare` again"
            )
    return meta


def _named_files(meta: dict) -> list:
    names = list(meta.get("files") or {})
    for split in (meta.get("splits") or {}).values():
        if isinstance(split, dict):
            names += [*split.get("shards", []), *split.get("mask_shards", [])]
            names += [split["records"]] if "records" in split else []
    return names


def bad_reasons(meta: dict) -> str:
    """'reason: count (e.g. file:line); ...' of a meta.json's bad records ('' if none)."""
    return "; ".join(
        f"{reason}: {count} (e.g. {meta['bad_examples'][reason][0]})"
        for reason, count in meta["bad_records"].items()
    )


class BadRecords:
    """The records a prepare skips: a count per reason with up to MAX_EXAMPLES `file:line` each,
    for meta.json and the console. `strict`: the first one stops the prepare with exit 2."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}

    def __call__(self, source: str, reason: str) -> None:
        if self.strict:
            raise DataError(f"{source}: {reason} (strict mode stops at the first bad record)")
        self.counts[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(source)

    def meta(self) -> dict:
        return {"bad_records": dict(self.counts), "bad_examples": self.examples}


def bad_summary(meta: dict) -> str:
    """The console lines of a meta.json's skipped records, most frequent first ('' if none)."""
    counts = meta["bad_records"]
    if not counts:
        return ""
    lines = [f"{sum(counts.values()):,} bad records skipped:"]
    for reason, count in sorted(counts.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {reason}: {count:,} (e.g. {', '.join(meta['bad_examples'][reason])})")
    return "\n".join(lines)


def in_val(seed: int, ordinal: int, fraction: float) -> bool:
    """Whether record `ordinal` is held out: a hash of (seed, ordinal), so the split does not
    depend on the order of the workers or on the other records."""
    digest = hashlib.blake2b(f"{seed}:{ordinal}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def tokenizer_fields(tok) -> dict:
    """meta.json's record of the tokenizer, which `ladle run` checks the config's against."""
    return {
        "tokenizer_hash": tok.hash,
        "tokenizer_path": str(tok.path.resolve()),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
    }


def chat_meta(task: str, tok, dtype, template: str, inputs, seed: int, val_fraction: float, **fields) -> dict:
    """meta.json of a chat-template task (sft, preference, prompts): the format and tokenizer
    records, the task's own `fields` (options, then split and bad-record stats), the inputs."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "task": task,
        **tokenizer_fields(tok),
        "dtype": np.dtype(dtype).name,
        "template": template,
        **fields,
        "inputs": [str(Path(i).resolve()) for i in inputs],
        "seed": seed,
        "val_fraction": val_fraction,
    }


class FolderWriter:
    """Writes a data folder atomically: everything goes to a hidden sibling `.OUT.tmp-PID`, which
    replaces OUT only once `commit(meta)` has written meta.json; on any error the sibling is
    removed and OUT is untouched. OUT may be absent, empty or an earlier prepare output.

        with FolderWriter(out) as w:   # refuses an OUT that is something else
            ... write shards under w.tmp ...
            w.commit(meta)
    """

    def __init__(self, out: str | os.PathLike):
        self.out = Path(out)
        self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}"
        self.skip = [self.out, self.tmp]  # an output inside an input folder is not read back as input
        if self.out.exists():
            if not self.out.is_dir():
                raise DataError(f"output {self.out} exists and is not a folder; choose another output path")
            if not (self.out / "meta.json").is_file() and any(self.out.iterdir()):
                raise DataError(
                    f"output folder {self.out} is not empty and is not a `ladle data prepare` output (no "
                    "meta.json); choose another output folder or empty this one"
                )

    def __enter__(self) -> FolderWriter:
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)  # after a commit there is nothing left to remove

    def commit(self, meta: dict) -> None:
        # every file's size and checksum (into the caller's dict too), which a run checks before
        # it trains (check_files)
        meta["files"] = {f.name: _file_record(f) for f in sorted(self.tmp.iterdir()) if f.is_file()}
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        # POSIX cannot swap two folders atomically: the old one is moved aside only now that the
        # new one is complete, and deleted after.
        if self.out.exists():
            old = self.out.parent / f".{self.out.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(self.out, old)
            os.rename(self.tmp, self.out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.tmp, self.out)


def _file_record(path: Path) -> dict:
    with open(path, "rb") as f:
        return {"bytes": path.stat().st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def check_files(data_dir: str | os.PathLike, meta: dict, *, checksums: bool = False) -> None:
    """Every file meta.json lists is there and whole (its size; with `checksums`, its sha256), and
    each shard agrees with its index: a missing, truncated or damaged file is named (with the
    offset where it goes wrong) before training starts, not when a step reaches it."""
    from ladle.data.indexed import IndexedDataset

    root = Path(data_dir)
    again = f"prepare the data again (`ladle data prepare ... --output {root}`)"
    for name, want in (meta.get("files") or {}).items():
        path = root / name
        if not path.is_file():
            raise DataError(f"data folder {root}: {name} is missing (meta.json lists it); {again}")
        size = path.stat().st_size
        if size != want["bytes"]:
            cut = "truncated" if size < want["bytes"] else "longer than written"
            raise DataError(
                f"{path} is {size:,} bytes, but {want['bytes']:,} were written (meta.json): the file is {cut} "
                f"from byte offset {min(size, want['bytes']):,}; {again}"
            )
        if checksums and _file_record(path)["sha256"] != want["sha256"]:
            raise DataError(
                f"{path}: its contents differ from those written (sha256 {want['sha256'][:12]} in meta.json)"
                f"{_first_difference(path, meta)}; {again}"
            )
    for split in meta.get("splits", {}).values():
        for prefix in [*split.get("shards", []), *split.get("mask_shards", [])]:
            IndexedDataset(root / prefix).check_whole()


def fingerprint(data_dir: str | os.PathLike) -> str:
    """The identity of a prepared folder's contents (the sizes and checksums of its files, as
    meta.json records them): a checkpoint keeps it, and a resume compares (`data_changes`)."""
    root = Path(data_dir)
    if not (root / "meta.json").is_file():  # Megatron shards without one: their names and sizes
        files = sorted(p for p in (root.glob("*.[bi][id][nx]") if root.is_dir() else []) if p.is_file())
        basis = {p.name: p.stat().st_size for p in files}
    else:
        meta = load_meta(root)
        basis = meta.get("files") or {"splits": meta.get("splits"), "tokenizer": meta.get("tokenizer_hash")}
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()


def data_identity(cfg: LadleConfig, tokenizer=None) -> dict:
    """What a run trains on, kept in each checkpoint: the tokenizer's sha256 and the data
    folder's fingerprint (its files' sizes and checksums, as meta.json records them).
    `tokenizer`: the one `check` loaded (else it is loaded here)."""
    from ladle.data.tokenizer import load_tokenizer

    tok = tokenizer or load_tokenizer(cfg.tokenizer.path)
    if cfg.data.mix is not None:  # a mixture: each source's, by name
        return {"tokenizer": tok.hash, "sources": {m.name: fingerprint(m.path) for m in cfg.data.mix}}
    return {"tokenizer": tok.hash, "data": fingerprint(cfg.data.path)}


def data_changes(cfg: LadleConfig, theirs: dict | None) -> list[str]:
    """What differs from a checkpoint's `data_identity` (none recorded: nothing to compare). A
    mixture's source added or dropped is not a change of data (the mixture says so in events.log);
    a source whose folder now holds other data is."""
    if not theirs:
        return []
    mine = data_identity(cfg)
    where = {"tokenizer": f"the tokenizer at tokenizer.path {cfg.tokenizer.path}"}
    pairs = [("tokenizer", theirs.get("tokenizer"), mine["tokenizer"])]
    if "data" in mine:
        where["data"] = f"the data at data.path {cfg.data.path}"
        pairs.append(("data", theirs.get("data"), mine["data"]))
    else:
        for m in cfg.data.mix:
            where[m.name] = f"the data of data.mix source {m.name} at {m.path}"
            pairs.append((m.name, (theirs.get("sources") or {}).get(m.name), mine["sources"][m.name]))
    return [
        f"{where[k]} changed (sha256 {old[:12]} at the checkpoint, {new[:12]} now)"
        for k, old, new in pairs
        if old and old != new
    ]


def _first_difference(path: Path, meta: dict) -> str:
    """Where a damaged token file shows it: its first id beyond the vocabulary, when it has one."""
    if path.suffix != ".bin" or "vocab_size" not in meta or "dtype" not in meta:
        return ""
    ids = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
    bad = np.flatnonzero(ids >= meta["vocab_size"])
    if not bad.size:
        return ""
    at = int(bad[0])
    return (
        f"; token {at:,} (byte offset {at * ids.dtype.itemsize:,}) is id {int(ids[at])}, beyond the "
        f"vocabulary of {meta['vocab_size']:,}"
    )


class SplitWriter:
    """The shards of one split: opens the next shard when the current one would exceed shard_tokens."""

    def __init__(self, folder: Path, name: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.name, self.dtype, self.shard_tokens = folder, name, dtype, shard_tokens
        self.shards: list[str] = []
        self.documents = 0
        self.tokens = 0
        self._writer: IndexedDatasetWriter | None = None

    def add(self, doc: np.ndarray) -> None:
        if self._writer is not None and self._writer.num_tokens + doc.size > self.shard_tokens:
            self._writer.finalize()
            self._writer = None
        if self._writer is None:
            self.shards.append(f"{self.name}_{len(self.shards):05d}")
            self._writer = IndexedDatasetWriter(self.folder / self.shards[-1], self.dtype)
        self._writer.add_document(doc)
        self.documents += 1
        self.tokens += doc.size

    def close(self) -> None:
        if self._writer is not None:
            self._writer.finalize()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()

    def summary(self) -> dict:
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards}
