"""Tokenised shards: Arrow IPC stream files that `datasets.Dataset.from_file` memory-maps directly.

Layout under the output folder: `<stage>/<split>/<group>/bucket-<edge>.arrow`, where group is
`all`, a domain, a difficulty band or a time window (the stage's `split_by`) and edge is the
bucket's longest sample. Every sample of a bucket pads to its edge; the manifest gives each
bucket's micro-batch size for the token budget.

The whole output folder is written aside and renamed into place at the end (`OutputDir`), so a
reader never sees half a shard or a manifest without its shards.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from specs.errors import UsageError
from specs.core import safe_name
from trainer.data.manifest import read_manifest

SCHEMA = pa.schema([
    ("input_ids", pa.list_(pa.int32())),
    ("length", pa.int32()),
    ("difficulty", pa.float64()),
    ("band", pa.string()),
    ("domain", pa.string()),
    ("source", pa.string()),
    ("row", pa.int64()),      # 0-based row of the document in its source file
    ("chunk", pa.int32()),    # which seq_len piece of a longer document
])
_FLUSH_ROWS = 8192


def shard_path(stage: str, split: str, group: str, edge: int) -> str:
    return f"{safe_name(stage)}/{split}/{safe_name(group)}/bucket-{edge:05d}.arrow"


class ShardWriter:
    """Appends record batches to one Arrow stream file, flushing every few thousand rows."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, SCHEMA)
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self.samples = 0
        self.tokens = 0

    def add(self, batch: pa.RecordBatch) -> None:
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        self.samples += batch.num_rows
        self.tokens += int(np.asarray(batch.column("length")).sum())
        if self._pending_rows >= _FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            table = pa.Table.from_batches(self._pending, SCHEMA).combine_chunks()
            for batch in table.to_batches():
                self._writer.write_batch(batch)
        self._pending, self._pending_rows = [], 0

    def close(self) -> None:
        self.flush()
        self._writer.close()
        self._sink.close()


def foreign_content(folder: Path, marker: str) -> str | None:
    """Why `folder` is not a folder this tool wrote (None: it is empty, or it holds a valid manifest
    and nothing but the shards that manifest lists), so that replacing it loses nothing of the user's."""
    if not folder.is_dir():
        return "not a folder"
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_symlink() or not p.is_dir()}
    if not files:
        return None
    if marker not in files:
        return f"no {marker}"
    try:
        manifest = read_manifest(folder)
        listed = {marker} | {shard["path"] for stage in manifest["stages"] for split in ("train", "eval")
                             if stage.get(split) for shard in stage[split]["shards"]}
    except UsageError as exc:
        return str(exc)
    except (KeyError, TypeError, AttributeError):
        return f"its {marker} is not a data manifest"
    extra = sorted(files - listed)
    if extra:
        return f"it holds {len(extra)} file(s) its {marker} does not list, e.g. {extra[0]}"
    return None


class OutputDir:
    """Write into a hidden sibling folder; on success swap it for the final folder, on failure
    remove it. An existing final folder is replaced only if it is empty or holds exactly what a
    previous run wrote (`foreign_content`)."""

    def __init__(self, final: Path, marker: str) -> None:
        self.final = Path(final).resolve()
        self.marker = marker
        if self.final.exists():
            problem = foreign_content(self.final, marker)
            if problem:
                raise UsageError(f"--out {final}: exists and is not a prepared-data folder ({problem}); "
                                 "choose another folder")
        self.tmp = self.final.parent / f".{self.final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"

    def __enter__(self) -> "OutputDir":
        self.tmp.mkdir(parents=True)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        old = None
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.old-{uuid.uuid4().hex[:6]}"
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def load_shard(path: Path) -> Any:
    """One shard as a memory-mapped `datasets.Dataset` (columns as in SCHEMA)."""
    import datasets

    return datasets.Dataset.from_file(str(path))


def stage_shards(out_dir: Path, stage: str, split: str = "train") -> list[dict[str, Any]]:
    """The manifest's shard entries of one stage and split (path made absolute), in curriculum
    order: groups as the stage lists them, buckets shortest first."""

    manifest = read_manifest(out_dir)
    for entry in manifest["stages"]:
        if entry["name"] == stage:
            split_info = entry.get(split)
            if not split_info:
                return []
            return [{**s, "path": str(Path(out_dir) / s["path"])} for s in split_info["shards"]]
    raise UsageError(f"no stage '{stage}' in {out_dir}/manifest.json")
