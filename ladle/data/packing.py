"""SFT chats as training rows of `seq_len` tokens, for the same loaders as pretraining.

Packed (`data.packing: true`): chats are laid one after another into a row as long as they fit
(in a seeded random order, fixed for the run; the loader then shuffles rows each epoch). Each
chat is its own document, so the document-aware attention keeps chats apart and positions restart
at every chat; the gap at the end of a row is padding. Padded (`false`): one chat per row. Both
give the same loss for the same chats (tests/test_sft.py): only the trained targets count, and
the loss is normalised by the trained tokens of the whole global batch (ladle/train/unit.py).

A chat of n tokens gives n - 1 (input, target) pairs; one longer than `seq_len` + 1 tokens keeps
its first `seq_len` pairs (counted in `truncated`).
"""

from __future__ import annotations

import numpy as np

from ladle.data.sft import SFTSplit
from ladle.errors import DataError

IGNORE_INDEX = -100  # as ladle.train.loss, without importing torch code here


class SFTSamples:
    """Rows of an SFT split: `len()`, `get(i)` -> tokens, targets, positions, doc_ids (T,)."""

    unit = "chats"  # what `documents(r)` counts, in a report

    def __init__(
        self,
        split: SFTSplit,
        seq_len: int,
        *,
        packing: bool = True,
        seed: int = 0,
        pad_id: int = 0,
        name: str = "train",
    ):
        self.split, self.seq_len, self.pad_id, self.name = split, seq_len, pad_id, name
        pairs = np.minimum(split.lengths - 1, seq_len)  # (input, target) pairs each chat gives
        self.truncated = int((split.lengths - 1 > seq_len).sum())
        if packing:
            order = np.random.default_rng(seed).permutation(len(split))
            self.rows, row, used = [], [], 0
            for i in order.tolist():
                if row and used + pairs[i] > seq_len:
                    self.rows.append(row)
                    row, used = [], 0
                row.append(i)
                used += int(pairs[i])
            if row:
                self.rows.append(row)
        else:
            self.rows = [[i] for i in range(len(split))]
        self.num_samples = len(self.rows)
        if self.num_samples == 0 and name == "train":
            raise DataError(f"the {name} split holds no chats")
        self.fill = float(pairs.sum()) / max(1, self.num_samples * seq_len)  # share of real tokens

    def __len__(self) -> int:
        return self.num_samples

    def documents(self, r: int) -> list[int]:
        """The split's chats row r holds."""
        return self.rows[r]

    def get(self, r: int) -> dict[str, np.ndarray]:
        T = self.seq_len
        tokens = np.full(T, self.pad_id, dtype=np.int64)
        targets = np.full(T, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(T, dtype=np.int64)
        doc_ids = np.zeros(T, dtype=np.int64)
        off = 0
        for d, i in enumerate(self.rows[r]):
            ids, mask = self.split.get(i)
            ids, mask = ids[: T + 1], mask[: T + 1]
            n = len(ids) - 1
            tokens[off : off + n] = ids[:-1]
            targets[off : off + n] = np.where(mask[1:], ids[1:], IGNORE_INDEX)  # trained targets only
            positions[off : off + n] = np.arange(n)
            doc_ids[off : off + n] = d
            off += n
        # The padding is a document of its own: it attends to itself only, and trains nothing.
        positions[off:] = np.arange(T - off)
        doc_ids[off:] = len(self.rows[r])
        return {"tokens": tokens, "targets": targets, "positions": positions, "doc_ids": doc_ids}
