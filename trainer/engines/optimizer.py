"""The optimizer step the plain, sharded and pipeline engines share: AdamW, gradient clipping
and a global gradient norm (DeepSpeed runs its own step from its config).

Two clipping functions, because their arithmetic differs in the last bits and each engine keeps
its own: torch's ``clip_grad_norm_`` for replicated gradients, and ``clip_sharded_grad_norm``
for gradients split across tensor, data and pipeline ranks.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from trainer.engines.base import device

# DTensor warns that a (dp, tp)-sharded sum is made whole by one all-reduce per mesh dimension.
# For the norm that is harmless: every rank of a collective receives the same result, so all
# ranks end with the same norm and clip coefficient.
logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
    lambda record: "sequential all_reduce" not in record.getMessage())


def adamw(params: list[torch.nn.Parameter], weight_decay: float, fused: bool = False) -> torch.optim.AdamW:
    """AdamW at learning rate 0 (each step sets its own). On the CPU one tensor at a time
    (foreach=False); `fused` takes CUDA's fused kernel, which the plain engine uses."""
    cuda = params[0].is_cuda
    return torch.optim.AdamW(params, lr=0.0, weight_decay=weight_decay, fused=(cuda and fused) or None,
                             foreach=False if not cuda else None)


def set_learning_rate(optimizer: Any, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_step(optimizer: torch.optim.Optimizer, lr: float, clip_grads: Callable[[], float]) -> float:
    """Clip (``clip_grads`` returns the norm before clipping), step at `lr`, free the gradients;
    the gradient norm."""
    set_learning_rate(optimizer, lr)
    norm = clip_grads()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def clip_replicated_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """torch's ``clip_grad_norm_`` (no clipping when `max_norm` <= 0): every rank holds whole,
    identical gradients (one process, or DDP after its all-reduce)."""
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))


def grad_norm_squared(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient entries over this rank's parameters, each counted once.

    DTensor gradients (TP shards, FSDP shards) are summed per (mesh, placements) group and made
    whole with one collective per group; plain gradients are replicas and count as they are.
    """
    from torch.distributed.tensor import DTensor  # ~0.5 s to import: loaded when first needed

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    parts = []
    for key, grads in groups.items():
        part = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        parts.append(part.full_tensor() if key is not None else part)
    if not parts:
        return torch.zeros((), device=device())
    return torch.stack(parts).sum()


def clip_sharded_grad_norm(params: list[torch.nn.Parameter], max_norm: float,
                           pp_group: dist.ProcessGroup | None = None) -> float:
    """Global gradient norm (all stages, all shards), and clip to ``max_norm`` when it is > 0.

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` (coefficient max_norm/(norm+1e-6),
    capped at 1), which cannot mix plain tensors with DTensors or sum over pipeline stages.
    """
    squared = grad_norm_squared(params)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, group=pp_group)  # each stage holds different parameters
    norm = squared.sqrt()
    if max_norm > 0:
        coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return float(norm)
