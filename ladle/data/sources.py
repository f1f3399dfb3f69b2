"""Streaming readers for raw training text: walk the inputs, yield one record per document.

Formats (`fmt`):
  - "text": one document per file (the whole file, decoded as strict UTF-8).
  - "jsonl": one JSON object per line; the document is its `text_field` string. Blank lines are not
    records and are skipped.
  - "parquet": one document per row of the `text_field` column, read batch by batch (needs pyarrow).
  - "auto": by extension: .jsonl/.json -> jsonl, .parquet -> parquet, anything else -> text.

Every record says where it came from (`path:line` for text and jsonl, `path:row N` with a 0-based N for
parquet, the row number pandas and pyarrow use) so a bad one can be found. A bad record has
`text=None` and a short `bad_reason`; callers count them, nothing is dropped silently. A document that
is empty or only whitespace is bad ("empty text") in every format.

Memory stays flat: text files are read one at a time, jsonl line by line, parquet batch by batch.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from ladle.errors import DataError

FORMATS = ("auto", "text", "jsonl", "parquet")
PARQUET_BATCH_ROWS = 1024


class Record(NamedTuple):
    source: str  # "path:line" or "path:row N"
    text: str | None  # None for a bad record
    bad_reason: str | None  # None for a good record


def iter_files(
    inputs: Iterable[str | os.PathLike],
    glob: str | None = None,
    exclude: Iterable[str] | None = None,
    *,
    skip: Iterable[str | os.PathLike] = (),
) -> Iterator[Path]:
    """Yield the files named by `inputs`, in a deterministic order.

    A file input is yielded as is (glob and exclude apply only inside directories). A directory is
    walked recursively in sorted order (the order of `sorted(path.parts)`), keeping files whose name
    matches `glob` (fnmatch, e.g. "*.py") and whose path relative to the directory matches none of the
    `exclude` patterns (fnmatch, "/"-separated, e.g. "test/*" or "site-packages/*"). A directory whose
    relative path matches an exclude pattern as "dir" or "dir/" is not entered at all. Symlinked
    directories inside an input are not followed (they can loop); symlinked files are. Directories in
    `skip` (e.g. the output being written) are never entered.
    """
    exclude = list(exclude or [])
    skipped = {os.path.realpath(p) for p in skip}
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            yield from _walk(path, "", glob, exclude, skipped)
        elif path.is_file():
            yield path
        else:
            raise DataError(f"input {path} does not exist; pass existing files or directories")


def no_files_message(inputs: Iterable, glob: str | None, exclude: Iterable[str] | None) -> str:
    """The DataError message for inputs that name no file."""
    names = ", ".join(str(i) for i in inputs) or "(none)"
    message = f"no input files found in {names}"
    if glob:
        message += f" matching glob {glob!r}"
    if exclude:
        message += f" outside exclude patterns {list(exclude)}"
    return message + "; check the paths and the --glob/--exclude patterns"


def _walk(root: Path, rel: str, glob: str | None, exclude: list[str], skipped: set[str]) -> Iterator[Path]:
    folder = root / rel if rel else root
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as e:
        raise DataError(f"cannot list input directory {folder}: {e.strerror}") from e
    for entry in entries:
        rel_path = f"{rel}/{entry.name}" if rel else entry.name
        if entry.is_dir(follow_symlinks=False):
            if skipped and os.path.realpath(entry.path) in skipped:
                continue
            if not any(fnmatch.fnmatch(rel_path, p) or fnmatch.fnmatch(rel_path + "/", p) for p in exclude):
                yield from _walk(root, rel_path, glob, exclude, skipped)
        elif entry.is_file():
            if glob is not None and not fnmatch.fnmatch(entry.name, glob):
                continue
            if any(fnmatch.fnmatch(rel_path, p) for p in exclude):
                continue
            yield Path(entry.path)


def format_of(path: Path, fmt: str = "auto") -> str:
    """The reader to use for `path`: `fmt` itself unless it is "auto"."""
    if fmt not in FORMATS:
        raise DataError(f"unknown data format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def iter_documents(
    inputs: Iterable[str | os.PathLike],
    *,
    glob: str | None = None,
    exclude: Iterable[str] | None = None,
    fmt: str = "auto",
    text_field: str = "text",
    skip: Iterable[str | os.PathLike] = (),
) -> Iterator[Record]:
    """Yield one `Record` per document of every file of `inputs` (see `iter_files`)."""
    for path in iter_files(inputs, glob, exclude, skip=skip):
        kind = format_of(path, fmt)
        if kind == "text":
            yield _read_text(path)
        elif kind == "jsonl":
            yield from _read_jsonl(path, text_field)
        else:
            yield from _read_parquet(path, text_field)


def _bad(source: str, reason: str) -> Record:
    return Record(source, None, reason)


def _read_text(path: Path) -> Record:
    # One file is one document, so reading it whole is the unit of work, not the corpus.
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return _bad(f"{path}:{line}", "undecodable bytes")
    if not text.strip():
        return _bad(f"{path}:1", "empty text")
    return Record(f"{path}:1", text, None)


def _read_jsonl(path: Path, field: str) -> Iterator[Record]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            source = f"{path}:{number}"
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield _bad(source, "undecodable bytes")
                continue
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, RecursionError):  # a nesting bomb too
                yield _bad(source, "invalid JSON")
                continue
            yield _checked(source, obj.get(field, None) if isinstance(obj, dict) else None, field)


def _checked(source: str, value: object, field: str) -> Record:
    if value is None:
        return _bad(source, f"missing field {field!r}")
    if not isinstance(value, str):
        return _bad(source, f"non-string field {field!r}")
    if not value.strip():
        return _bad(source, "empty text")
    return Record(source, value, None)


def _read_parquet(path: Path, field: str) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq  # lazy: parquet support is optional
    except ImportError as e:
        raise DataError(f"reading {path} needs pyarrow: pip install 'ladle[parquet]'") from e
    import pyarrow as pa

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read Parquet file {path}: {e}") from e
    if field not in parquet.schema_arrow.names:
        # Still one bad record per row, so the counts say how much data the wrong field name cost.
        for row in range(parquet.metadata.num_rows):
            yield _bad(f"{path}:row {row}", f"missing field {field!r}")
        return
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
            for value in batch.column(0).to_pylist():
                yield _checked(f"{path}:row {row}", value, field)
                row += 1
    except pa.ArrowException as e:
        raise DataError(f"cannot read Parquet file {path} at row {row}: {e}") from e


def iter_rows(
    inputs: Iterable[str | os.PathLike],
    *,
    glob: str | None = None,
    exclude: Iterable[str] | None = None,
    skip: Iterable[str | os.PathLike] = (),
) -> Iterator[tuple[str, dict | None, str | None]]:
    """(source, object, None) for every jsonl line or Parquet row of `inputs` as a dict, or
    (source, None, reason) for one that cannot be read; the reader of structured (SFT) records."""
    for path in iter_files(inputs, glob, exclude, skip=skip):
        kind = format_of(path)
        if kind == "parquet":
            yield from _parquet_rows(path)
            continue
        if kind != "jsonl":
            yield f"{path}:1", None, "not a jsonl or Parquet file"
            continue
        with open(path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                source = f"{path}:{number}"
                if not raw.strip():
                    continue
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # a nesting bomb too
                    yield source, None, "invalid JSON"
                    continue
                if isinstance(obj, dict):
                    yield source, obj, None
                else:
                    yield source, None, "not a JSON object"


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict | None, str | None]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"reading {path} needs pyarrow: pip install 'ladle[parquet]'") from e
    import pyarrow as pa

    try:
        parquet = pq.ParquetFile(path)
        row = 0
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for obj in batch.to_pylist():
                yield f"{path}:row {row}", obj, None
                row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"cannot read Parquet file {path}: {e}") from e
