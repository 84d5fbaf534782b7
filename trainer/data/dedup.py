"""Exact and near-duplicate detection: what to hash per document, and how to resolve the pairs.

Exact: a 64-bit BLAKE2b of the text after folding case and whitespace.
Near: MinHash (Broder 1997) over word n-gram shingles, banded LSH (Leskovec, Rajaraman, Ullman,
*Mining of Massive Datasets*, ch. 3.4: b bands of r rows make a pair a candidate with probability
1 - (1 - J^r)^b), and every candidate pair is verified: its estimated Jaccard similarity (the share
of equal signature slots) must reach the threshold.

Per-document work (`DocumentHasher`) is vectorised over a batch with numpy and never keeps the
corpus; resolution (`resolve_duplicates`) runs afterwards over the per-document hashes spooled to
disk, one band at a time, so memory grows by a few bytes per document, not with the text.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd

WORD_RE = re.compile(r"\w+")
_MASK32 = np.uint64(0xFFFFFFFF)


def normalise(text: str) -> str:
    """Case- and whitespace-folded text: what 'exact duplicate' compares."""
    return " ".join(text.lower().split())


def exact_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(normalise(text).encode("utf-8"), digest_size=8).digest(), "little")


def words(text: str) -> list[str]:
    return WORD_RE.findall(text.lower())


@dataclass(frozen=True)
class MinHashParams:
    num_perm: int = 128
    bands: int = 16
    shingle_words: int = 5
    seed: int = 1

    @property
    def rows(self) -> int:
        return self.num_perm // self.bands


class DocumentHasher:
    """MinHash signatures of word-shingle sets, vectorised over a batch of documents.

    A shingle is n consecutive words (a document shorter than n words is one shingle). Its 64-bit
    hash combines the words' stable hashes (pandas' SipHash, fixed key) with random odd
    multipliers; it is folded to 32 bits and permuted by multiply-add-shift hashing
    (Dietzfelbinger 1996: (a x + b) mod 2^64 >> 32 is strongly universal for 32-bit x), which
    stands in for Broder's random permutations without a modulo.
    """

    def __init__(self, params: MinHashParams) -> None:
        self.params = params
        rng = np.random.default_rng(params.seed)
        self._word_mult = rng.integers(1, 2**63, size=params.shingle_words, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._a = rng.integers(1, 2**63, size=params.num_perm, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        self._b = rng.integers(0, 2**63, size=params.num_perm, dtype=np.uint64)
        self._band_mult = rng.integers(1, 2**63, size=params.rows, dtype=np.uint64) * np.uint64(2) + np.uint64(1)

    def shingle_hashes(self, docs_words: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
        """32-bit shingle hashes of all documents, concatenated, and each document's start offset."""
        n = self.params.shingle_words
        lengths = np.fromiter((len(w) for w in docs_words), dtype=np.int64, count=len(docs_words))
        flat = [w for ws in docs_words for w in ws]
        word_hash = pd.util.hash_array(np.asarray(flat, dtype=object)) if flat else np.zeros(0, np.uint64)
        doc_start = np.concatenate([[0], np.cumsum(lengths)])
        total = len(flat)
        # shingle at word i: sum_k hash(word i+k) * m_k over the words of i's document
        words_left = np.repeat(doc_start[1:], lengths) - np.arange(total)  # words from i to its document's end
        combined = word_hash * self._word_mult[0]
        with np.errstate(over="ignore"):
            for k in range(1, n):
                inside = words_left[: total - k] > k
                combined[: total - k] += np.where(inside, word_hash[k:] * self._word_mult[k], np.uint64(0))
        # shingle starts: i in [start, max(start + 1, end - n + 1)); an empty document gets one
        # shingle of hash 0, so every document has a signature
        n_shingles = np.maximum(lengths - n + 1, 1)
        offsets = np.concatenate([[0], np.cumsum(n_shingles)])
        within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], n_shingles)
        starts = np.repeat(doc_start[:-1], n_shingles) + within
        values = np.zeros(offsets[-1], dtype=np.uint64)
        real = np.repeat(lengths > 0, n_shingles)
        values[real] = combined[starts[real]]
        return (values >> np.uint64(32)) ^ (values & _MASK32), offsets[:-1]

    def signatures(self, docs_words: Sequence[Sequence[str]], chunk: int = 4096) -> np.ndarray:
        """(documents, num_perm) uint32 MinHash signatures."""
        shingles, offsets = self.shingle_hashes(docs_words)
        out = np.empty((len(docs_words), self.params.num_perm), dtype=np.uint32)
        if not len(docs_words):
            return out
        a, b = self._a[:, None], self._b[:, None]
        # chunks of about `chunk` shingles, cut at document boundaries (a block stays in cache)
        cuts = np.unique(np.searchsorted(offsets, np.arange(0, len(shingles), chunk), side="left"))
        cuts = np.append(cuts[cuts < len(offsets)], len(offsets))
        with np.errstate(over="ignore"):
            for lo, hi in zip(cuts[:-1], cuts[1:]):
                s_lo = offsets[lo]
                s_hi = offsets[hi] if hi < len(offsets) else len(shingles)
                block = a * shingles[None, s_lo:s_hi]
                block += b
                block >>= np.uint64(32)
                out[lo:hi] = np.minimum.reduceat(block, offsets[lo:hi] - s_lo, axis=1).T
        return out

    def band_keys(self, signatures: np.ndarray) -> np.ndarray:
        """(documents, bands) uint64: one hash per band of r signature rows."""
        r = self.params.rows
        sig = signatures.astype(np.uint64).reshape(len(signatures), self.params.bands, r)
        with np.errstate(over="ignore"):
            keys = (sig * self._band_mult[None, None, :]).sum(axis=2, dtype=np.uint64)
        return keys


