"""`advisor data prepare`: clean, grade, bucket and shard a task's data into stage shards.

The steps, in order, for every source file of every stage (each file is read once, however many
stages use it):

1. scan (streaming, batch by batch): tokenise, measure length and character quality, hash for
   exact duplicates, MinHash for near duplicates, grade difficulty; spool the token ids and the
   per-document numbers to disk.
   Files are cut into parts (trainer/data/parts.py) scanned as datatrove tasks on several
   processes (trainer/data/pipeline.py, trainer/data/scan.py), then merged in row order, so steps
   2 to 4 see the same columns whatever the number of workers. The same tasks write datatrove's
   MinHash signature files of their parts (trainer/data/near_dedup.py); each worker is one core;
2. resolve duplicates over the whole task (eval files first, so a train document that repeats an
   eval document is dropped: decontamination); a document is judged by the thresholds of the
   stages that read it; datatrove's MinHash buckets and clusters over the documents left, their
   pairs verified in between; of a cluster the first candidate stays;
3. per stage: select rows (domains, difficulty bands, time window), cut documents longer than
   seq_len into pieces, choose bucket edges from the length histogram, and write the shards;
4. write the manifest, then move the whole folder into place.

Memory stays flat as the corpus grows: the text and the token ids are never held, only a batch at
a time; what grows is about a hundred bytes per document of hashes, band keys and masks (see
bench/data_buckets.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from specs.errors import UsageError
from specs.task import DataSource, DifficultySpec, QualityFilters, StageSpec, TaskSpec
from presets import load_model
from trainer.data import buckets as bucketing
from trainer.data.demo_corpus import generate_command
from trainer.data.formats import source_format
from trainer.data import near_dedup
from trainer.data.dedup import exact_duplicates
from trainer.data.difficulty import Grader, band_index, band_names, check_spec, merge_difficulty
from trainer.data.manifest import (MANIFEST_NAME, MANIFEST_VERSION, default_out_dir, task_fingerprint,
                                   tokens_with_replay)
from trainer.data.parts import ROWS_PER_PART, plan_parts
from trainer.data.pipeline import (ScanJob, SlurmOptions, job_key, remember_settings, run_minhash_stages, run_scan,
                                   work_folder, write_slurm_scripts)
from trainer.data.quality import CHECKS, STAT_COLUMNS, failed_check, merge_filters
from trainer.data.scan import ColumnSpool, Part, ScanSettings, UnitColumns, merge_parts
from trainer.data.shards import SCHEMA, OutputDir, ShardWriter, shard_path
from trainer.data.sources import expand_source_path, file_type_of
from trainer.data.times import parse_time
from trainer.data.tokenizer import TextTokenizer, resolve_tokenizer_path

SPLITS = ("train", "eval")
_BLOCK = 65536
NOT_DUPLICATE, EXACT_DUPLICATE, NEAR_DUPLICATE = 0, 1, 2

Log = Callable[[str], None]


# --- the plan of work: which files, read how, for which stages ------------------------------------


@dataclass(kw_only=True)
class Unit(UnitColumns):
    """One source file, read once for every stage that uses it: what its scan reads (UnitColumns) and
    what the scan found."""

    index: int
    rows: int = 0
    spool: ColumnSpool | None = None
    tokens_files: list[Path] = field(default_factory=list)  # the token ids of its parts, in row order
    domain_values: dict[str, list[str]] = field(default_factory=dict)  # field -> code -> value
    duplicate: np.ndarray | None = None  # per row: NOT_DUPLICATE, EXACT_DUPLICATE, NEAR_DUPLICATE

    def columns(self) -> UnitColumns:
        return UnitColumns(path=self.path, fmt=self.fmt, text_field=self.text_field, domain_fields=self.domain_fields,
                           time_fields=self.time_fields, graders=self.graders)


@dataclass
class Entry:
    """One source of one stage and split, with its merged settings."""

    stage: StageSpec
    split: str
    source: DataSource
    filters: QualityFilters
    difficulty: DifficultySpec
    grader_key: str
    units: list[Unit]


@dataclass
class Context:
    task: TaskSpec
    base_dir: Path
    tokenizer: Any
    eos_id: int | None
    graders: dict[str, Grader]
    log: Log
    workers: int = 1
    rows_per_part: int = ROWS_PER_PART
    allow_code: bool = False
    trusted: bool = False  # --trust-remote-code: the tokenizer's and reference model's own code
    executor: str = "local"  # where the scan's tasks run: "local" (this machine's cores) or "ray"
    ray_address: str | None = None  # with "ray": None starts a local instance, "auto" joins a cluster


def _check_text_rows(source: DataSource, base_dir: Path) -> None:
    """Prepared shards hold text to train every token of; other row formats (a label mask per
    token) are trained from the raw source."""
    row_format = source_format(source, base_dir)
    if row_format != "text":
        raise UsageError(f"data source '{source.path}': `advisor data prepare` shards text rows only, these are "
                         f"{row_format}; train on them without preparing (the trainer renders them and masks the "
                         "prompts)")


def _plan_entries(task: TaskSpec, base_dir: Path) -> tuple[list[Entry], list[Unit]]:
    units: dict[tuple[str, str, str], Unit] = {}
    entries: list[Entry] = []
    # eval sources first: they come first in the duplicate order (decontamination of train). Held-out
    # rows of other formats (prompts and answers) are not sharded: the trainer evaluates and scores
    # them from their raw files.
    ordered = [(stage, "eval", s) for stage in task.stages for s in stage.eval_sources
               if source_format(s, base_dir) == "text"] + \
              [(stage, "train", s) for stage in task.stages for s in stage.sources]
    for stage, split, source in ordered:
        difficulty = merge_difficulty(task.data.difficulty, stage.difficulty)
        check_spec(difficulty, f"stage '{stage.name}'")
        _check_selection(stage, source, difficulty)
        grader_key = json.dumps(difficulty.model_dump(mode="json", exclude={"edges", "names"}), sort_keys=True)
        entry_units = []
        file_type = file_type_of(base_dir, source)
        for path in expand_source_path(base_dir, source.path, file_type):
            key = (str(path.resolve()), file_type, source.text_field)
            unit = units.get(key)
            if unit is None:
                unit = units[key] = Unit(index=len(units), path=path, fmt=file_type, text_field=source.text_field)
            if source.domain_field:
                unit.domain_fields.add(source.domain_field)
            if source.time_field:
                unit.time_fields.add(source.time_field)
            unit.graders.setdefault(grader_key, len(unit.graders))
            entry_units.append(unit)
        entries.append(Entry(stage=stage, split=split, source=source,
                             filters=merge_filters(task.data.filters, stage.filters, source.filters),
                             difficulty=difficulty, grader_key=grader_key, units=entry_units))
    return entries, list(units.values())


def _check_selection(stage: StageSpec, source: DataSource, difficulty: DifficultySpec) -> None:
    where = f"stage '{stage.name}', source '{source.path}'"
    names = band_names(difficulty)
    if source.bands:
        unknown = sorted(set(source.bands) - set(names))
        if unknown:
            raise UsageError(f"{where}: unknown difficulty bands {unknown}; the stage's bands are {names}")
    if (stage.split_by == "domain" or source.domains) and not (source.domain or source.domain_field):
        raise UsageError(f"{where}: splitting or selecting by domain needs `domain` or `domain_field`")
    if (stage.split_by == "time" or source.time_window) and not source.time_field:
        raise UsageError(f"{where}: splitting or selecting by time needs `time_field`")
    if source.time_window:
        parse_time(source.time_window[0], where)
        parse_time(source.time_window[1], where)
    for name, (start, end) in stage.time_windows.items():
        parse_time(start, f"stage '{stage.name}' time window '{name}'")
        parse_time(end, f"stage '{stage.name}' time window '{name}'")


# --- step 1: scan each file once, cut into parts, on every core -------------------------------------


def _scan_job(entries: list[Entry], units: list[Unit], ctx: Context, out: Path) -> tuple[ScanJob, list[list[Part]]]:
    """The scan's tasks: every unit's parts, and what a worker needs to scan them."""
    planned = plan_parts([u.columns() for u in units], ctx.rows_per_part)
    tokenizer_path = Path(ctx.tokenizer.path)
    key = job_key(task_fingerprint(ctx.task), ctx.rows_per_part, tokenizer_path)
    specs = {e.grader_key: e.difficulty for e in entries}
    job = ScanJob(key=key, task=ctx.task, tokenizer_path=tokenizer_path, allow_code=ctx.allow_code, trusted=ctx.trusted,
                  graders=specs,
                  units=[u.columns() for u in units], parts=[p for parts in planned for p in parts],
                  work=work_folder(out, key), main_pid=os.getpid())
    remember_settings(key, ScanSettings(tokenizer=ctx.tokenizer, eos_id=ctx.eos_id,
                                        append_eos=ctx.task.data.append_eos, exact=ctx.task.data.dedup.exact,
                                        graders=ctx.graders, signer=near_dedup.scan_signer(job.work, ctx.task.data.dedup)))
    return job, planned


@contextlib.contextmanager
def _kept_for_resume_only(work: Path) -> Iterator[None]:
    """A prepare that stops on an error (a bad row, nothing left after filtering) removes its scan's
    parts: fixing the cause changes the files or the task, so they could not be reused. A killed
    prepare runs no cleanup: its parts stay for the next run."""
    try:
        yield
    except Exception:
        shutil.rmtree(work, ignore_errors=True)
        raise


def _scan(job: ScanJob, planned: list[list[Part]], units: list[Unit], ctx: Context, spool_root: Path) -> None:
    """Scan every unit's parts (trainer/data/pipeline.py) and merge each unit's parts into its
    spool; the parts' token files, which the shards are written from, stay in the work folder."""
    t0 = time.perf_counter()
    if ctx.executor == "ray":
        from trainer.data.ray_scan import run_scan_on_ray  # deferred: Ray starts in seconds, only when asked

        run_scan_on_ray(job, ctx.workers, ctx.ray_address, ctx.log)
    else:
        run_scan(job, ctx.workers, ctx.log)
    seconds = time.perf_counter() - t0
    for unit, parts in zip(units, planned):
        unit.spool, unit.tokens_files, unit.rows, unit.domain_values = merge_parts(
            parts, job.work / "parts", spool_root / f"unit{unit.index:04d}")
        ctx.log(f"scanned {unit.path} ({unit.rows:,} rows, {len(parts)} part(s))")
    where = f"{ctx.workers or 'all'} Ray worker(s)" if ctx.executor == "ray" else f"{ctx.workers} worker(s)"
    ctx.log(f"scan: {sum(u.rows for u in units):,} rows in {seconds:.1f} s on {where}")


