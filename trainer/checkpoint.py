"""Atomic checkpoints: written aside, renamed into place, the last N kept.

A checkpoint is a folder `checkpoints/step-00000042/` holding the engine's state (model,
optimizer; DeepSpeed's own layout under ZeRO), `trainer.json` (stage, step, data positions, spike
statistics, rollbacks) and each rank's RNG state. Only folders renamed into place count, so a
crash while writing leaves the previous checkpoint as the latest.

The DTensor engines (tensor parallel, FSDP2, pipeline) write their state as one
torch.distributed.checkpoint (DCP) folder, `dcp/`, through `save_distributed` and
`load_distributed`.
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


def _flat_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # DCP: only DTensor engines need it

    return StateDictOptions(flatten_optimizer_state_dict=True)


def save_distributed(module: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """DCP checkpoint of model and optimizer: every rank writes its own shards, once each.

    The optimizer is left out before its first step: asking DCP for the state of an empty
    optimizer would initialise it with a zero-gradient step and advance Adam's step count. Its
    state is flattened to one key per parameter (hyper-parameters included): pipeline stages hold
    different parameter groups, which one shared `param_groups` entry could not describe.
    """
    import torch.distributed.checkpoint as dcp  # DCP: only DTensor engines need it
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    if optimizer.state:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer, options=_flat_options())
    dcp.save(state, checkpoint_id=str(directory / "dcp"))


def load_distributed(module: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load what ``save_distributed`` wrote, in place (DCP reshards if the layout changed)."""
    import torch.distributed.checkpoint as dcp  # DCP: only DTensor engines need it
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = str(directory / "dcp")
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    has_optimizer = any(key.startswith("optimizer.") for key in saved)
    if has_optimizer:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer, options=_flat_options())
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["model"])
    if has_optimizer:
        set_optimizer_state_dict(module, optimizer, state["optimizer"], options=_flat_options())
    else:  # a checkpoint taken before the first step: a fresh optimizer
        optimizer.state.clear()
