"""Activation recomputation of the decoder layers a plan recomputes, as the cost model prices it.

"full" checkpoints whole decoder layers (only each layer's input is kept). "selective" is torch's
op-level selective activation checkpointing (`specs.core.SELECTIVE_POLICY`): inside a
checkpointed layer the outputs of the GEMMs and of the attention kernel are cached in forward and
handed back when backward re-runs the layer, so only the element-wise ops (norms, rotary,
activations, residual adds) run twice. The op list is `specs.core.SELECTIVE_SAVED_OPS`, which
the trace (`profiler.model_trace`) reads too, so what is priced is what is kept.

Applied when the model is built, for every engine (DeepSpeed's included), before LoRA wraps it.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from specs.core import SELECTIVE_SAVED_OPS, Layout, chunk_layers, layers_per_stage


def selective_policy() -> Callable[..., Any]:
    """The per-op policy of `torch.utils.checkpoint.create_selective_checkpoint_contexts`:
    MUST_SAVE the outputs of `SELECTIVE_SAVED_OPS`, PREFER_RECOMPUTE everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = {getattr(torch.ops.aten, name) for name in SELECTIVE_SAVED_OPS if hasattr(torch.ops.aten, name)}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        return CheckpointPolicy.MUST_SAVE if packet in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_kwargs(recompute: str) -> dict[str, Any]:
    """What transformers' `gradient_checkpointing_enable` passes on to `torch.utils.checkpoint`:
    non-reentrant checkpointing, plus for "selective" a `context_fn` that makes fresh selective
    contexts for every checkpointed call (each layer's forward and its recompute share them)."""
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if recompute == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, selective_policy())
    return kwargs


def apply_recomputation(model: torch.nn.Module, layout: Layout) -> None:
    """Checkpoint the layers the plan recomputes, with its mode: in each pipeline stage, the
    first `recompute_layers[s]` of its own layers (all when unset).

    transformers checkpoints every layer or none; the plan may recompute only some, so we flip the
    per-layer flag that its GradientCheckpointingLayer reads (the checkpoint function, and with it
    the selective policy, is the same for every layer).
    """
    enable_checkpointing(model, checkpoint_kwargs(layout.recompute))
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")
              and m.__class__.__name__.endswith("DecoderLayer")]
    recomputed = recomputed_layer_indices(len(layers), layout)
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index in recomputed


def enable_checkpointing(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """transformers' switch for checkpointing every decoder layer with `kwargs`: named
    `activation_checkpointing_enable` from 5.23, `gradient_checkpointing_enable` before (our floor
    is older; the old name still works in 5.23+, with a deprecation warning we avoid)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def recomputed_layer_indices(n_layers: int, layout: Layout) -> set[int]:
    """Global indices of the decoder layers that recompute: device by device (the split of
    `layers_per_stage`, which the pipeline engine cuts too), the first `recompute_layers[s]` of
    the device's own layers, taken chunk by chunk (`chunk_layers`) when the pipeline
    interleaves: its first chunk holds the most micro-batches in flight."""
    if layout.recompute == "none":
        return set()
    chunks = chunk_layers(n_layers, layout)
    counts = layout.recompute_layers or layers_per_stage(n_layers, layout)
    out: set[int] = set()
    for device, count in enumerate(counts):
        held = [layer for chunk in chunks[device::layout.pp] for layer in chunk]
        out.update(held[:count])
    return out