# --- step 2: duplicates over the whole task ----------------------------------------------------------


def _quality_reasons(unit: Unit, filters: QualityFilters, start: int = 0, stop: int | None = None) -> np.ndarray:
    assert unit.spool is not None
    stats = {name: unit.spool.read(name, start, stop) for name in STAT_COLUMNS}
    return failed_check(stats, unit.spool.read("n_tokens", start, stop), filters)


def _resolve_duplicates(entries: list[Entry], units: list[Unit], ctx: Context, job: ScanJob) -> None:
    dedup = ctx.task.data.dedup
    offsets = np.concatenate([[0], np.cumsum([u.rows for u in units])]).astype(np.int64)
    eligible = np.zeros(offsets[-1], dtype=bool)  # passes the thresholds of at least one stage reading it
    for entry in entries:
        for unit in entry.units:
            for lo in range(0, unit.rows, _BLOCK):
                hi = min(lo + _BLOCK, unit.rows)
                eligible[offsets[unit.index] + lo: offsets[unit.index] + hi] |= \
                    _quality_reasons(unit, entry.filters, lo, hi) == 0
    duplicate = np.zeros(offsets[-1], dtype=np.uint8)
    if dedup.exact and len(eligible):
        hashes = np.concatenate([u.spool.read("exact") for u in units])  # type: ignore[union-attr]
        duplicate[exact_duplicates(hashes, eligible)] = EXACT_DUPLICATE
        del hashes
    if dedup.near and len(eligible):
        near = _near_duplicates(job, units, offsets, eligible & (duplicate == NOT_DUPLICATE), ctx.log)
        duplicate[near] = NEAR_DUPLICATE
    for unit in units:
        unit.duplicate = duplicate[offsets[unit.index]: offsets[unit.index + 1]].copy()


