"""The contract every engine keeps with the training loop, and what the engines share.

An engine owns a model and its optimizer under one parallel layout (``advisor.specs.Layout``,
the single source of truth for degrees, as ``ParallelDims`` is in torchtitan). The loop only
ever calls the five operations of ``Engine``, whichever back-end runs: plain torch or DDP,
DeepSpeed ZeRO, the DTensor sharded engine (TP, FSDP2) or the pipeline.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

import torch


@runtime_checkable
class Engine(Protocol):
    """One model and its optimizer under one layout.

    ``model`` is what evaluation calls as ``model(input_ids=..., labels=...).loss``; ``data_rank``
    says which data-parallel shard of the batch this rank reads (tensor and pipeline ranks of
    one replica read the same sequences).
    """

    model: torch.nn.Module
    data_rank: int

    def micro_step(self, input_ids: torch.Tensor) -> float | None:
        """Forward and backward of one micro-batch; its mean token loss, or None when the engine
        defers the work (a pipeline runs all of a step's micro-batches on the gas-th call)."""
        ...

    def optimizer_step(self, lr: float) -> float:
        """Clip, step and clear the gradients at learning rate `lr`; the global gradient norm."""
        ...

    def save(self, directory: Path) -> None:
        """Write this rank's part of the full state (model and optimizer) into `directory`."""
        ...

    def load(self, directory: Path) -> None:
        """Read back, in place, what `save` wrote."""
        ...

    def state_bytes(parameters: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer,
                gradients: Iterable[torch.Tensor] | None = None) -> dict[str, int]:
    """Parameters, gradients and optimizer state held through torch tensors: the parameters,
    the gradients (their ``.grad`` unless the engine keeps them elsewhere), and every tensor of
    the optimizer's per-parameter state (Adam's moments and step), plus the optimizer's own
    parameters when they are copies (DeepSpeed's fp32 master partitions) rather than the
    model's."""
    parameters = list(parameters)
    own = {id(p) for p in parameters}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    masters = [p for p in stepped if id(p) not in own]
    moments = [t for per_param in optimizer.state.values() for t in per_param.values() if torch.is_tensor(t)]
    if gradients is None:
        gradients = [p.grad for p in parameters + masters]
    return {
        "parameters": local_bytes(parameters),
        "gradients": local_bytes(gradients),
        "optimizer": local_bytes(masters + moments),
    }
