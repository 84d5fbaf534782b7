"""DeepSpeed ZeRO 1-3, optionally offloaded, with the config the planner exported."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specs.errors import UsageError
from specs.core import Layout
from trainer.batch import MicroBatch, as_micro_batch
from trainer.engines.base import device, state_bytes, use_declared_loss
from trainer.engines.optimizer import set_learning_rate
from trainer.checkpoint import ENGINE_TAG, saved_ranks, universal_checkpoint
from trainer.materialize import materialize, materialize_zero3, pending_init

ACCELERATOR_ENV = "DS_ACCELERATOR"


def import_deepspeed() -> Any:
    """DeepSpeed, imported in this process for the device it runs on.

    DeepSpeed chooses its accelerator once, at import: on a machine without CUDA it is told the CPU
    one (its probe of every other accelerator otherwise warns). The variable is set for that import
    alone, never left in this process's environment: processes started from here (torchrun's ranks
    of `advisor run`) inherit the environment, and on a GPU machine ranks told "cpu" would run
    DeepSpeed on the CPU accelerator."""
    if "deepspeed" in sys.modules or torch.cuda.is_available():
        import deepspeed  # heavy optional dependency: only ZeRO layouts load it

        return deepspeed
    with _environment(ACCELERATOR_ENV, "cpu"):
        import deepspeed  # heavy optional dependency: only ZeRO layouts load it
    return deepspeed


@contextlib.contextmanager
def _environment(name: str, value: str):
    """`name=value` in os.environ inside the block; outside it, what was there before."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


class DeepSpeedEngine:
    """DeepSpeed counts micro-steps itself and updates only at the accumulation boundary; it
    clips and steps AdamW inside ``engine.step()``."""

    def __init__(self, model: torch.nn.Module, layout: Layout, config: dict[str, Any], clip: float,
                 weight_decay: float = 0.0):
        deepspeed = import_deepspeed()
        config = dict(config)
        config["gradient_clipping"] = clip  # DeepSpeed clips at 1.0 unless told (NOTES trap 3)
        cpu = not torch.cuda.is_available()
        use_declared_loss(model, layout, "deepspeed")
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": weight_decay,
                                                          "torch_adam": cpu}}
        if layout.zero == 3:  # partitioned by DeepSpeed's own zero.Init, then each rank fills its partition
            materialize_zero3(model, pending_init(model), config)
        else:
            materialize(model, pending_init(model), device())
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        self.layout = layout
        self.model = self.engine
        self.data_rank = dist.get_rank()

    def micro_step(self, batch: MicroBatch | torch.Tensor) -> float:
        loss = self.engine(**as_micro_batch(batch).model_inputs()).loss
        self.engine.backward(loss)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # DeepSpeed counts micro-steps; it updates only at the boundary
        return float(loss.detach())

    def optimizer_step(self, lr: float) -> float:
        set_learning_rate(self.optimizer, lr)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=ENGINE_TAG)

    def load(self, directory: Path) -> None:
        """Its own checkpoint; one written by another number of ranks (a plan re-made for another
        device count) through DeepSpeed's universal checkpoint, which any world size reads."""
        if saved_ranks(directory) is None:  # DeepSpeed would silently load nothing
            raise UsageError(f"checkpoint {directory.name} was written by another engine (plain or FSDP2/TP/"
                             "pipeline); DeepSpeed resumes its own checkpoints only: re-plan with --engine fsdp2, "
                             "or resume with the layout that wrote it")
        if saved_ranks(directory) == dist.get_world_size():
            self.engine.load_checkpoint(str(directory), tag=ENGINE_TAG, load_optimizer_states=True,
                                        load_lr_scheduler_states=False)
            return
        universal = universal_checkpoint(directory)
        self.engine._config.load_universal_checkpoint = True  # DeepSpeed reads the flag at load time
        try:
            self.engine.load_checkpoint(str(universal.parent), tag=universal.name, load_optimizer_states=True,
                                        load_lr_scheduler_states=False)
        finally:
            self.engine._config.load_universal_checkpoint = False  # its own checkpoints from now on

    def state_bytes(self) -> dict[str, int]:
        """Under ZeRO-3 a parameter counts its partition (``ds_tensor``) plus its module tensor,
        which is empty between gathers unless DeepSpeed keeps it whole (small "persistent"
        parameters); the optimizer counts DeepSpeed's fp32 master partitions and their Adam
        moments; the gradients its partitions, plus the whole ``.grad`` ZeRO-1 keeps while
        micro-batches accumulate."""
        parameters = [t for p in self.engine.module.parameters() for t in (p, getattr(p, "ds_tensor", None))
                      if t is not None]
        zero_optimizer = self.optimizer
        accumulating = [p.grad for p in self.engine.module.parameters()]  # ZeRO-1 until the boundary
        return state_bytes(parameters, zero_optimizer.optimizer, _gradient_partitions(zero_optimizer) + accumulating)


def _gradient_partitions(zero_optimizer: Any) -> list[torch.Tensor]:
    """DeepSpeed keeps gradients in its own flat partitions, not in ``.grad``: ZeRO-3 in one
    buffer for the whole run, ZeRO-1/2 per parameter group from the boundary's backward to the
    step."""
    flat = getattr(zero_optimizer, "grad_partitions_flat_buffer", None)
    if flat is not None:
        return [flat]
    held: list[torch.Tensor] = []
    for group in getattr(zero_optimizer, "averaged_gradients", {}).values():
        if group is not None:
            held.extend(group if isinstance(group, list) else [group])
    return held