def _near_duplicates(job: ScanJob, units: list[Unit], offsets: np.ndarray, candidates: np.ndarray,
                     log: Log) -> np.ndarray:
    """datatrove's MinHash stages over the candidates (trainer/data/near_dedup.py), their clusters
    read back per global row: of each cluster the first candidate stays."""
    dedup = job.task.data.dedup
    part_rows = []
    for part, after in zip(job.parts, job.parts[1:] + [None]):  # parts are in row order, unit by unit
        end = after.first_row if after is not None and after.unit == part.unit else units[part.unit].rows
        part_rows.append(end - part.first_row)
    starts = np.array([offsets[p.unit] + p.first_row for p in job.parts], dtype=np.int64)

    def keep(rank: int) -> np.ndarray:
        return candidates[starts[rank]: starts[rank] + part_rows[rank]]

    def signatures(ranks: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """From the merged spools' signature column; the pairs' documents come sorted (part, row)."""
        wanted = starts[ranks] + rows
        out = np.empty((len(wanted), dedup.num_perm), dtype=np.uint32)
        unit_of = np.searchsorted(offsets, wanted, side="right") - 1
        for u in np.unique(unit_of):
            sel = np.flatnonzero(unit_of == u)
            out[sel] = units[u].spool.read_rows("signature", wanted[sel] - offsets[u])  # type: ignore[union-attr]
        return out

    t0 = time.perf_counter()
    run_minhash_stages(job, keep, signatures)
    log(f"MinHash buckets, verification and clusters (datatrove) in {time.perf_counter() - t0:.1f} s")
    return near_dedup.near_duplicates(near_dedup.cluster_ids(job.work, starts, len(candidates)), candidates)


# --- step 3: select, chunk, bucket and write per stage ----------------------------------------------


@dataclass
class Selection:
    """The outcome of selecting one entry's rows of one unit."""

    keep: np.ndarray     # bool per row
    group: np.ndarray    # int16 per row: index into the split's group names
    band: np.ndarray     # int16 per row
    grade: np.ndarray    # float64 per row


@dataclass
class SplitResult:
    read: int = 0
    documents: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    groups: list[str] = field(default_factory=list)
    length_counts: np.ndarray | None = None
    bands: dict[str, list[int]] = field(default_factory=dict)  # band -> [documents, tokens]

    def drop(self, reason: str, count: int) -> None:
        if count:
            self.dropped[reason] = self.dropped.get(reason, 0) + int(count)


def _chunk_lengths(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces of at most seq_len per document: (document of each piece, its index in the document,
    its length). A document longer than seq_len gives full pieces and its remainder, if 2 tokens
    or more (a 1-token piece has nothing to predict)."""
    full = np.where(lengths > seq_len, lengths // seq_len, 0)
    rest = np.where(lengths > seq_len, lengths % seq_len, lengths)
    rest = np.where((lengths > seq_len) & (rest < 2), 0, rest)
    pieces = full + (rest > 0)
    doc = np.repeat(np.arange(len(lengths)), pieces)
    index_in_doc = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    piece_len = np.where(index_in_doc < full[doc], seq_len, rest[doc])
    return doc, index_in_doc, piece_len.astype(np.int64)


def _select(entry: Entry, unit: Unit, result: SplitResult, group_names: list[str]) -> Selection:
    stage, source = entry.stage, entry.source
    spool = unit.spool
    assert spool is not None and unit.duplicate is not None
    names = band_names(entry.difficulty)
    grade = spool.read(f"grade{unit.graders[entry.grader_key]}")
    band = band_index(grade, entry.difficulty.edges)
    keep = np.ones(unit.rows, dtype=bool)
    quality = np.concatenate([_quality_reasons(unit, entry.filters, lo, min(lo + _BLOCK, unit.rows))
                              for lo in range(0, unit.rows, _BLOCK)]) if unit.rows else np.zeros(0, np.uint8)
    for code, check in enumerate(CHECKS, 1):
        result.drop(f"quality:{check}", np.count_nonzero(quality == code))
    keep &= quality == 0
    for code, reason in ((EXACT_DUPLICATE, "exact_duplicate"), (NEAR_DUPLICATE, "near_duplicate")):
        hit = keep & (unit.duplicate == code)
        result.drop(reason, np.count_nonzero(hit))
        keep &= ~hit
    # the domain of each row: the row's field, or the source's constant
    if source.domain_field:
        values = unit.domain_values[source.domain_field]
        codes = spool.read(f"domain:{source.domain_field}")
        domain = np.array(values + [None], dtype=object)[codes]  # code -1 -> None
    else:
        domain = np.full(unit.rows, source.domain, dtype=object)
    if source.domains is not None:
        allowed = set(source.domains)
        wanted = np.fromiter((d is not None and str(d) in allowed for d in domain), dtype=bool, count=unit.rows)
        result.drop("selection:domain", np.count_nonzero(keep & ~wanted))
        keep &= wanted
    if source.bands is not None:
        wanted = np.isin(band, [names.index(b) for b in source.bands])
        result.drop("selection:band", np.count_nonzero(keep & ~wanted))
        keep &= wanted
    times = spool.read(f"time:{source.time_field}") if source.time_field else None
    if source.time_window is not None and times is not None:
        start = parse_time(source.time_window[0], "time_window")
        end = parse_time(source.time_window[1], "time_window")
        inside = (times >= start) & (times < end)
        result.drop("selection:time", np.count_nonzero(keep & ~inside))
        keep &= inside
    # the shard group: split_by
    group = np.zeros(unit.rows, dtype=np.int16)
    if stage.split_by == "difficulty":
        labels = np.array(names, dtype=object)[band]
    elif stage.split_by == "domain":
        labels = np.array([str(d) if d is not None else "unknown" for d in domain], dtype=object)
    elif stage.split_by == "time":
        assert times is not None
        labels = np.full(unit.rows, None, dtype=object)
        for name, (lo, hi) in stage.time_windows.items():
            inside = (times >= parse_time(lo, name)) & (times < parse_time(hi, name)) & (labels == None)  # noqa: E711
            labels[inside] = name
        outside = keep & (labels == None)  # noqa: E711
        result.drop("selection:no_time_window", np.count_nonzero(outside))
        keep &= ~outside
    else:
        labels = np.full(unit.rows, "all", dtype=object)
    for label in dict.fromkeys(labels[keep].tolist()):  # first-seen order
        if label not in group_names:
            group_names.append(label)
    if keep.any():
        lookup = {name: g for g, name in enumerate(group_names)}
        group[keep] = [lookup[label] for label in labels[keep]]
    return Selection(keep=keep, group=group, band=band, grade=grade)


def _prepare_split(stage: StageSpec, split: str, entries: list[Entry], ctx: Context, out: Path,
                   micro_batch_tokens: int) -> dict[str, Any] | None:
    if not entries:
        return None
    seq_len = ctx.task.seq_len
    spec = ctx.task.data.buckets
    result = SplitResult()
    if stage.split_by == "difficulty":  # groups in curriculum order: easy before hard, windows in time order
        result.groups = band_names(entries[0].difficulty)
    elif stage.split_by == "time":
        result.groups = list(stage.time_windows)
    selections: list[tuple[Entry, Unit, Selection]] = []
    length_counts = np.zeros(seq_len + 1, dtype=np.int64)
    for entry in entries:
        names = band_names(entry.difficulty)
        for unit in entry.units:
            sel = _select(entry, unit, result, result.groups)
            result.read += unit.rows
            lengths = unit.spool.read("n_tokens")  # type: ignore[union-attr]
            kept_lengths = lengths[sel.keep].astype(np.int64)
            result.documents += len(kept_lengths)
            piece_doc, _, pieces = _chunk_lengths(kept_lengths, seq_len)
            length_counts += np.bincount(pieces, minlength=seq_len + 1)
            doc_tokens = np.bincount(piece_doc, weights=pieces, minlength=len(kept_lengths)).astype(np.int64)
            for b, name in enumerate(names):
                in_band = sel.band[sel.keep] == b
                if in_band.any():
                    tally = result.bands.setdefault(name, [0, 0])
                    tally[0] += int(in_band.sum())
                    tally[1] += int(doc_tokens[in_band].sum())
            selections.append((entry, unit, sel))
    if result.documents == 0:
        files = ", ".join(sorted({str(u.path) for e in entries for u in e.units}))
        dropped = ", ".join(f"{k} {v}" for k, v in sorted(result.dropped.items(), key=lambda kv: -kv[1]))
        raise UsageError(f"stage '{stage.name}' ({split}): no documents left after filtering; read "
                         f"{result.read} rows from {files}; dropped: {dropped or 'none'}")
    lengths_present = np.flatnonzero(length_counts)
    counts_present = length_counts[lengths_present]
    edges = bucketing.choose_edges(lengths_present, counts_present, micro_batch_tokens, spec.max_buckets,
                                   spec.pad_multiple, seq_len)
    one = bucketing.one_bucket_edges(lengths_present, spec.pad_multiple, seq_len)
    cost = bucketing.cost_of_edges(lengths_present, counts_present, edges, micro_batch_tokens)
    cost_one = bucketing.cost_of_edges(lengths_present, counts_present, one, micro_batch_tokens)

    writers: dict[tuple[int, int], ShardWriter] = {}
    for entry, unit, sel in selections:
        _write_unit(entry, unit, sel, stage, split, edges, result.groups, writers, out, ctx)
    shards = []
    for (g, b), writer in sorted(writers.items()):
        writer.close()
        shards.append({"path": str(writer.path.relative_to(out)), "group": result.groups[g], "bucket": edges[b],
                       "samples": writer.samples, "tokens": writer.tokens})
    bucket_info = _bucket_report(edges, lengths_present, counts_present, micro_batch_tokens)
    samples = int(counts_present.sum())
    tokens = int((lengths_present * counts_present).sum())
    groups = {}
    for s in shards:
        tally = groups.setdefault(s["group"], {"samples": 0, "tokens": 0})
        tally["samples"] += s["samples"]
        tally["tokens"] += s["tokens"]
    return {
        "read": result.read, "documents": result.documents, "samples": samples, "tokens": tokens,
        "dropped": dict(sorted(result.dropped.items())),
        "length_counts": [[int(length), int(count)] for length, count in zip(lengths_present, counts_present)],
        "bucket_edges": edges, "buckets": bucket_info,
        "padding": {"bucketed": round(cost.padding_fraction, 6), "one_bucket": round(cost_one.padding_fraction, 6),
                    "one_bucket_edge": one[0], "slots_bucketed": cost.slots, "slots_one_bucket": cost_one.slots},
        "groups": groups,
        "difficulty": {name: {"documents": d, "tokens": t} for name, (d, t) in result.bands.items()},
        "shards": shards,
    }


def _prepare_stage(stage: StageSpec, entries: list[Entry], ctx: Context, out: Path, budget: int) -> dict[str, Any]:
    """One stage's splits written, and its summary for the manifest."""
    summary: dict[str, Any] = {"name": stage.name, "replay": dict(stage.replay)}
    for split in SPLITS:
        split_entries = [e for e in entries if e.stage is stage and e.split == split]
        info = _prepare_split(stage, split, split_entries, ctx, out, budget)
        if info is not None:
            summary[split] = info
    own = summary["train"]["tokens"] if "train" in summary else 0
    summary["tokens"] = own
    summary["samples"] = summary["train"]["samples"] if "train" in summary else 0
    summary["tokens_with_replay"] = tokens_with_replay(own, stage.replay)
    ctx.log(f"stage {stage.name}: {summary['samples']:,} samples, {own:,} tokens")
    return summary


def _bucket_report(edges: list[int], lengths: np.ndarray, counts: np.ndarray,
                   micro_batch_tokens: int) -> list[dict[str, Any]]:
    """Per length bucket: its samples, tokens, slots, padding and a length histogram (the manifest's)."""
    report, lower = [], 0
    for edge in edges:
        in_bucket = (lengths > lower) & (lengths <= edge)
        n = int(counts[in_bucket].sum())
        tokens = int((lengths[in_bucket] * counts[in_bucket]).sum())
        hist_edges = np.linspace(lower, edge, 9)
        hist = np.histogram(lengths[in_bucket], bins=hist_edges, weights=counts[in_bucket])[0]
        slots = bucketing.bucket_slots(n, edge, micro_batch_tokens) if n else 0
        report.append({"edge": edge, "min_length": lower + 1, "micro_batch_size": max(1, micro_batch_tokens // edge),
                       "samples": n, "tokens": tokens, "slots": slots,
                       "padding_fraction": round(1 - tokens / slots, 6) if slots else 0.0,
                       "histogram": {"edges": [round(x, 2) for x in hist_edges.tolist()],
                                     "counts": [int(c) for c in hist]}})
        lower = edge
    return report


def _token_batches(files: list[Path]) -> Iterator[pa.RecordBatch]:
    """The token ids of a unit's parts, batch by batch, in row order."""
    for file in files:
        with pa.OSFile(str(file), "rb") as source, pa.ipc.open_stream(source) as reader:
            yield from reader


@dataclass
class UnitRows:
    """What every kept row of one unit is written with: its selection, band names, domains, source."""

    sel: Selection
    names: np.ndarray
    domain: np.ndarray
    source_name: str


def _write_unit(entry: Entry, unit: Unit, sel: Selection, stage: StageSpec, split: str, edges: list[int],
                group_names: list[str], writers: dict[tuple[int, int], ShardWriter], out: Path, ctx: Context) -> None:
    try:
        source_name = str(unit.path.resolve().relative_to(ctx.base_dir.resolve()))
    except ValueError:
        source_name = str(unit.path)
    if entry.source.domain_field:
        values = np.array(unit.domain_values[entry.source.domain_field] + [None], dtype=object)
        domain_all = values[unit.spool.read(f"domain:{entry.source.domain_field}")]  # type: ignore[union-attr]
    else:
        domain_all = np.full(unit.rows, entry.source.domain, dtype=object)
    rows = UnitRows(sel=sel, names=np.array(band_names(entry.difficulty), dtype=object), domain=domain_all,
                    source_name=source_name)

    def writer_of(key: tuple[int, int]) -> ShardWriter:
        if key not in writers:
            writers[key] = ShardWriter(out / shard_path(stage.name, split, group_names[key[0]], edges[key[1]]))
        return writers[key]

    row = 0
    for batch in _token_batches(unit.tokens_files):
        _write_batch(batch, row, rows, np.asarray(edges), ctx.task.seq_len, writer_of)
        row += batch.num_rows


def _write_batch(batch: pa.RecordBatch, row: int, rows: UnitRows, edge_array: np.ndarray, seq_len: int,
                 writer_of: Callable[[tuple[int, int]], ShardWriter]) -> None:
    """The kept documents of one batch of token ids (its first row: `row`), cut into pieces, added
    to the shard of each piece's group and length bucket."""
    sel = rows.sel
    keep = sel.keep[row: row + batch.num_rows]
    if not keep.any():
        return
    kept = np.flatnonzero(keep)
    ids = batch.column("input_ids")
    offsets = np.asarray(ids.offsets)
    values = np.asarray(ids.values)
    lengths = (offsets[kept + 1] - offsets[kept]).astype(np.int64)
    piece_doc, piece_index, piece_len = _chunk_lengths(lengths, seq_len)
    piece_start = offsets[kept][piece_doc] + piece_index * seq_len
    bucket = np.searchsorted(edge_array, piece_len, side="left")
    doc_rows = kept[piece_doc] + row
    group = sel.group[doc_rows]
    for key in sorted(set(zip(group.tolist(), bucket.tolist()))):
        pick = np.flatnonzero((group == key[0]) & (bucket == key[1]))
        take_len = piece_len[pick]
        new_offsets = np.concatenate([[0], np.cumsum(take_len)]).astype(np.int32)
        gather = np.repeat(piece_start[pick] - new_offsets[:-1], take_len) + np.arange(new_offsets[-1])
        rows_in_unit = doc_rows[pick]
        writer_of(key).add(pa.record_batch([
            pa.ListArray.from_arrays(pa.array(new_offsets), pa.array(values[gather], type=pa.int32())),
            pa.array(take_len, type=pa.int32()),
            pa.array(sel.grade[rows_in_unit], type=pa.float64()),
            pa.array(rows.names[sel.band[rows_in_unit]].tolist(), type=pa.string()),
            pa.array([None if d is None else str(d) for d in rows.domain[rows_in_unit]], type=pa.string()),
            pa.array([rows.source_name] * len(pick), type=pa.string()),
            pa.array(rows_in_unit, type=pa.int64()),
            pa.array(piece_index[pick], type=pa.int32()),
        ], schema=SCHEMA))


# --- the entry point ---------------------------------------------------------------------------------


def prepare(task: TaskSpec, out_dir: Path | None = None, micro_batch_tokens: int | None = None,
            log: Log | None = None, allow_code: bool = False, workers: int = 1,
            rows_per_part: int = ROWS_PER_PART, trusted: bool = False, executor: str = "local",
            ray_address: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Prepare every stage's shards and the manifest; returns (output folder, manifest).
    `allow_code` lets a difficulty rule `module:function` import and run that code; `trusted`
    (--trust-remote-code) lets the tokenizer's and reference model's folders run theirs. The scan
    runs `workers` parts at a time (with `executor` "ray", on Ray at `ray_address`, 0 workers: as
    many as the cluster runs); the output is the same for any number of workers and either executor."""
    started = time.perf_counter()
    out = Path(out_dir) if out_dir else default_out_dir(task)
    entries, units, ctx = _context(task, log, allow_code, workers, rows_per_part, trusted)
    ctx.executor, ctx.ray_address = executor, ray_address
    base_dir, tokenizer, fingerprint = ctx.base_dir, ctx.tokenizer, task_fingerprint(task)
    tokenizer_path = Path(tokenizer.path)
    budget = micro_batch_tokens or task.data.buckets.micro_batch_tokens or 8 * task.seq_len
    dedup = task.data.dedup
    with OutputDir(out, MANIFEST_NAME) as output:
        for entry in entries:  # before any reading: rows of another format are trained from the raw source
            _check_text_rows(entry.source, base_dir)
        spool_root = output.tmp / "_spool"
        job, planned = _scan_job(entries, units, ctx, output.final)
        with _kept_for_resume_only(job.work):
            _scan(job, planned, units, ctx, spool_root)
            _resolve_duplicates(entries, units, ctx, job)
            stages = [_prepare_stage(stage, entries, ctx, output.tmp, budget) for stage in task.stages]
        shutil.rmtree(spool_root, ignore_errors=True)
        manifest = {
            "version": MANIFEST_VERSION, "task": task.name, "fingerprint": fingerprint,
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "seq_len": task.seq_len, "micro_batch_tokens": budget,
            "tokenizer": {"path": str(tokenizer_path), "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id},
            "dedup": {"exact": "BLAKE2b-64 of case- and whitespace-folded text" if dedup.exact else None,
                      "near": (f"datatrove MinHash over {dedup.shingle_words}-word shingles, {dedup.num_perm} "
                               f"32-bit hashes, LSH {dedup.bands} bands x {dedup.num_perm // dedup.bands} hashes, "
                               f"clusters verified at estimated Jaccard >= {dedup.threshold}") if dedup.near else None},
            "sources": [{"path": str(u.path), "rows": u.rows} for u in units],
            "stages": stages,
            "seconds": round(time.perf_counter() - started, 2),
        }
        (output.tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(job.work, ignore_errors=True)  # kept until now: a killed prepare resumes from its parts
    return output.final, manifest


def _context(task: TaskSpec, log: Log | None, allow_code: bool, workers: int,
             rows_per_part: int, trusted: bool = False) -> tuple[list[Entry], list[Unit], Context]:
    """The plan of work and what the scan needs, every check that needs no reading done first."""
    base_dir = Path(task.base_dir)
    try:
        entries, units = _plan_entries(task, base_dir)
    except UsageError as exc:
        command = generate_command(base_dir)
        if "not found" in str(exc) and command:
            raise UsageError(f"{exc} (generated data: `{command}` writes it)") from None
        raise
    graders = {}
    for entry in entries:  # first: a refused difficulty rule stops before any reading
        if entry.grader_key not in graders:
            graders[entry.grader_key] = Grader(entry.difficulty, base_dir, task.seq_len, allow_code, trusted)
    tokenizer = TextTokenizer(resolve_tokenizer_path(task.data.tokenizer, task.model, base_dir), trusted)
    _check_vocab(task, tokenizer, trusted)
    ctx = Context(task=task, base_dir=base_dir, tokenizer=tokenizer, eos_id=tokenizer.eos_id,
                  graders=graders, log=log or (lambda message: None), workers=workers, rows_per_part=rows_per_part,
                  allow_code=allow_code, trusted=trusted)
    return entries, units, ctx


def write_slurm_job(task: TaskSpec, out_dir: Path | None, options: SlurmOptions, finish_command: str,
                    log: Log | None = None, allow_code: bool = False,
                    rows_per_part: int = ROWS_PER_PART, trusted: bool = False) -> dict[str, Path]:
    """Write, without submitting, the Slurm scripts of a prepare: the scan's tasks as a job array
    (datatrove's), and a job after it that runs `finish_command` (the same prepare, which then finds
    every part scanned and only merges and writes the shards). Returns the scripts' paths."""
    out = Path(out_dir) if out_dir else default_out_dir(task)
    entries, units, ctx = _context(task, log, allow_code, options.array_parallelism, rows_per_part, trusted)
    for entry in entries:
        _check_text_rows(entry.source, ctx.base_dir)
    job, _ = _scan_job(entries, units, ctx, out)
    return write_slurm_scripts(job, options, finish_command)


def _check_vocab(task: TaskSpec, tokenizer: Any, trusted: bool = False) -> None:
    if not task.model:
        return
    try:
        vocab = load_model(task.model, trusted).hf_config.get("vocab_size")
    except UsageError:
        return
    if vocab and tokenizer.vocab_size > vocab:
        raise UsageError(f"the tokenizer has {tokenizer.vocab_size:,} tokens but model {task.model} has a vocabulary of "
                         f"{vocab:,}: set data.tokenizer to the model's tokenizer")
