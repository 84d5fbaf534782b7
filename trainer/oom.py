"""Runtime out-of-memory fallback: which layout replaces one that ran out of memory, and a fault
injector to exercise the path where no real OOM can happen (CPU).

The plan ranks alternatives that keep the global batch (dp x mbs x gas). A fallback may change
only what the running processes can change in place: micro-batch size, accumulation,
recomputation and offload. Anything that needs another world size, another parallel shape or
another engine (ZeRO stage, method, dtype) cannot load the same checkpoint in the same processes
and is skipped, with the reason recorded; so is any layout the trainer does not run for this model
(`specs.capabilities.runnable_problem`, the judge the planner's search and `make_engine` use).

The loop leaves the `except` block before it rebuilds: until then the exception's traceback keeps
the failed step's frames, and with them its activations and gradients, alive.

One process switches in place. Several cannot: a rank out of memory leaves the others waiting in a
collective, so it writes RUN_DIR/oom_relaunch.json and exits; torchrun stops the node's other
ranks, and `advisor train`'s launcher starts them again with --resume, which reads that layout.
(Across nodes, ranks of other nodes wait for the collective timeout unless the OOM hit them too.)

ADVISOR_INJECT_OOM (comma-separated):
  step=N     raise torch.OutOfMemoryError once, in the first micro-step of optimizer step N;
  tokens=N   raise in every micro-step whose batch holds more than N token slots (a memory limit).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from specs import environment
from specs.capabilities import config_shape, runnable_problem
from specs.errors import UsageError
from specs.plan_file import Plan
from specs.core import Layout
from specs.run_dir import OOM_RELAUNCH_FILE

ENV = "ADVISOR_INJECT_OOM"
RELAUNCH = OOM_RELAUNCH_FILE  # in the run dir: the layout the launcher restarts the ranks with
# what a fallback must keep: the processes, the parallel shape and the engine's checkpoint format
_FIXED = ("dp", "tp", "pp", "vpp", "sp", "zero", "method", "lora_rank", "dtype", "seq", "stage_layers")


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA OOM is one since torch 2.1), or a runtime error that says so
    (allocators of other back-ends and DeepSpeed re-raise them as RuntimeError)."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower())


class OOMInjector:
    """Raises torch.OutOfMemoryError on the conditions ADVISOR_INJECT_OOM names."""

    def __init__(self, spec: str | None = None):
        spec = environment.read(ENV) if spec is None else spec
        self.step: int | None = None
        self.tokens: int | None = None
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, value = part.partition("=")
            if key not in ("step", "tokens") or not value.isdigit():
                raise UsageError(f"{ENV}={spec!r}: expected step=N and/or tokens=N")
            setattr(self, key, int(value))

    def check(self, step: int, micro: int, batch: np.ndarray) -> None:
        """Call before the micro-step `micro` of optimizer step `step` (1-based) runs `batch`."""
        if self.step is not None and step == self.step and micro == 0:
            self.step = None  # once: the replacement layout gets through this step
            raise torch.OutOfMemoryError(f"injected by {ENV} at step {step}")
        if self.tokens is not None and batch.size > self.tokens:
            raise torch.OutOfMemoryError(f"injected by {ENV}: micro-batch of {batch.size} token slots "
                                         f"> {self.tokens}")


def next_layout(plan: Plan, failed: list[Layout], device_type: str | None = None) -> tuple[Layout | None, list[str]]:
    """The best alternative not yet tried that the running processes can switch to and the trainer
    runs on `device_type` (default: the plan's), and why the alternatives passed over were skipped."""
    current = failed[-1]
    shape = config_shape(plan.model.hf_config)
    device_type = device_type or plan.hardware.device_type
    skipped = []
    for candidate in (p.layout for p in plan.alternatives):
        if any(candidate == tried for tried in failed):
            continue
        if candidate.devices != current.devices:
            skipped.append(f"{candidate.short()}: needs {candidate.devices} processes, this run has "
                           f"{current.devices}")
            continue
        if candidate.global_batch != current.global_batch:
            skipped.append(f"{candidate.short()}: global batch {candidate.global_batch}, not {current.global_batch}")
            continue
        changed = [key for key in _FIXED if getattr(candidate, key) != getattr(current, key)]
        if changed:
            skipped.append(f"{candidate.short()}: changes {', '.join(changed)} (another engine or shape)")
            continue
        problem = runnable_problem(candidate, shape, device_type, plan.engine)
        if problem:
            skipped.append(f"{candidate.short()}: not runnable here ({problem})")
            continue
        return candidate, skipped
    return None, skipped


def free_memory() -> None:
    """Return what the dropped engine held to the allocator (and, on CUDA, to the driver)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def plan_digest(plan: Plan) -> str:
    """Which plan a relaunch request belongs to: its layouts are that plan's alternatives."""
    return hashlib.sha256(json.dumps(plan.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:16]


def request_relaunch(run_dir: Path, plan: Plan, replacement: Layout, failed: list[Layout], event: dict) -> None:
    """Ask the launcher to restart every rank with `replacement` (written aside, then renamed:
    several ranks may ask at once, with the same answer)."""
    record = {"layout": replacement.model_dump(mode="json"), "failed": [f.model_dump(mode="json") for f in failed],
              "event": event, "plan": plan_digest(plan)}
    tmp = run_dir / f".{RELAUNCH}.{os.getpid()}"
    tmp.write_text(json.dumps(record))
    tmp.replace(run_dir / RELAUNCH)


def pending_relaunch(run_dir: Path, since: float) -> dict | None:
    """The restart a rank asked for during the launch that began at `since` (wall clock)."""
    path = run_dir / RELAUNCH
    if path.is_file() and path.stat().st_mtime >= since:
        return json.loads(path.read_text())
    return None


def relaunch_layout(run_dir: Path, plan: Plan, default: Layout, world: int) -> tuple[Layout, list[Layout]]:
    """The layout a restart after an OOM runs with (and those that failed), else `default`. A request
    of another plan (the run was re-planned since; or written before requests named their plan) is
    stale: its layout was one of that plan's alternatives, and would override this plan's."""
    path = run_dir / RELAUNCH
    if not path.is_file():
        return default, []
    record = json.loads(path.read_text())
    layout = Layout.model_validate(record["layout"])
    if layout.devices != world or record.get("plan") != plan_digest(plan):
        return default, []
    return layout, [Layout.model_validate(f) for f in record["failed"]]
