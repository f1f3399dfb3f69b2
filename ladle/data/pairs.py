"""Preference pairs as training rows, for the DPO and reward recipes (ladle/preference/losses.py).

A row is one pair: `tokens` (2, T) holds the chosen and the rejected sequence (prompt +
completion), each from position 0 and padded at its end, so plain causal attention keeps them
apart; `targets` (2, T) the next token where it belongs to the completion (IGNORE elsewhere:
prompt tokens never count); `ends` (2,) the position of each side's last token (where a reward
model reads its score); `ref_logps` (2,) a cached reference's summed log-probs, when given.
"""

from __future__ import annotations

import numpy as np

from ladle.data.preference import PreferenceSplit
from ladle.errors import DataError

IGNORE_INDEX = -100  # as ladle.train.loss, without importing torch code here


class PairSamples:
    unit = "pairs"  # what `documents(i)` counts, in a report

    def __init__(
        self,
        split: PreferenceSplit,
        seq_len: int,
        *,
        pad_id: int = 0,
        name: str = "train",
        ref_logps: np.ndarray | None = None,
    ):
        self.split, self.seq_len, self.pad_id, self.ref_logps = split, seq_len, pad_id, ref_logps
        self.name = name
        longest = int(split.lengths.max()) if len(split) else 0
        if longest > seq_len:
            over = int((split.lengths > seq_len).any(1).sum())
            raise DataError(
                f"{over} pairs of the {name} split have a side longer than data.seq_len ({seq_len} tokens; the "
                f"longest has {longest}); raise data.seq_len to {longest}, or prepare the data with "
                f"--max-len {seq_len} --overlong truncate"
            )
        if len(split) == 0 and name == "train":
            raise DataError(f"the {name} split holds no pairs")
        if ref_logps is not None and ref_logps.shape != (len(split), 2):
            raise DataError(f"cached reference log-probs of shape {ref_logps.shape} for {len(split)} pairs")

    def __len__(self) -> int:
        return len(self.split)

    def documents(self, i: int) -> list[int]:
        return [i]

    def get(self, i: int) -> dict[str, np.ndarray]:
        T = self.seq_len
        tokens = np.full((2, T), self.pad_id, dtype=np.int64)
        targets = np.full((2, T), IGNORE_INDEX, dtype=np.int64)
        ends = np.zeros(2, dtype=np.int64)
        c_ids, c_mask, r_ids, r_mask = self.split.get(i)
        for side, (ids, mask) in enumerate(((c_ids, c_mask), (r_ids, r_mask))):
            n = len(ids)
            tokens[side, :n] = ids
            targets[side, : n - 1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
            ends[side] = n - 1
        row = {"tokens": tokens, "targets": targets, "ends": ends}
        if self.ref_logps is not None:
            row["ref_logps"] = self.ref_logps[i].astype(np.float32)
        return row