def candidate_probability(jaccard: float, bands: int, rows: int) -> float:
    """Chance that LSH makes a pair of this similarity a candidate (MMDS eq. in ch. 3.4.2)."""
    return 1.0 - (1.0 - jaccard**rows) ** bands


class UnionFind:
    """Disjoint sets over document indices; the root of a set is its smallest (earliest) member."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        while x != root:  # path compression
            nxt = self.parent.get(x, x)
            self.parent[x] = root
            x = nxt
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            lo, hi = min(ra, rb), max(ra, rb)
            self.parent[hi] = lo


def exact_duplicates(hashes: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Bool mask: eligible documents whose hash an earlier eligible document already has."""
    dup = np.zeros(len(hashes), dtype=bool)
    idx = np.flatnonzero(eligible)
    if len(idx) == 0:
        return dup
    _, first = np.unique(hashes[idx], return_index=True)
    dup[idx] = True
    dup[idx[first]] = False
    return dup


def near_duplicates(band_column: Callable[[int], np.ndarray], bands: int, candidates: np.ndarray,
                    signature_rows: Callable[[np.ndarray], np.ndarray], threshold: float) -> np.ndarray:
    """Bool mask: candidate documents that fall in a near-duplicate cluster whose first member is
    earlier. Clusters join verified pairs (estimated Jaccard >= threshold) with union-find, so a
    chain of near duplicates keeps only its first document (the usual choice, as in datatrove and
    text-dedup).

    `band_column(k)` gives band k's key of every document (global order); `signature_rows(idx)`
    gives the signatures of the documents in idx; `candidates` masks the documents taking part.
    """
    sets = UnionFind()
    idx = np.flatnonzero(candidates)
    for k in range(bands):
        keys = band_column(k)[idx]
        order = np.argsort(keys, kind="stable")  # stable: within a key, documents stay in stream order
        sorted_keys = keys[order]
        same_as_prev = np.flatnonzero(sorted_keys[1:] == sorted_keys[:-1]) + 1
        if not len(same_as_prev):
            continue
        group_start = np.flatnonzero(np.concatenate([[True], sorted_keys[1:] != sorted_keys[:-1]]))
        first_of = group_start[np.searchsorted(group_start, same_as_prev, side="right") - 1]
        members = idx[order[same_as_prev]]
        # verify each member against the group's first document and against its predecessor
        pairs = np.concatenate([np.stack([idx[order[first_of]], members], 1),
                                np.stack([idx[order[same_as_prev - 1]], members], 1)])
        pairs = np.unique(pairs, axis=0)
        pairs = pairs[pairs[:, 0] != pairs[:, 1]]
        rows_needed = np.unique(pairs)
        sig = signature_rows(rows_needed)
        pos = np.searchsorted(rows_needed, pairs)
        similarity = (sig[pos[:, 0]] == sig[pos[:, 1]]).mean(axis=1)
        for a, b in pairs[similarity >= threshold]:
            sets.union(int(a), int(b))
    dup = np.zeros(len(candidates), dtype=bool)
    for x in list(sets.parent):
        if sets.find(x) != x:
            dup[x] = True
    return dup
