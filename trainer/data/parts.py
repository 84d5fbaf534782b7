"""Cutting source files into the parts that the scan's tasks read (trainer/data/scan.py).

The cut depends on the data alone, never on how many workers run: a JSON-lines file of more than
`rows_per_part` rows is cut every `rows_per_part` rows (at byte offsets found by one pass over its
lines); any other file is one part. So the parts, and everything merged from them, are the same
at 1 worker and at 64, and a part finished before an interruption is still the same part after it.
Columnar files (parquet, arrow) are one part each for now: cutting them by row group is a later step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from trainer.data.scan import READ_BATCH, Part, UnitColumns
from trainer.data.sniff import json_layout
from trainer.data.sources import line_offsets

# a multiple of the read batch, so that a part's batches are the batches one whole-file read makes
ROWS_PER_PART = 10 * READ_BATCH


def plan_parts(units: Sequence[UnitColumns], rows_per_part: int = ROWS_PER_PART) -> list[list[Part]]:
    """Each unit's parts in row order; parts are numbered across all units."""
    planned: list[list[Part]] = []
    count = 0
    for index, unit in enumerate(units):
        ranges = _line_ranges(unit.path, rows_per_part) if _is_json_lines(unit) else None
        if ranges is None:
            planned.append([Part(index=count, unit=index, first_row=0, rows=None)])
            count += 1
            continue
        parts = []
        for first_row, rows, byte_range in ranges:
            parts.append(Part(index=count, unit=index, first_row=first_row, rows=rows, byte_range=byte_range))
            count += 1
        planned.append(parts)
    return planned


def _is_json_lines(unit: UnitColumns) -> bool:
    return unit.fmt in ("jsonl", "json") and json_layout(unit.path) == "lines"


def _line_ranges(path: Path, rows_per_part: int) -> list[tuple[int, int, tuple[int, int]]] | None:
    """(first row, rows, byte range) of each part of a JSON-lines file; None when it is one part."""
    rows, offsets = line_offsets(path, rows_per_part)
    if rows <= rows_per_part:
        return None
    size = path.stat().st_size
    ends = offsets[1:] + [size]
    return [(k * rows_per_part, min(rows_per_part, rows - k * rows_per_part), (start, end))
            for k, (start, end) in enumerate(zip(offsets, ends))]
