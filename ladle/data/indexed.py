"""Megatron-LM's indexed dataset: a `.bin` of raw tokens and an `.idx` that says where each sequence is.

Same files as `megatron/core/datasets/indexed_dataset.py` (`IndexedDatasetBuilder`, `_IndexWriter`,
`_IndexReader`; checked against NVIDIA/Megatron-LM main), so data prepared by Megatron-LM's
`tools/preprocess_data.py` or MindSpeed loads here and ours loads there.

`.bin`: the tokens of all sequences, back to back, in the index's dtype, native little-endian.

`.idx`, all little-endian:
    offset  size      field
    0       9         magic b"MMIDIDX\\x00\\x00"
    9       8  <Q     version, 1
    17      1  <B     dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
                      8 uint16
    18      8  <Q     sequence count S
    26      8  <Q     document-index count D (= number of documents + 1)
    34      4*S       int32 sequence_lengths, in tokens
    ..      8*S       int64 sequence_pointers, byte offsets of each sequence into the .bin
    ..      8*D       int64 document_indices: document k is sequences [di[k], di[k+1]); di[0] = 0
    ..      1*S       int8 sequence_modes, only in multimodal datasets (detected here from the size)

Megatron can split a document into several sequences (sentence splitting); ladle writes one sequence per
document, so `dataset[i]` is document i.

Token dtype: `dtype_for_vocab` picks uint16 when every id fits (vocab_size <= 65536) and int32 otherwise.
int32, not uint32, because Megatron's dtype codes have no uint32; ids stay below 2**31 in any real vocab.
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import numpy as np

from ladle.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34  # magic 9 + version 8 + dtype code 1 + sequence count 8 + document-index count 8

DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits (ids < 65536), else int32 (Megatron has no uint32 code)."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


class IndexedDatasetWriter:
    """Write `prefix.bin` + `prefix.idx`, one sequence per document.

    Both files are written under temporary names and renamed on `finalize()`, .bin first, so a crash
    never leaves a half-written pair under the final names. Used as a context manager, an exception
    discards the temporary files instead.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron code; use one of {list(CODE_OF_DTYPE)}")
        self._tmp_bin = Path(f"{prefix}.bin.tmp")
        self._tmp_idx = Path(f"{prefix}.idx.tmp")
        self._bin = open(self._tmp_bin, "wb", buffering=1 << 20)
        # array("i") holds 4 bytes per document where a list of ints would take ~36.
        self._lengths = array("i")
        self.num_tokens = 0
        self._done = False

    def __len__(self) -> int:
        return len(self._lengths)

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"a document must be a 1-d token array, got shape {arr.shape}")
        if arr.size and arr.dtype != self.dtype:
            if arr.min() < np.iinfo(self.dtype).min or arr.max() > np.iinfo(self.dtype).max:
                raise ValueError(f"token ids out of range for {self.dtype}")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(arr.size)
        self.num_tokens += arr.size

    def finalize(self) -> None:
        if self._done:
            return
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        count = lengths.size
        pointers = np.zeros(count, dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        doc_indices = np.arange(count + 1, dtype=np.int64)
        with open(self._tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF_DTYPE[self.dtype]))
            f.write(struct.pack("<Q", count))
            f.write(struct.pack("<Q", doc_indices.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_indices.astype("<i8").tobytes())
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(self._tmp_idx, idx_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        """Close and delete the temporary files; nothing appears under the final names."""
        self._bin.close()
        for tmp in (self._tmp_bin, self._tmp_idx):
            tmp.unlink(missing_ok=True)
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Memory-mapped read of a `prefix.bin` + `prefix.idx` pair. `dataset[i]` is sequence i."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        idx, binf = idx_path(prefix), bin_path(prefix)
        for path in (idx, binf):
            if not path.is_file():
                raise DataError(
                    f"indexed dataset file {path} not found (need both {idx.name} and {binf.name})"
                )
        self._read_index(idx)
        nbytes = binf.stat().st_size
        if nbytes % self.dtype.itemsize:
            raise DataError(f"{binf} holds {nbytes} bytes, not a whole number of {self.dtype} tokens")
        # np.memmap refuses empty files, and an empty dataset is legal.
        self.tokens = np.memmap(binf, dtype=self.dtype, mode="r") if nbytes else np.zeros(0, dtype=self.dtype)
        ends = self.sequence_pointers + self.sequence_lengths.astype(np.int64) * self.dtype.itemsize
        if ends.size and (ends.max() > nbytes or self.sequence_pointers.min() < 0):
            i = int(np.argmax((ends > nbytes) | (self.sequence_pointers < 0)))
            raise DataError(
                f"{idx} places sequence {i} at bytes {int(self.sequence_pointers[i]):,}-{int(ends[i]):,} of "
                f"{binf}, which holds {nbytes:,} bytes: the pair is truncated or mismatched"
            )
        self._end = int(ends.max()) if ends.size else 0

    def check_whole(self) -> None:
        """The .bin holds exactly what the .idx says (no bytes after the last sequence either)."""
        nbytes = self.tokens.size * self.dtype.itemsize
        if nbytes != self._end:
            raise DataError(
                f"{bin_path(self.prefix)} holds {nbytes:,} bytes, but its index {idx_path(self.prefix).name} "
                f"ends at byte offset {self._end:,}: the pair is mismatched or the .bin was appended to"
            )

    def _read_index(self, path: Path) -> None:
        data = path.read_bytes()
        if len(data) < HEADER_SIZE or data[:9] != MAGIC:
            raise DataError(f"{path} is not a Megatron indexed dataset index (no MMIDIDX header)")
        (version,) = struct.unpack_from("<Q", data, 9)
        if version != VERSION:
            raise DataError(f"{path} has index version {version}; only version {VERSION} is supported")
        (code,) = struct.unpack_from("<B", data, 17)
        if code not in DTYPE_CODES:
            raise DataError(f"{path} has unknown dtype code {code}; known codes are 1-8")
        self.dtype = np.dtype(DTYPE_CODES[code])
        count, doc_count = struct.unpack_from("<QQ", data, 18)
        expected = HEADER_SIZE + 12 * count + 8 * doc_count
        if len(data) not in (expected, expected + count):  # + count: int8 sequence_modes (multimodal)
            raise DataError(
                f"{path} is {len(data)} bytes but its header ({count} sequences, {doc_count} document "
                f"indices) needs {expected}: the file is truncated or corrupt"
            )
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(data, dtype="<i4", count=count, offset=offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(data, dtype="<i8", count=count, offset=offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(data, dtype="<i8", count=doc_count, offset=offset)
        offset += 8 * doc_count
        self.sequence_modes = (
            np.frombuffer(data, dtype=np.int8, count=count, offset=offset) if len(data) > expected else None
        )

    def __len__(self) -> int:
        return self.sequence_lengths.size

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix}")
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.sequence_lengths[i])]

    @property
    def num_tokens(self) -> int:
        return self.tokens.size

    # Pickle by path: a memmap would otherwise be pickled as a full copy of the tokens.
    def __getstate__(self) -> dict:
        return {"prefix": str(self.prefix)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])
