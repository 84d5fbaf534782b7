"""Step 1 of `advisor data prepare`: the per-document scan of one part of a source file.

A part is a range of rows of one file (trainer/data/parts.py cuts them). Scanning it tokenises,
measures length and character quality, hashes for exact duplicates, MinHashes for near duplicates
(the signatures datatrove's stages then read: trainer/data/near_dedup.py) and grades difficulty,
and spools the token ids and the per-document numbers into the part's own folder: parts are scanned by separate worker processes, in any order, and merged afterwards in
row order (`merge_parts`), so what is merged does not depend on how many workers scanned.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from trainer.data.dedup import exact_hash, words
from trainer.data.difficulty import Grader
from trainer.data.quality import STAT_COLUMNS, document_stats
from trainer.data.sources import RowBatch, read_batches, read_line_range, row_location
from trainer.data.times import parse_time

READ_BATCH = 1000
TOKEN_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int32()))])
_PART_META = "part.json"

Log = Callable[[str], None]


class ColumnSpool:
    """Per-document numeric columns appended batch by batch to raw files, read back by row range."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, Any] = {}
        self._layout: dict[str, tuple[np.dtype, int]] = {}

    def append(self, name: str, values: np.ndarray) -> None:
        values = np.ascontiguousarray(values)
        if name not in self._files:
            self._files[name] = open(self.folder / f"{name}.bin", "wb")
            self._layout[name] = (values.dtype, int(np.prod(values.shape[1:], dtype=np.int64)))
        self._files[name].write(values.tobytes())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}

    def has(self, name: str) -> bool:
        return name in self._layout

    def layout(self) -> dict[str, list[Any]]:
        """Each column's dtype and width, as JSON (a part's spool is read back by another process)."""
        return {name: [dtype.str, width] for name, (dtype, width) in self._layout.items()}

    def adopt(self, layout: dict[str, list[Any]]) -> None:
        """Read columns another process wrote with this layout."""
        self._layout.update({name: (np.dtype(dtype), int(width)) for name, (dtype, width) in layout.items()})

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        dtype, width = self._layout[name]
        size = (self.folder / f"{name}.bin").stat().st_size // (dtype.itemsize * width)
        stop = size if stop is None else min(stop, size)
        count = max(0, stop - start)
        values = np.fromfile(self.folder / f"{name}.bin", dtype=dtype, count=count * width,
                             offset=start * width * dtype.itemsize)
        return values.reshape(count, width) if width > 1 else values

    def read_rows(self, name: str, rows: np.ndarray, block_rows: int = 65536) -> np.ndarray:
        """Rows (sorted) of a wide column, reading the file block by block (flat memory)."""
        dtype, width = self._layout[name]
        out = np.empty((len(rows), width), dtype=dtype)
        if not len(rows):
            return out
        for lo in range(int(rows[0]) // block_rows * block_rows, int(rows[-1]) + 1, block_rows):
            sel = np.flatnonzero((rows >= lo) & (rows < lo + block_rows))
            if len(sel):
                block = self.read(name, lo, lo + block_rows)
                out[sel] = block[rows[sel] - lo]
        return out


@dataclass
class Part:
    """Rows [first_row, first_row + rows) of one unit (source file); `byte_range` where the file is
    JSON lines cut into several parts, None where one part reads the whole file."""

    index: int
    unit: int
    first_row: int
    rows: int | None
    byte_range: tuple[int, int] | None = None


@dataclass
class ScanSettings:
    """What the scan of a unit needs to know of the task, built once per worker process."""

    tokenizer: Any
    eos_id: int | None
    append_eos: bool
    exact: bool
    graders: dict[str, Grader]
    signer: Callable[[list[list[str]]], np.ndarray] | None = None  # documents' words -> MinHash signatures


@dataclass
class UnitColumns:
    """Which extra fields a unit's scan reads, and the grade columns it writes."""

    path: Path
    fmt: str
    text_field: str
    domain_fields: set[str] = field(default_factory=set)
    time_fields: set[str] = field(default_factory=set)
    graders: dict[str, int] = field(default_factory=dict)   # difficulty spec (json) -> grade column


def part_folder(root: Path, part: Part) -> Path:
    return root / f"part{part.index:05d}"


def _batches(unit: UnitColumns, part: Part, extra: tuple[str, ...]) -> Iterator[RowBatch]:
    if part.byte_range is None:
        return read_batches(unit.path, unit.fmt, unit.text_field, extra, READ_BATCH)
    return read_line_range(unit.path, unit.fmt, unit.text_field, extra, READ_BATCH, part.byte_range, part.first_row)


def part_column(root: Path, part: Part, name: str) -> np.ndarray:
    """One column of a scanned part (its folder under `root`), e.g. its MinHash `signature`s."""
    spool = ColumnSpool(part_folder(root, part))
    spool.adopt(json.loads((part_folder(root, part) / _PART_META).read_text())["layout"])
    return spool.read(name)


def scan_part(unit: UnitColumns, part: Part, settings: ScanSettings, root: Path) -> int:
    """Scan one part into its folder under `root`; returns its rows. The folder appears whole or not
    at all (written aside, then renamed), so a scan killed midway leaves nothing to be mistaken
    for a finished part."""
    final = part_folder(root, part)
    if (final / _PART_META).is_file():
        return int(json.loads((final / _PART_META).read_text())["rows"])
    aside = root / f".{final.name}.{os.getpid()}"
    shutil.rmtree(aside, ignore_errors=True)
    spool = ColumnSpool(aside)
    domain_codes: dict[str, dict[str, int]] = {f: {} for f in unit.domain_fields}
    rows = 0
    with pa.OSFile(str(aside / "tokens.arrow"), "wb") as sink, pa.ipc.new_stream(sink, TOKEN_SCHEMA) as writer:
        for batch in _batches(unit, part, _extra_fields(unit, settings)):
            ids = _scan_batch(unit, batch, settings, spool, domain_codes)
            writer.write_batch(pa.record_batch([pa.array(ids, type=pa.list_(pa.int32()))], schema=TOKEN_SCHEMA))
            rows += len(batch)
    spool.close()
    meta = {"rows": rows, "layout": spool.layout(),
            "domain_values": {name: list(codes) for name, codes in domain_codes.items()}}
    (aside / _PART_META).write_text(json.dumps(meta))
    try:
        os.replace(aside, final)
    except OSError:  # another process finished the same part first: its folder is as good as ours
        shutil.rmtree(aside, ignore_errors=True)
    return rows


def _extra_fields(unit: UnitColumns, settings: ScanSettings) -> tuple[str, ...]:
    graders = [settings.graders[key] for key in unit.graders]
    needs_field = [g.spec.field for g in graders if g.spec.by == "field" and g.spec.field]
    return tuple(sorted(unit.domain_fields | unit.time_fields | set(needs_field)))


def _scan_batch(unit: UnitColumns, batch: RowBatch, settings: ScanSettings, spool: ColumnSpool,
                domain_codes: dict[str, dict[str, int]]) -> list[list[int]]:
    def where(i: int, first: int = batch.first_row) -> str:
        return row_location(unit.path, unit.fmt, first + i)

    ids = settings.tokenizer.encode(batch.texts)
    if settings.eos_id is not None and settings.append_eos:
        ids = [seq + [settings.eos_id] for seq in ids]
    lengths = np.fromiter((len(s) for s in ids), dtype=np.int32, count=len(ids))
    docs_words = [words(t) for t in batch.texts]
    stats = document_stats(batch.texts, docs_words)
    spool.append("row", np.arange(batch.first_row, batch.first_row + len(batch), dtype=np.int64))
    spool.append("n_tokens", lengths)
    for name in STAT_COLUMNS:
        spool.append(name, stats[name])
    if settings.exact:
        spool.append("exact", np.fromiter((exact_hash(t) for t in batch.texts), dtype=np.uint64, count=len(batch)))
    if settings.signer is not None:
        spool.append("signature", settings.signer(docs_words))
    for key, column in unit.graders.items():
        grader = settings.graders[key]
        values = batch.fields.get(grader.spec.field) if grader.spec.by == "field" else None
        spool.append(f"grade{column}", grader.grade(batch.texts, ids, values, where))
    for name in unit.time_fields:
        spool.append(f"time:{name}", np.array(
            [parse_time(v, f"{where(i)}: field '{name}'") for i, v in enumerate(batch.fields[name])]))
    for name in unit.domain_fields:
        codes = domain_codes[name]
        spool.append(f"domain:{name}", np.array(
            [-1 if v is None else codes.setdefault(str(v), len(codes)) for v in batch.fields[name]], dtype=np.int32))
    return ids


def merge_parts(parts: list[Part], root: Path, folder: Path) -> tuple[ColumnSpool, list[Path], int, dict[str, list[str]]]:
    """One unit's parts, in row order, as one spool in `folder`: (spool, the parts' token files,
    rows, each domain field's values by code). Domain codes are renumbered in first-seen order over
    the whole file, as a single scan would have numbered them."""
    spool = ColumnSpool(folder)
    domain_values: dict[str, list[str]] = {}
    token_files, rows = [], 0
    for part in parts:
        source = part_folder(root, part)
        meta = json.loads((source / _PART_META).read_text())
        spool.adopt(meta["layout"])
        for name, values in meta["domain_values"].items():
            code_of = {value: code for code, value in enumerate(domain_values.get(name, []))}
            remap = np.array([code_of.setdefault(v, len(code_of)) for v in values] + [-1], dtype=np.int32)
            domain_values[name] = list(code_of)  # first-seen order: the dict keeps insertion order
            if not meta["rows"]:
                continue
            codes = np.fromfile(source / f"domain:{name}.bin", dtype=np.int32)
            spool.append(f"domain:{name}", remap[codes])  # code -1 stays -1 (remap's last entry)
        for name in meta["layout"]:
            if not name.startswith("domain:"):
                with open(folder / f"{name}.bin", "ab") as sink, open(source / f"{name}.bin", "rb") as data:
                    shutil.copyfileobj(data, sink, 1 << 20)
        token_files.append(source / "tokens.arrow")
        rows += int(meta["rows"])
    spool.close()
    return spool, token_files, rows, domain_values
