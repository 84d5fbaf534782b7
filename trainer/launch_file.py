"""What the launcher hands its workers: one JSON file in the run dir, read by `python -m trainer.worker`.

A multi-process launch (trainer/launch.py) writes the plan it runs (with the engine it runs on, which
may override the plan file's), the run dir, whether the ranks resume, and the whole `TrainOptions`
before torchrun starts; every rank reads it back. The options travel as the dataclass's fields, so a
field added to `TrainOptions` reaches the workers without code here. The file is written aside and
renamed into place (a rank never reads half of it), one per node (each node's launcher writes its
own, as each holds its own lock), and removed when the launch ends.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from specs.errors import UsageError
from specs.plan_file import Plan
from specs.run_dir import launch_file_name
from trainer.options import TrainOptions

LAUNCH_FILE_VERSION = 1


class LaunchFile(BaseModel):
    """One launch of a segment's ranks: what each worker trains, where, and how."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = LAUNCH_FILE_VERSION
    plan: Plan  # as the launcher runs it: its engine applied, a plan without a task made one stage
    out: Path  # the run dir
    resume: bool  # continue from the run dir's last checkpoint (a later segment, an out-of-memory relaunch)
    options: TrainOptions


def launch_file_path(out: Path, node_rank: int = 0) -> Path:
    """This node's launch file in the run dir (nodes may share the run dir, as their locks do)."""
    return out / launch_file_name(node_rank)


def write_launch_file(path: Path, launch: LaunchFile) -> Path:
    """Write `launch` to `path` aside, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(launch.model_dump_json(indent=1) + "\n")
    tmp.replace(path)
    return path


def read_launch_file(path: Path) -> LaunchFile:
    """The launch a worker was started for; a missing or broken file is one line."""
    try:
        return LaunchFile.model_validate_json(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"launch file not found: {path} (workers are started by `advisor train`)") from None
    except ValidationError as exc:
        raise UsageError(f"launch file {path}: {exc.errors()[0]['msg']} at "
                         f"{'.'.join(map(str, exc.errors()[0]['loc']))}") from None
