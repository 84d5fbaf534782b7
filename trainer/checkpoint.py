"""Atomic checkpoints: written aside, renamed into place, the last N kept.

A checkpoint is a folder `checkpoints/step-00000042/` holding the engine's state (model,
optimizer; DeepSpeed's own layout under ZeRO), `trainer.json` (stage, step, data positions, spike
statistics, rollbacks) and each rank's RNG state. Only folders renamed into place count, so a
crash while writing leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

PREFIX = "step-"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def latest(root: Path) -> Path | None:
    done = sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir() and (p / "trainer.json").is_file())
    return done[-1] if done else None


def save(root: Path, global_step: int, trainer_state: dict[str, Any], save_engine: Callable[[Path], None],
         keep: int) -> Path:
    final = root / f"{PREFIX}{global_step:08d}"
    tmp = root / f".tmp-{PREFIX}{global_step:08d}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    save_engine(tmp)
    torch.save(torch.get_rng_state(), tmp / f"rng-{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        (tmp / "trainer.json").write_text(json.dumps(trainer_state))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load(path: Path, load_engine: Callable[[Path], None]) -> dict[str, Any]:
    load_engine(path)
    rng = path / f"rng-{_rank()}.pt"
    if rng.is_file():
        torch.set_rng_state(torch.load(rng, weights_only=True))
    return json.loads((path / "trainer.json").read_text())
