"""Durable, verified checkpoints: written aside, fsynced, renamed into place, the last N kept.

A checkpoint is a folder `checkpoints/step-00000042/` holding the engine's state (model,
optimizer; DeepSpeed's own layout under ZeRO), `trainer.json` (stage, step, data positions, spike
statistics), each rank's RNG state (CPU, and CUDA when used) and, written last, `manifest.json`:
every file's size, sha256 and the rank that wrote it. Every rank fsyncs and hashes its own files
before the rename (trainer/seal.py), so a power cut cannot leave a renamed folder with missing data,
on any node; a checkpoint one rank could not seal gets no manifest and is never renamed into place.
Older checkpoints are deleted only after the new one is durable. A checkpoint counts when its
manifest verifies, each rank checking its own files: a damaged newest one (a truncated file, a disk
error) is passed over for the newest good one. Rank 0 lists the candidates; all ranks load the one
that verified, so ranks never load different checkpoints.

ADVISOR_CHECKPOINT_DELAY_S (seconds) sleeps between the files of a save: it lets a test kill a
run at any moment of a checkpoint write.

The DTensor engines (tensor parallel, FSDP2, pipeline) write their state as one
torch.distributed.checkpoint (DCP) folder, `dcp/`, through `save_distributed` and
`load_distributed`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from specs.run_dir import CHECKPOINT_STATE_FILE
from trainer import seal

PREFIX = "step-"
MANIFEST = seal.MANIFEST
DELAY_ENV = seal.DELAY_ENV


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank (a picklable object; itself without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _step_folders(root: Path) -> list[Path]:
    """Renamed-into-place checkpoint folders, oldest first (names sort by step)."""
    return sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir())


def problem(path: Path) -> str | None:
    """Collective: why the checkpoint `path` cannot be loaded (no manifest, a rank's files not in
    it, a file missing, another size or hash), or None when every file verifies; each rank checks
    the files its rank wrote (trainer.seal `verify`)."""
    return seal.verify(path)


def good_checkpoints(root: Path, below: int | None = None, wanted: int = 1) -> tuple[list[Path], list[list[str]]]:
    """The newest `wanted` verified checkpoints of rank 0's folder (newest first; of steps below
    `below` when given) and the damaged ones passed over ([name, problem]), the same on every rank:
    the ranks verify each candidate together, and hashing stops once enough verify."""
    names = [p.name for p in reversed(_step_folders(root))] if _rank() == 0 else None
    good: list[Path] = []
    damaged: list[list[str]] = []
    for name in seal.from_rank_zero(names):
        path = root / name
        if len(good) >= wanted:
            break
        if below is not None and step_of(path) >= below:
            continue
        reason = problem(path)
        if reason is None:
            good.append(path)
        else:
            damaged.append([name, reason])
    return good, damaged


def latest(root: Path) -> Path | None:
    """The newest checkpoint that verifies (verified by all ranks together; the same on every rank)."""
    good, _ = good_checkpoints(root)
    return good[0] if good else None


def step_of(path: Path) -> int:
    """The global step a checkpoint folder holds (from its name)."""
    return int(path.name[len(PREFIX):])


def stage_of(path: Path) -> int:
    """The stage a checkpoint resumes into (a stage-end checkpoint: the next stage, at its start)."""
    return int(json.loads((path / CHECKPOINT_STATE_FILE).read_text())["stage"])


def saved_layout_record(path: Path) -> dict[str, Any] | None:
    """The layout an OOM fallback had switched to when `path` was written (None: the plan's)."""
    return json.loads((path / CHECKPOINT_STATE_FILE).read_text()).get("layout")


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _put_in_place(root: Path, tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`. A checkpoint of the same step (a redone step after a rollback) is
    renamed away first and deleted only once the new one is in place."""
    replaced = None
    if final.exists():
        replaced = root / f".replaced-{final.name}"
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    seal.pause()
    tmp.rename(final)
    seal.fsync(root)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def _rotate(root: Path, keep: int, current: Path) -> None:
    """Delete all but the newest `keep` checkpoints (never `current`) and leftovers of crashed saves."""
    for old in _step_folders(root)[:-keep]:
        if old != current:
            seal.pause()
            shutil.rmtree(old, ignore_errors=True)
    for leftover in (*root.glob(f".tmp-{PREFIX}*"), *root.glob(f".replaced-{PREFIX}*")):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)


def save(root: Path, global_step: int, trainer_state: dict[str, Any], save_engine: Callable[[Path], None],
         keep: int) -> Path:
    """Collective: write the checkpoint aside, seal it on every rank that wrote part of it
    (trainer.seal), rename it into place and rotate. Waits for other ranks' disks run under the
    seal's own, longer timeout. Raises trainer.seal.NotSealed, leaving the previous checkpoints the
    newest, when a rank could not seal its files."""
    final = root / f"{PREFIX}{global_step:08d}"
    tmp = root / f".tmp-{PREFIX}{global_step:08d}"
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save's: disk work the others wait for
        tmp.mkdir(parents=True)
    seal.long_barrier()
    tmp.mkdir(parents=True, exist_ok=True)  # on a node that does not share rank 0's filesystem
    save_engine(tmp)
    seal.pause()
    torch.save(_rng_state(), tmp / f"rng-{rank}.pt")
    if rank == 0:
        (tmp / CHECKPOINT_STATE_FILE).write_text(json.dumps(trainer_state))
    seal.long_barrier()  # every rank's writes are done before any lists its own
    seal.seal(tmp, global_step)
    if rank == 0:
        _put_in_place(root, tmp, final)
        _rotate(root, keep, final)
    seal.long_barrier()
    if rank != 0 and _local_rank() == 0 and tmp.is_dir():  # this node's own disk: its ranks' files
        _put_in_place(root, tmp, final)
        _rotate(root, keep, final)
    seal.long_barrier()
    return final


def _local_rank() -> int:
    """This rank's place on its node (torchrun's LOCAL_RANK; the global rank without it)."""
    return int(os.environ.get("LOCAL_RANK", _rank()))


def discard_after(root: Path, step: int) -> list[str]:
    """Rank 0: delete the checkpoints taken after `step` (the guard found them on a bad path)."""
    removed = []
    if _rank() == 0:
        for path in _step_folders(root):
            if step_of(path) > step:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
    seal.long_barrier()
    return removed


def load(path: Path, load_engine: Callable[[Path], None]) -> dict[str, Any]:
    load_engine(path)
    rng = path / f"rng-{_rank()}.pt"
    if rng.is_file():
        state = torch.load(rng, weights_only=True)
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
    return json.loads((path / CHECKPOINT_STATE_FILE).read_text())


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


def load_full_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, model: dict[str, torch.Tensor],
                    moments: dict[str, dict[str, torch.Tensor]]) -> None:
    """Whole tensors by parameter name (another engine's checkpoint: the plain engine's
    `engine.pt`, DeepSpeed's universal one) into a DTensor engine's shards, by DCP's state-dict
    API: `model` the weights, `moments` Adam's state per trainable parameter (empty: a fresh
    optimizer). A pipeline stage takes the names it holds."""
    from torch.distributed.checkpoint.state_dict import (  # DCP: only DTensor engines need it
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    held = get_model_state_dict(module).keys()
    set_model_state_dict(module, {k: v for k, v in model.items() if k in held}, options=full)
    trained = [name for name, p in module.named_parameters() if p.requires_grad]
    if not moments:
        optimizer.state.clear()
        return
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    state = {"state": {name: moments[name] for name in trained},
             "param_groups": [{**hyper, "params": trained}]}
    set_optimizer_state_dict(module, optimizer, state, options=full)


def plain_state(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The plain engine's `engine.pt` as whole tensors by name: its model, and its AdamW state by
    parameter name. torch numbers the optimizer's parameters in the model's order, which its state
    dict keeps (a tied weight stored once: torch.save keeps the sharing, so a repeated storage is
    the same parameter)."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    seen: set[int] = set()
    names = []
    for name, tensor in saved["model"].items():
        if tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            names.append(name)
    numbered = [i for group in saved["optimizer"]["param_groups"] for i in group["params"]]
    if len(numbered) != len(names):
        raise RuntimeError(f"{path}: {len(numbered)} optimized parameters but {len(names)} weights; "
                           "a frozen base (LoRA) does not resume on this engine")
    by_number = dict(zip(numbered, names))
    return saved["model"], {by_number[i]: value for i, value in saved["optimizer"]["state"].items()}


# -- DeepSpeed's checkpoints read by another number of ranks or another engine ------------------------

ENGINE_TAG = "engine"  # the folder DeepSpeed's checkpoint has inside the trainer's
UNIVERSAL = "universal"


# Each data-parallel rank writes its optimizer partition, `[bf16_]zero_pp_rank_<dp rank>_mp_rank_<mp>_optim_states.pt`,
# at every ZeRO stage; the model states are one file per rank only under ZeRO-3 (ZeRO-1/2: one file in all).
_OPTIMIZER_PARTITION = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")


def saved_ranks(directory: Path) -> int | None:
    """How many data-parallel ranks wrote the DeepSpeed checkpoint in `directory` (None: none there):
    the distinct ranks of its optimizer partitions."""
    folder = directory / ENGINE_TAG
    matches = (_OPTIMIZER_PARTITION.fullmatch(p.name) for p in folder.iterdir()) if folder.is_dir() else ()
    return len({m.group(1) for m in matches if m}) or None


def universal_checkpoint(directory: Path) -> Path:
    """Collective: `directory`'s DeepSpeed checkpoint converted once into DeepSpeed's universal
    format (`directory/universal/`: every parameter whole, with its Adam moments, for any world
    size), by DeepSpeed's own `ds_to_universal` in a subprocess of rank 0 (it starts worker pools,
    which do not belong in a training rank). Written aside and renamed: the manifest does not list
    it, so the checkpoint still verifies, and its rotation deletes it."""
    out = directory / UNIVERSAL
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not out.is_dir():
        tmp = directory / f".tmp-{UNIVERSAL}"
        command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                   str(directory / ENGINE_TAG), "--output_folder", str(tmp), "--inject_missing_state",
                   "--num_extract_workers", "1", "--num_merge_workers", "1"]
        env = dict(os.environ)
        if not torch.cuda.is_available():
            env.setdefault("DS_ACCELERATOR", "cpu")  # as trainer/engines/deepspeed_zero.py tells its import
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"DeepSpeed could not convert {directory.name} to a universal checkpoint: "
                               f"{done.stderr.strip().splitlines()[-1:] or done.returncode}")
        tmp.rename(out)
    seal.long_barrier()  # the others wait for the conversion under the seal's timeout
    return out


def universal_state(directory: Path, module: torch.nn.Module) -> tuple[dict[str, torch.Tensor],
                                                                      dict[str, dict[str, torch.Tensor]]]:
    """A DeepSpeed run's checkpoint as whole tensors by name, for another engine: each trainable
    parameter of `module` with its Adam moments and step count. DeepSpeed's universal format holds
    them flattened, one folder per parameter name, the step in its optimizer state; read by hand
    because DeepSpeed reads that format only into its own engine. Frozen parameters (a LoRA base)
    are not in it: they come from the model's weights, as when the run started."""
    zero = universal_checkpoint(directory) / "zero"
    # DeepSpeed pickles two objects of its own there (the ZeRO stage enum, the loss scaler): allowed
    # by name, so the file still loads with weights_only (deferred: only DeepSpeed checkpoints need them)
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler]):
        common = torch.load(zero / "optimizer_state.pt", map_location="cpu", weights_only=True)
    step = float(next(iter(common["optimizer_state_dict"]["state"].values()))["step"])
    model, moments = {}, {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            read = {key: torch.load(zero / name / f"{key}.pt", map_location="cpu", weights_only=True).view(param.shape)
                    for key in ("fp32", "exp_avg", "exp_avg_sq")}
            model[name] = read["fp32"]
            moments[name] = {"step": torch.tensor(step), "exp_avg": read["exp_avg"], "exp_avg_sq": read["exp_avg_sq"]}
    return model, moments
