"""Length buckets: edges chosen from the length histogram so that padding wastes the least compute.

The cost model: a micro-batch holds a token budget T. A bucket with edge e (its longest sample,
rounded up to `pad_multiple`) packs m = max(1, T // e) samples per micro-batch, each padded to e,
so its n samples cost ceil(n / m) * m * e token slots (the last, partial micro-batch is padded
with empty rows, as a fixed-shape loader does). The padding fraction is 1 - real tokens / slots.
Edges are chosen by exact dynamic programming over the sorted distinct lengths: the optimal
partition of a sorted histogram into at most K contiguous buckets (O(K L^2) for L distinct lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MAX_CANDIDATES = 1024


def round_up(lengths: np.ndarray, pad_multiple: int, max_len: int) -> np.ndarray:
    return np.minimum(-(-lengths // pad_multiple) * pad_multiple, max_len)


def bucket_slots(count: int, edge: int, micro_batch_tokens: int) -> int:
    """Token slots that `count` samples padded to `edge` take in micro-batches of the budget."""
    per_batch = max(1, micro_batch_tokens // edge)
    return -(-count // per_batch) * per_batch * edge


@dataclass(frozen=True)
class BucketCost:
    tokens: int
    slots: int

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


def cost_of_edges(lengths: np.ndarray, counts: np.ndarray, edges: list[int], micro_batch_tokens: int) -> BucketCost:
    """Real tokens and token slots of a histogram (lengths, counts) cut at the given bucket edges."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    bucket = np.searchsorted(np.asarray(edges), lengths, side="left")
    if len(lengths) and bucket.max(initial=0) >= len(edges):
        raise ValueError("a length exceeds the last bucket edge")
    slots = sum(bucket_slots(int(counts[bucket == b].sum()), edge, micro_batch_tokens)
                for b, edge in enumerate(edges) if counts[bucket == b].sum())
    return BucketCost(tokens=int((lengths * counts).sum()), slots=int(slots))


def one_bucket_edges(lengths: np.ndarray, pad_multiple: int, max_len: int) -> list[int]:
    """The baseline: every sample padded to the longest (rounded up to pad_multiple)."""
    if not len(lengths):
        return []
    return [int(round_up(np.asarray([max(lengths)]), pad_multiple, max_len)[0])]


def choose_edges(lengths: np.ndarray, counts: np.ndarray, micro_batch_tokens: int, max_buckets: int,
                 pad_multiple: int, max_len: int) -> list[int]:
    """Bucket edges (increasing) that minimise token slots; the fewest buckets among equal optima."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    keep = counts > 0
    if not keep.any():
        return []
    rounded = round_up(lengths[keep], pad_multiple, max_len)
    candidates, inverse = np.unique(rounded, return_inverse=True)
    n_at = np.bincount(inverse, weights=counts[keep]).astype(np.int64)
    if len(candidates) > _MAX_CANDIDATES:  # coarsen: merge candidates into quantile groups (keeps their max)
        cum = np.cumsum(n_at) / n_at.sum()
        group = np.minimum((cum * _MAX_CANDIDATES).astype(np.int64), _MAX_CANDIDATES - 1)
        last = np.flatnonzero(np.r_[group[1:] != group[:-1], True])
        n_at = np.add.reduceat(n_at, np.r_[0, last[:-1] + 1])
        candidates = candidates[last]
    L = len(candidates)
    prefix = np.concatenate([[0], np.cumsum(n_at)])
    i = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    count_ij = np.where(j >= i, prefix[np.minimum(j + 1, L)] - prefix[i], 0)  # samples in bucket i..j
    per_batch = np.maximum(1, micro_batch_tokens // candidates)[None, :]
    cost = np.where(j >= i, -(-count_ij // per_batch) * per_batch * candidates[None, :], np.iinfo(np.int64).max // 4)
    # best[k][j]: least slots for candidates 0..j in k+1 buckets; choice[k][j]: start of the last bucket
    best = [cost[0].copy()]
    choice = [np.zeros(L, dtype=np.int64)]
    for _ in range(1, min(max_buckets, L)):
        prev = np.concatenate([[0], best[-1][:-1]])  # prev[i] = best of 0..i-1 (0 when i == 0)
        prev[0] = np.iinfo(np.int64).max // 4  # a bucket starting at 0 has no earlier buckets: use k-1 level
        total = prev[:, None] + cost
        start = total.argmin(axis=0)
        value = total[start, np.arange(L)]
        # also allow fewer buckets: keep the previous level's answer when it is no worse
        no_worse = best[-1] <= value
        best.append(np.where(no_worse, best[-1], value))
        choice.append(np.where(no_worse, -1, start))
    k = min(range(len(best)), key=lambda level: (best[level][L - 1], level))
    edges, end = [], L - 1
    while end >= 0:
        start = choice[k][end]
        while start == -1:  # this level kept the answer of the level below
            k -= 1
            start = choice[k][end]
        edges.append(int(candidates[end]))
        end, k = start - 1, k - 1
        if k < 0 and end >= 0:  # level 0 always starts its bucket at candidate 0
            raise AssertionError("bucket backtracking went past level 0")
    return sorted(edges)
