"""A dataset's distinct sequences sorted once (token order, a prefix first), with the common prefix of
any two as a range minimum over a sparse table: what the call simulation (zorro_harness.analyze.
workload_sim) counts each call's trie with."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zorro_harness.analyze.ragged import Ragged, ragged_arange


def pair_lcp(seqs: Ragged, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Common-prefix length of seqs[x[i]] and seqs[y[i]], vectorised: windows of growing width, the
    pairs that differed dropped after each."""
    lens = seqs.lens
    m = np.minimum(lens[x], lens[y])
    out = m.copy()
    todo = np.flatnonzero(m > 0)
    s, w = 0, 32
    while todo.size:
        width = np.clip(m[todo] - s, 0, w)
        ax = ragged_arange(seqs.offsets[x[todo]] + s, width)
        ay = ragged_arange(seqs.offsets[y[todo]] + s, width)
        neq = seqs.flat[ax] != seqs.flat[ay]
        pair = np.repeat(np.arange(todo.size), width)
        k = ragged_arange(np.full(todo.size, s), width)
        hit = np.flatnonzero(neq)
        p, first = np.unique(pair[hit], return_index=True)
        out[todo[p]] = k[hit[first]]
        done = np.zeros(todo.size, dtype=bool)
        done[p] = True
        done |= m[todo] <= s + w
        todo = todo[~done]
        s, w = s + w, w * 4
    return out


@dataclass
class PrefixIndex:
    """The distinct sequences of a Ragged, sorted (token order, a prefix first), with range-minimum
    common prefixes."""

    rank: np.ndarray
    """[n] rank of each sequence among the distinct ones (identical sequences share a rank)."""
    lens: np.ndarray
    """[D] length of the distinct sequence of each rank."""
    table: np.ndarray
    """[K, D - 1] sparse table: table[k, i] = min of the adjacent common prefixes i .. i + 2^k - 1."""

    @classmethod
    def build(cls, seqs: Ragged) -> "PrefixIndex":
        # Big-endian keys sort as the id sequences do; 4 bytes an id where every id fits (ids of 2**32
        # and above would wrap onto small ones), else 8.
        width = 4 if not seqs.flat.size or (seqs.flat.min() >= 0 and seqs.flat.max() < 2**32) else 8
        big = seqs.flat.astype(f">u{width}").tobytes()
        off = (seqs.offsets * width).tolist()
        keys = [big[a:b] for a, b in zip(off[:-1], off[1:])]
        order = sorted(range(len(keys)), key=keys.__getitem__)
        new = np.ones(len(order), dtype=bool)
        new[1:] = [keys[a] != keys[b] for a, b in zip(order[:-1], order[1:])]
        rank_sorted = np.cumsum(new) - 1
        rank = np.empty(len(order), dtype=np.int64)
        rank[np.asarray(order)] = rank_sorted
        reps = np.asarray(order)[new]
        lcp = pair_lcp(seqs, reps[:-1], reps[1:]) if reps.size > 1 else np.zeros(0, dtype=np.int64)
        levels = [lcp]
        while 2 ** len(levels) <= lcp.size:
            prev, h = levels[-1], 2 ** (len(levels) - 1)
            levels.append(np.minimum(prev[:-h], prev[h:]))
        table = np.zeros((len(levels), max(lcp.size, 1)), dtype=np.int64)
        for k, lv in enumerate(levels):
            table[k, : lv.size] = lv
        return cls(rank, seqs.lens[reps], table)

    def lcp(self, ra: np.ndarray, rb: np.ndarray) -> np.ndarray:
        """Common prefix of the distinct sequences of ranks ra < rb (elementwise)."""
        span = rb - ra
        k = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
        return np.minimum(self.table[k, ra], self.table[k, rb - (1 << k)])
