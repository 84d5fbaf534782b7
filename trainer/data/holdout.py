"""Rows held out of a source for validation (`val_size`): a fixed-seed draw over its rows in file
order, so that the training side and the held-out side of one source never share a row and every
rank, resume and evaluation draws the same ones."""

from __future__ import annotations

import numpy as np

from specs.errors import UsageError

HOLDOUT_SEED = 0x5EED  # fixed: the split belongs to the data, not to the run's --seed


def held_out_count(rows: int, val_size: float) -> int:
    """Rows `val_size` holds out of `rows`: a count (>= 1), or a share (< 1) rounded up; at least one
    row of each side, else one line saying so."""
    count = int(val_size) if val_size >= 1 else int(np.ceil(val_size * rows))
    if not 0 < count < rows:
        raise UsageError(f"val_size {val_size:g} holds out {count} of {rows} rows: leave at least one row on "
                         "each side")
    return count


def split_mask(rows: int, val_size: float, split: str) -> np.ndarray:
    """Which of a source's `rows` (in file order) the `split` side reads ("train" or "val")."""
    held = np.zeros(rows, dtype=bool)
    held[np.random.default_rng(HOLDOUT_SEED).permutation(rows)[:held_out_count(rows, val_size)]] = True
    return held if split == "val" else ~held
