"""Plain PyTorch in one process, or DDP across data-parallel ranks."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from specs.core import Layout
from trainer.batch import MicroBatch
from trainer.checkpoint import load_distributed, saved_ranks, universal_state
from trainer.engines.base import autocast_forward, device, forward_backward, state_bytes, use_declared_loss
from trainer.engines.optimizer import adamw, clip_replicated_grad_norm, optimizer_step
from trainer.materialize import materialize, pending_init

# DDP's bucket size (its default, written out because the cost model has to model it); gradients
# live in the buckets instead of in copies of them.
DDP_SETTINGS: dict[str, Any] = {"bucket_cap_mb": 25, "gradient_as_bucket_view": True}


class PlainEngine:
    """AdamW over fp32 weights (bf16 computes under autocast), optional clipping, and under DDP
    no_sync while accumulating (one all-reduce per optimizer step). Replicas are identical, so
    rank 0 alone saves ``engine.pt``."""

    def __init__(self, model: torch.nn.Module, layout: Layout, clip: float, weight_decay: float = 0.0):
        self.layout = layout
        self.clip = clip
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        use_declared_loss(model, layout, "plain")
        autocast_forward(model, layout, "plain")  # bf16-mixed: fp32 weights and AdamW, bf16 compute
        materialize(model, pending_init(model), device())  # whole: every replica holds every weight
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, weight_decay, fused=True)
        self.module = model
        self.model = DistributedDataParallel(model, **DDP_SETTINGS) if self.world > 1 else model
        self.data_rank = dist.get_rank() if dist.is_initialized() else 0
        self._micro = 0

    def micro_step(self, batch: MicroBatch | torch.Tensor) -> float:
        self._micro += 1
        boundary = self._micro % self.layout.gas == 0
        sync = contextlib.nullcontext() if boundary or self.world == 1 else self.model.no_sync()
        with sync:
            return forward_backward(self.model, batch, self.layout.gas)

    def optimizer_step(self, lr: float) -> float:
        return optimizer_step(self.optimizer, lr, lambda: clip_replicated_grad_norm(self.params, self.clip))

    def save(self, directory: Path) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:  # replicas are identical
            torch.save({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()},
                       directory / "engine.pt")

    def load(self, directory: Path) -> None:
        """Its own `engine.pt`, or another engine's checkpoint after a re-plan for another number of
        devices: a DTensor engine's DCP folder (FSDP2, TP or pipeline ranks; DCP reads the shards
        whole), or DeepSpeed's (through its universal checkpoint)."""
        if not (directory / "engine.pt").is_file() and (directory / "dcp").is_dir():
            load_distributed(self.module, self.optimizer, directory)
            return
        if not (directory / "engine.pt").is_file() and saved_ranks(directory):  # DeepSpeed ranks wrote it
            self._load_whole(*universal_state(directory, self.module))
            return
        state = torch.load(directory / "engine.pt", map_location="cpu", weights_only=True)
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def _load_whole(self, model: dict[str, torch.Tensor], moments: dict[str, dict[str, torch.Tensor]]) -> None:
        """Another engine's whole tensors by name (trainer.checkpoint `universal_state`): the trainable
        parameters and their AdamW state; frozen ones stay as the weights gave them."""
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                if name in model:
                    param.copy_(model[name])
                    self.optimizer.state[param] = {key: value.to(param.device, torch.float32)
                                                   for key, value in moments[name].items()}

    def state_bytes(self) -> dict[str, int]:
        return state_bytes(self.module.parameters(), self.optimizer)
