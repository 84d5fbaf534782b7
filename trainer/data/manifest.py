"""The manifest of prepared data: what `advisor data prepare` wrote, and what the planner reads back.

`manifest.json` sits at the top of the output folder. It records, per stage and split (train,
eval): documents, samples and tokens, the length histogram, the bucket edges with each bucket's
samples, tokens, token slots and histogram, the padding fraction with the chosen buckets and with
one bucket, the shards, and why documents were dropped. A fingerprint of everything that decides
the token counts (data settings, stages, source files' sizes and times) tells a stale manifest.

This module imports nothing heavy: the planner calls `manifest_stage_tokens`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from specs.errors import UsageError
from specs.task import TaskSpec
from trainer.data.sources import expand_source_path, file_type_of

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


def default_out_dir(task: TaskSpec) -> Path:
    out = Path(task.data.out)
    return out if out.is_absolute() else Path(task.base_dir) / out


def task_fingerprint(task: TaskSpec) -> str:
    """Hash of what decides the prepared tokens: data settings (not buckets or out), stages and
    source files (path, size, modification time). Raises UsageError when a source is missing."""

    base = Path(task.base_dir)
    data = task.data.model_dump(mode="json", exclude={"buckets", "out"})
    stages = []
    files = []
    for stage in task.stages:
        stages.append(stage.model_dump(
            mode="json", include={"name", "sources", "eval_sources", "filters", "difficulty", "split_by",
                                  "time_windows", "replay"}))
        for source in [*stage.sources, *stage.eval_sources]:
            for path in expand_source_path(base, source.path, file_type_of(base, source)):
                st = path.stat()
                files.append([str(path.resolve()), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"model": task.model, "seq_len": task.seq_len, "data": data, "stages": stages,
                       "files": files}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of an output folder (or the manifest file itself)."""
    path = Path(path)
    file = path / MANIFEST_NAME if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"no {MANIFEST_NAME} in {path}: run `advisor data prepare --task TASK --out {path}` first")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read {file}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        raise UsageError(f"{file}: not a version-{MANIFEST_VERSION} data manifest")
    return manifest


def manifest_stage_tokens(task: TaskSpec, out_dir: Path | None = None) -> dict[str, int] | None:
    """Tokens per stage from the prepared data, or None when there is no manifest for this task or
    it is stale (the task's data settings or its source files changed since `prepare`).

    A stage's count is one pass over its own train shards with the task's replay shares added on
    top: own / (1 - sum of replay shares). Stages without their own sources are left out.
    """
    folder = out_dir or default_out_dir(task)
    try:
        manifest = read_manifest(folder)
        if manifest.get("fingerprint") != task_fingerprint(task):
            return None
    except UsageError:
        return None
    return {s["name"]: int(s["tokens_with_replay"]) for s in manifest["stages"]
            if s.get("tokens_with_replay") is not None}


def tokens_with_replay(own_tokens: int, replay: dict[str, float]) -> int | None:
    share = sum(replay.values())
    if own_tokens <= 0 or share >= 1:
        return None
    return int(round(own_tokens / (1.0 - share)))
