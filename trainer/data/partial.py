"""What a prepare that has not finished holds (`advisor data stats` on a partial folder).

A prepare writes two folders beside its output before the output exists: the scan's work folder
(`.NAME.scan-KEY`, trainer/data/pipeline.py's `work_folder`: the parts, and datatrove's completion
markers, per-task stats and `executor.json`, which lists every part) and the output written aside
(`.NAME.tmp-PID-HEX`, trainer/data/shards.py's `OutputDir`: shards as they are written). A killed
prepare leaves both; the same command resumes from the work folder. This module reads them and
changes nothing.

Which documents are kept or dropped is not known until every part is scanned: duplicates are
judged over the whole task. So a partial report gives parts and rows scanned, never drops.

Light on purpose (json and paths only): `advisor data stats` imports it at every call.
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import Any

_SCAN = re.compile(r"\.(?P<name>.+)\.scan-[0-9a-f]+")
_ASIDE = re.compile(r"\.(?P<name>.+)\.tmp-\d+-[0-9a-f]+")


def scan_folder(out: Path, key: str) -> Path:
    """The work folder of the prepare of `out` whose scan has job key `key`."""
    return out.parent / f".{out.name}.scan-{key}"


def scan_folders(out: Path) -> list[Path]:
    """Every work folder beside `out` (one, unless a prepare with other settings left its own)."""
    return sorted((p for p in out.parent.glob(f".{glob.escape(out.name)}.scan-*") if p.is_dir()),
                  key=lambda p: p.stat().st_mtime)


def partial_prepare(directory: Path) -> dict[str, Any] | None:
    """The report of an unfinished prepare at `directory` (the output folder it will become, its
    work folder or its aside folder), or None when there is none there."""
    directory = Path(directory).resolve()
    for pattern in (_SCAN, _ASIDE):
        match = pattern.fullmatch(directory.name)
        if match:
            out = directory.parent / match["name"]
            break
    else:
        out = directory
    works = [directory] if _SCAN.fullmatch(directory.name) and directory.is_dir() else scan_folders(out)
    if not works:
        return None
    asides = sorted((p for p in out.parent.glob(f".{glob.escape(out.name)}.tmp-*") if p.is_dir()),
                    key=lambda p: p.stat().st_mtime)
    return _report(out, works[-1], asides[-1] if asides else None)


def _report(out: Path, work: Path, aside: Path | None) -> dict[str, Any]:
    logs = work / "datatrove"
    done = sorted(int(p.name) for p in (logs / "completions").glob("[0-9]*")) if (logs / "completions").is_dir() else []
    rows_of = {rank: _rows_scanned(logs / "stats" / f"{rank:05d}.json") for rank in done}
    parts, sources = _planned_parts(logs / "executor.json")
    total = len(parts) if parts else None
    report: dict[str, Any] = {
        "partial": True, "folder": str(out), "work": str(work), "aside": str(aside) if aside else None,
        "phase": "scanning" if total is None or len(done) < total else "merging and writing shards",
        "parts": {"done": len(done), "total": total},
        "rows_scanned": sum(rows_of.values()),
        "rows_total": sum(p["rows"] for p in parts) if parts and all(p.get("rows") is not None for p in parts)
        else None,
        "kept": None, "dropped": None,  # decided over the whole task once every part is scanned
        "shards_written": _shards_written(aside),
        "sources": [],
    }
    for index, path in enumerate(sources):
        own = [p for p in parts if p.get("unit") == index]
        report["sources"].append({
            "path": path, "parts": len(own), "parts_done": sum(p["index"] in rows_of for p in own),
            "rows_scanned": sum(rows_of.get(p["index"], 0) for p in own)})
    return report


def _rows_scanned(stats_file: Path) -> int:
    """Rows of one finished part, from datatrove's stats of its task (ScanStep counts `documents`)."""
    try:
        steps = json.loads(stats_file.read_text())
        return int(sum(step.get("stats", {}).get("documents", {}).get("total", 0) for step in steps))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def _planned_parts(executor_json: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every part of the scan and the source files, from datatrove's record of the executor (written
    when the scan starts): ([{index, unit, rows}], [path of each unit]); empty when unreadable."""
    try:
        job = json.loads(executor_json.read_text())["pipeline"][0]["job"]
        parts = [{"index": int(p["index"]), "unit": int(p["unit"]), "rows": p.get("rows")} for p in job["parts"]]
        return parts, [str(u["path"]) for u in job["units"]]
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return [], []


def _shards_written(aside: Path | None) -> int:
    if aside is None:
        return 0
    return sum(1 for p in aside.rglob("*.arrow") if "_spool" not in p.relative_to(aside).parts)
