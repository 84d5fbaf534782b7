"""Exact duplicates, and the words near duplicates are judged by.

Exact: a 64-bit BLAKE2b of the text after folding case and whitespace; of equal hashes the first
eligible document stays (`exact_duplicates`).
Near: datatrove's MinHash stages (trainer/data/near_dedup.py) over shingles of `words`, banded
LSH (Leskovec, Rajaraman, Ullman, *Mining of Massive Datasets*, ch. 3.4: b bands of r rows make a
pair a candidate with probability 1 - (1 - J^r)^b, `candidate_probability`).
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

WORD_RE = re.compile(r"\w+")


def normalise(text: str) -> str:
    """Case- and whitespace-folded text: what 'exact duplicate' compares."""
    return " ".join(text.lower().split())


def exact_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(normalise(text).encode("utf-8"), digest_size=8).digest(), "little")


def words(text: str) -> list[str]:
    return WORD_RE.findall(text.lower())


def candidate_probability(jaccard: float, bands: int, rows: int) -> float:
    """Chance that LSH makes a pair of this similarity a candidate (MMDS eq. in ch. 3.4.2)."""
    return 1.0 - (1.0 - jaccard**rows) ** bands


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
