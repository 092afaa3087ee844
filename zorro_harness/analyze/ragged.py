"""Token-id sequences as one flat array and offsets (no Python object per id), and their index math."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class Ragged:
    """Token-id sequences as one flat array and offsets: sequence i is flat[offsets[i]:offsets[i + 1]]."""

    flat: np.ndarray
    offsets: np.ndarray

    @property
    def lens(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]] | Sequence[np.ndarray]) -> "Ragged":
        lens = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        if rows and all(isinstance(r, np.ndarray) for r in rows):
            return cls(np.concatenate(rows, dtype=np.int64), offsets)  # one copy, whatever the rows' dtype
        flat = np.fromiter((t for r in rows for t in r), dtype=np.int64, count=int(offsets[-1]))
        return cls(flat, offsets)

    def concat(self, other: "Ragged") -> "Ragged":
        """Row i of self followed by row i of other."""
        lens = self.lens + other.lens
        offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        idx_a = ragged_arange(offsets[:-1], self.lens)
        idx_b = ragged_arange(offsets[:-1] + self.lens, other.lens)
        flat = np.empty(int(offsets[-1]), dtype=np.int64)
        flat[idx_a] = self.flat
        flat[idx_b] = other.flat
        return Ragged(flat, offsets)


def ragged_arange(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + lens[i]) over i, vectorised."""
    lens = np.asarray(lens, dtype=np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    seg_begin = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(starts, dtype=np.int64) - seg_begin, lens)
