"""Length and character-quality statistics of documents, and the thresholds that drop them.

Statistics are computed once per document (vectorised over a batch); thresholds are applied later,
so that one file read by several stages can meet each stage's own thresholds.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from functools import lru_cache
from typing import Sequence

import numpy as np

from specs.task import QualityFilters

# flag bits of a character class table
_ALPHA, _DIGIT, _SPACE, _BAD = 1, 2, 4, 8
_BMP = 0x10000

# the order of the checks: a document is counted under the first threshold it fails
CHECKS = ("min_chars", "max_chars", "min_tokens", "max_tokens", "min_alpha_ratio", "max_digit_ratio",
          "max_bad_char_ratio", "max_top_word_ratio")
STAT_COLUMNS = ("chars", "alpha_ratio", "digit_ratio", "bad_ratio", "top_word_ratio")


def _flags(ch: str) -> int:
    flag = 0
    if ch.isalpha():
        flag |= _ALPHA
    if ch.isdecimal():
        flag |= _DIGIT
    if ch.isspace():
        flag |= _SPACE
    if ch == "\ufffd" or (unicodedata.category(ch) == "Cc" and ch not in "\t\n\r"):
        flag |= _BAD
    return flag


@lru_cache(maxsize=1)
def _bmp_table() -> np.ndarray:
    return np.fromiter((_flags(chr(c)) if not 0xD800 <= c < 0xE000 else 0 for c in range(_BMP)),
                       dtype=np.uint8, count=_BMP)


def char_flags(text: str) -> np.ndarray:
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    flags = _bmp_table()[np.minimum(codes, _BMP - 1)]
    astral = np.flatnonzero(codes >= _BMP)
    for i in astral:  # rare: emoji and historic scripts
        flags[i] = _flags(chr(codes[i]))
    return flags


def document_stats(texts: Sequence[str], docs_words: Sequence[Sequence[str]]) -> dict[str, np.ndarray]:
    """Per-document: chars (outer whitespace stripped), letter, digit and bad-character ratios,
    and the share of the most frequent word."""
    n = len(texts)
    flags = char_flags("".join(texts))
    ends = np.cumsum([len(t) for t in texts])
    starts = ends - np.fromiter((len(t) for t in texts), dtype=np.int64, count=n)

    def per_doc(bit: int) -> np.ndarray:
        cs = np.concatenate([[0], np.cumsum(flags & bit != 0)])
        return (cs[ends] - cs[starts]).astype(np.float64)

    total = (ends - starts).astype(np.float64)
    non_space = total - per_doc(_SPACE)
    safe = np.maximum(non_space, 1)
    top = np.fromiter((max(Counter(ws).values()) / len(ws) if ws else 0.0 for ws in docs_words),
                      dtype=np.float64, count=n)
    return {
        "chars": np.fromiter((len(t.strip()) for t in texts), dtype=np.int64, count=n),
        "alpha_ratio": np.where(non_space > 0, per_doc(_ALPHA) / safe, 0.0),
        "digit_ratio": np.where(non_space > 0, per_doc(_DIGIT) / safe, 0.0),
        "bad_ratio": np.where(total > 0, per_doc(_BAD) / np.maximum(total, 1), 0.0),
        "top_word_ratio": top,
    }


def failed_check(stats: dict[str, np.ndarray], tokens: np.ndarray, filters: QualityFilters) -> np.ndarray:
    """Per document: 0 if it passes, else 1 + the index in CHECKS of the first threshold it fails."""
    values = {
        "min_chars": (stats["chars"], np.less), "max_chars": (stats["chars"], np.greater),
        "min_tokens": (tokens, np.less), "max_tokens": (tokens, np.greater),
        "min_alpha_ratio": (stats["alpha_ratio"], np.less), "max_digit_ratio": (stats["digit_ratio"], np.greater),
        "max_bad_char_ratio": (stats["bad_ratio"], np.greater),
        "max_top_word_ratio": (stats["top_word_ratio"], np.greater),
    }
    reason = np.zeros(len(tokens), dtype=np.uint8)
    for code, name in enumerate(CHECKS, 1):
        threshold = getattr(filters, name)
        if threshold is None:
            continue
        column, fails = values[name]
        reason[(reason == 0) & fails(column, threshold)] = code
    return reason


def merge_filters(*layers: QualityFilters | None) -> QualityFilters:
    """Task-wide filters overridden by a stage's, then by a source's: only the keys each names."""
    merged = layers[0] or QualityFilters()
    for layer in layers[1:]:
        if layer is not None:
            merged = merged.model_copy(update={k: getattr(layer, k) for k in layer.model_fields_set})
    return merged
