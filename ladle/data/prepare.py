"""`ladle data prepare`: tokenize raw text into Megatron indexed-dataset shards, and read them back.

A prepared data folder (ladle/data/folder.py: its reader and atomic writer) holds
    train_00000.bin/.idx, train_00001.bin/.idx, ...   one sequence per document, EOS appended
    val_00000.bin/.idx, ...                           documents held out for validation
    meta.json                                         what was prepared, from what, with which tokenizer

A shard is closed once the next document would take it past `shard_tokens` (a document never spans
shards). A document goes to val when a hash of (seed, its ordinal among all records read) falls below
`val_fraction`, so the split depends neither on the worker count nor on chunking.

Megatron-LM / MindSpeed data (`*_text_document.bin/.idx`, prepared with `--append-eod` so documents end
with EOS) also opens with `open_split`: in a folder without meta.json, the `*.idx`/`.bin` pairs whose
names start with "val" form the val split and all others the train split, in name order; a single
prefix (path without extension) is a train split. There is no tokenizer check for such data.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path

import numpy as np

from ladle.data.driver import Task, prepare_with
from ladle.data.folder import (
    FORMAT,
    SPLITS,
    VERSION,
    BadRecords,
    SplitWriter,
    bad_reasons,
    in_val,
    load_meta,
    tokenizer_fields,
)
from ladle.data.indexed import IndexedDataset
from ladle.data.sources import Record, iter_documents
from ladle.data.tokenizer import Tokenizer
from ladle.errors import DataError

CHUNK_DOCS = 512  # a chunk (one unit of work for a worker) closes at this many documents
CHUNK_CHARS = 1 << 18  # ... or this many characters of text (small enough to balance the workers)


def default_workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, 8))


class TextTask(Task):
    """Documents of text to token ids, EOS appended, tokenized on worker processes."""

    def __init__(self, fmt, text_field, workers, val_fraction, strict, seed, shard_tokens, progress):
        self.fmt, self.text_field, self.workers = fmt, text_field, workers
        self.val_fraction, self.strict, self.seed = val_fraction, strict, seed
        self.shard_tokens, self.progress = shard_tokens, progress

    def check(self) -> None:
        if self.workers < 1:
            raise DataError(f"workers must be at least 1, got {self.workers}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.shard_tokens < 1:
            raise DataError(f"shard_tokens must be at least 1, got {self.shard_tokens}")

    def start(self, tok: Tokenizer) -> None:
        if tok.eos_id is None:
            raise DataError(
                f"tokenizer {tok.path} has no end-of-sequence token (set eos_token in its tokenizer_config.json); "
                "prepare appends one to every document"
            )

    def write(self, folder, inputs, glob, exclude, skip, tok, dtype) -> dict:
        self.glob, self.exclude = glob, exclude
        records = iter_documents(
            inputs, glob=glob, exclude=exclude, fmt=self.fmt, text_field=self.text_field, skip=skip
        )
        return _tokenize_into(
            folder,
            records,
            tok,
            dtype,
            self.workers,
            self.val_fraction,
            self.seed,
            self.shard_tokens,
            self.strict,
            self.progress,
        )

    def meta(self, tok, dtype, inputs, stats) -> dict:
        self.seconds = stats["seconds"]
        return {
            "format": FORMAT,
            "version": VERSION,
            **tokenizer_fields(tok),
            "dtype": dtype.name,
            "splits": stats["splits"],
            "bad_records": dict(stats["bad_counts"]),
            "bad_examples": stats["bad_examples"],
            "inputs": [str(Path(i).resolve()) for i in inputs],
            "glob": self.glob,
            "exclude": list(self.exclude or []),
            "fmt": self.fmt,
            "text_field": self.text_field,
            "seed": self.seed,
            "val_fraction": self.val_fraction,
            "shard_tokens": self.shard_tokens,
        }

    def empty(self, meta: dict, inputs: list[str]) -> str | None:
        if any(s["documents"] for s in meta["splits"].values()):
            return None
        reasons = bad_reasons(meta)
        found = f"every record was bad ({reasons})" if reasons else "the files hold no records"
        return f"no usable documents in {', '.join(inputs)}: {found}; fix the data or the --format/--text-field options"

    def summary(self, meta: dict, out: Path, seconds: float) -> str:
        seconds = self.seconds  # the tokenizing alone
        train, val = meta["splits"]["train"], meta["splits"]["val"]
        docs, tokens = train["documents"] + val["documents"], train["tokens"] + val["tokens"]
        rate = f"{docs / seconds:,.0f} docs/s, {tokens / seconds:,.0f} tokens/s" if seconds else ""
        return (
            f"prepared {docs:,} documents, {tokens:,} tokens (train {train['documents']:,} docs / "
            f"{train['tokens']:,} tokens, val {val['documents']:,} / {val['tokens']:,}) in {seconds:.1f}s, "
            f"{rate} -> {out}"
        )


def prepare(
    inputs: Sequence[str | os.PathLike],
    *,
    tokenizer: str | os.PathLike,
    output: str | os.PathLike,
    glob: str | None = None,
    exclude: list[str] | None = None,
    fmt: str = "auto",
    text_field: str = "text",
    workers: int | None = None,
    val_fraction: float = 0.0,
    strict: bool = False,
    seed: int = 0,
    shard_tokens: int = 2**28,
    progress: bool = True,
) -> dict:
    """Tokenize the documents of `inputs` into the data folder `output`; return its meta.json dict.

    Bad records are counted per reason (printed to stderr, stored in meta.json); with `strict` the first
    one raises. The folder is built beside `output` and renamed into place when complete, so a failure
    leaves `output` as it was. An existing non-empty `output` is replaced only if it is a previous
    prepare output (has meta.json). `workers=1` tokenizes in this process; more workers are spawned
    processes, so a script that calls this needs the usual `if __name__ == "__main__":` guard.
    `progress`: the progress bar (the summary is always printed).
    """
    workers = default_workers() if workers is None else workers
    task = TextTask(fmt, text_field, workers, val_fraction, strict, seed, shard_tokens, progress)
    return prepare_with(
        task,
        inputs,
        tokenizer=tokenizer,
        output=output,
        glob=glob,
        exclude=exclude,
        val_fraction=val_fraction,
        summary=True,
    )


def _tokenize_into(
    folder: Path,
    records: Iterator[Record],
    tok: Tokenizer,
    dtype: np.dtype,
    workers: int,
    val_fraction: float,
    seed: int,
    shard_tokens: int,
    strict: bool,
    progress: bool,
) -> dict:
    splits = {name: SplitWriter(folder, name, dtype, shard_tokens) for name in SPLITS}
    skip = BadRecords(strict)
    ordinal = 0
    start = time.perf_counter()
    bar = _ProgressBar(progress)
    try:
        with bar:
            for flat, lengths, bad in _encoded_chunks(records, tok, dtype, workers):
                offset = 0
                bad_iter = iter(bad)
                for n in lengths.tolist():
                    ordinal += 1
                    if n == 0:  # a bad record: no tokens
                        skip(*next(bad_iter))
                        continue
                    split = "val" if val_fraction and in_val(seed, ordinal, val_fraction) else "train"
                    splits[split].add(flat[offset : offset + n])
                    offset += n
                docs = sum(s.documents for s in splits.values())
                bar.update(docs, sum(s.tokens for s in splits.values()), time.perf_counter() - start)
        for s in splits.values():
            s.close()
    except BaseException:
        for s in splits.values():
            s.abort()
        raise
    return {
        "splits": {name: s.summary() for name, s in splits.items()},
        "bad_counts": skip.counts,
        "bad_examples": skip.examples,
        "seconds": time.perf_counter() - start,
    }


def _chunks(records: Iterator[Record]) -> Iterator[list[Record]]:
    chunk: list[Record] = []
    chars = 0
    for record in records:
        chunk.append(record)
        chars += len(record.text or "")
        if len(chunk) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


# A chunk's result: all its token ids back to back, one length per record (0 for a bad record), and
# (source, reason) for each bad record in order.
ChunkResult = tuple[np.ndarray, np.ndarray, list[tuple[str, str]]]


def _encode_chunk(tok: Tokenizer, records: list[Record], eos: int, dtype: np.dtype) -> ChunkResult:
    encoded = iter(tok.encode_batch([r.text for r in records if r.bad_reason is None]))
    lengths = np.zeros(len(records), dtype=np.int64)
    docs: list[list[int]] = []
    bad: list[tuple[str, str]] = []
    for i, record in enumerate(records):
        if record.bad_reason is not None:
            bad.append((record.source, record.bad_reason))
            continue
        ids = next(encoded)
        ids.append(eos)
        docs.append(ids)
        lengths[i] = len(ids)
    flat = np.fromiter(chain.from_iterable(docs), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths, bad


# Worker processes load the tokenizer once, in the pool initializer.
_worker_state: tuple[Tokenizer, int, np.dtype] | None = None


def _init_worker(tokenizer_path: str, eos: int, dtype: str) -> None:
    global _worker_state
    # One process per core already; the tokenizer's own thread pool would oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_state = (Tokenizer(tokenizer_path), eos, np.dtype(dtype))


def _encode_in_worker(records: list[Record]) -> ChunkResult:
    tok, eos, dtype = _worker_state
    return _encode_chunk(tok, records, eos, dtype)


def _encoded_chunks(
    records: Iterator[Record], tok: Tokenizer, dtype: np.dtype, workers: int
) -> Iterator[ChunkResult]:
    """Encode chunks of records, in order. At most 2 chunks per worker are in flight, so memory stays
    flat however large the corpus."""
    if workers == 1:
        for chunk in _chunks(records):
            yield _encode_chunk(tok, chunk, tok.eos_id, dtype)
        return
    import multiprocessing

    # spawn, not fork: the parent may hold threads (tokenizers, torch) that fork would copy mid-state.
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(
        workers, initializer=_init_worker, initargs=(str(tok.path), tok.eos_id, dtype.name)
    ) as pool:
        pending: deque = deque()
        for chunk in _chunks(records):
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _ProgressBar:
    """A rich live line (documents, tokens, rates) on a terminal; nothing otherwise."""

    def __init__(self, enabled: bool):
        self._progress = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("[bold]preparing[/]"),
                TextColumn("{task.completed:,} docs"),
                TextColumn("{task.fields[tokens]:,} tokens"),
                TextColumn("{task.fields[rates]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self._task = self._progress.add_task("prepare", total=None, tokens=0, rates="")

    def __enter__(self):
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, docs: int, tokens: int, seconds: float) -> None:
        if self._progress is not None:
            rates = f"{docs / seconds:,.0f} docs/s  {tokens / seconds:,.0f} tokens/s" if seconds else ""
            self._progress.update(self._task, completed=docs, tokens=tokens, rates=rates)


class TokenStream:
    """All shards of one split as one flat token stream.

    `doc_starts`/`doc_lengths` (int64) give every document's span in the stream, in order; `read(start,
    stop)` returns a fresh array of tokens [start, stop), across shard boundaries if need be. With no
    shards it is an empty stream (num_tokens 0). `meta` is the folder's meta.json dict, or None for
    Megatron data without one. Pickles by path (cheap to send to DataLoader workers).
    """

    def __init__(self, prefixes: Iterable[str | os.PathLike], meta: dict | None = None):
        self.prefixes = [Path(p) for p in prefixes]
        self.meta = meta
        self.vocab = int(meta["vocab_size"]) if meta and meta.get("vocab_size") else None
        self._shards = [IndexedDataset(p) for p in self.prefixes]
        dtypes = {s.dtype for s in self._shards}
        if len(dtypes) > 1:
            raise DataError(
                f"shards {[str(p) for p in self.prefixes]} mix token dtypes {sorted(map(str, dtypes))}"
            )
        self.dtype = dtypes.pop() if dtypes else np.dtype(meta["dtype"] if meta else np.uint16)
        sizes = [s.num_tokens for s in self._shards]
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.num_tokens = int(self._shard_starts[-1])
        spans = [_document_spans(s) for s in self._shards]
        self.doc_starts = np.concatenate(
            [np.zeros(0, np.int64)]
            + [starts + base for (starts, _), base in zip(spans, self._shard_starts[:-1], strict=True)]
        )
        self.doc_lengths = np.concatenate([np.zeros(0, np.int64)] + [lengths for _, lengths in spans])

    @property
    def num_documents(self) -> int:
        return self.doc_starts.size

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside the stream's {self.num_tokens} tokens")
        out = np.empty(stop - start, dtype=self.dtype)
        shard = int(np.searchsorted(self._shard_starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            base, end = int(self._shard_starts[shard]), min(stop, int(self._shard_starts[shard + 1]))
            out[pos - start : end - start] = self._shards[shard].tokens[pos - base : end - base]
            pos, shard = end, shard + 1
        if self.vocab and out.size and int(out.max()) >= self.vocab:  # a damaged shard, named
            at = start + int(np.argmax(out >= self.vocab))
            k = int(np.searchsorted(self._shard_starts, at, side="right")) - 1
            offset = (at - int(self._shard_starts[k])) * self.dtype.itemsize
            raise DataError(
                f"{self.prefixes[k]}.bin: the token at byte offset {offset:,} is id {int(out[at - start])}, "
                f"beyond the vocabulary of {self.vocab:,}: the shard is damaged; prepare the data again "
                "(data.verify=checksums finds such damage before training)"
            )
        return out

    def __getstate__(self) -> dict:
        return {"prefixes": [str(p) for p in self.prefixes], "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefixes"], state["meta"])


def _document_spans(shard: IndexedDataset) -> tuple[np.ndarray, np.ndarray]:
    """Token start and length of every non-empty document of a shard (a Megatron document may be
    several consecutive sequences)."""
    seq_starts = shard.sequence_pointers // shard.dtype.itemsize
    seq_ends = seq_starts + shard.sequence_lengths
    di = shard.document_indices
    if di.size == 0 or di[0] != 0 or di[-1] != len(shard) or np.any(np.diff(di) < 0):
        raise DataError(f"{shard.prefix}.idx has malformed document indices")
    first, stop = di[:-1], di[1:]
    nonempty = stop > first
    starts = seq_starts[first[nonempty]]
    return starts.astype(np.int64), (seq_ends[stop[nonempty] - 1] - starts).astype(np.int64)


def open_split(data_dir: str | os.PathLike, split: str = "train") -> TokenStream:
    """The tokens of `split` ("train" or "val") of a prepared folder, or of Megatron data (see the
    module docstring). An empty split (val with val_fraction 0) is an empty stream."""
    path = Path(data_dir)
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if (path / "meta.json").is_file():
        meta = load_meta(path)
        shards = meta["splits"].get(split, {}).get("shards", [])
        return TokenStream([path / s for s in shards], meta)
    if path.is_dir():
        prefixes = sorted(p.with_suffix("") for p in path.glob("*.idx"))
    elif Path(f"{path}.idx").is_file():
        prefixes = [path]
    else:
        prefixes = []
    if not prefixes:
        raise DataError(f"data folder {path} not found (or has no meta.json): run `ladle data prepare` first")
    # Without meta.json, pairs named val* are the val split and all others the train split.
    is_val = [p.name.startswith("val") for p in prefixes]
    return TokenStream([p for p, v in zip(prefixes, is_val, strict=True) if v == (split == "val")])
