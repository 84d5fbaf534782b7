"""The full model weights at a segment boundary, in the one format every engine reads back.

A curriculum stage may run its own layout: other devices, another method, other degrees
(`advisor.plan_file.stage_segments`). Engines' own checkpoints do not cross that line: DeepSpeed's
partitions, FSDP2's and the pipeline's DCP shards and a LoRA model's adapters each describe one
layout. So the last checkpoint of a segment also holds `model/`: the full weights under Hugging
Face's parameter names (LoRA adapters merged into their base), in the training's master precision,
as `config.json` + `model.safetensors`. The next segment builds its model from that folder as from
local weights (`build_model(..., weights=...)`), with a fresh optimizer.

Gathering is collective: every rank calls `write_full_weights`; rank 0 writes.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from advisor.specs import ModelSpec

HANDOFF_DIR = "model"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _merged(module: torch.nn.Module) -> torch.nn.Module:
    """A peft model with its adapters folded into the base weights (the engine is discarded after
    the handoff, so merging in place is safe); any other module as it is."""
    if hasattr(module, "merge_and_unload"):
        return module.merge_and_unload()
    return module


def _plain_weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in _merged(engine.module).state_dict().items()}


def _deepspeed_weights(engine) -> dict[str, torch.Tensor]:
    """Full fine-tuning: DeepSpeed's own accessor for the fp32 master of every parameter. LoRA: the
    module gathered (a no-op below ZeRO-3) and its adapters merged; its frozen base has no master.
    Both gather under ZeRO-3, a collective, so every rank walks the parameters in the same order."""
    import deepspeed  # deferred: DeepSpeed loads only where it runs
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.engine.module
    if hasattr(module, "merge_and_unload"):
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().cpu().clone() for k, v in _merged(module).state_dict().items()}
    out = {}
    for name, param in module.named_parameters():
        full = safe_get_full_fp32_param(param)
        out[name] = (full if full is not None else param).detach().cpu().clone()
    return out


def _dtensor_weights(engine) -> dict[str, torch.Tensor]:
    """Full tensors of this rank's module (the model, or its pipeline stage), gathered by DCP's
    state-dict helpers; with a pipeline, each stage's first rank sends its part to rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True))
    local = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in full.items()}
    if engine.layout.pp == 1:
        return local
    mesh = engine.mesh
    sends = mesh.coordinate("dp") == 0 and mesh.coordinate("tp") == 0
    parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size() if _rank() == 0 else []
    dist.gather_object(local if sends else {}, parts if _rank() == 0 else None, dst=0)
    merged: dict[str, torch.Tensor] = {}
    for part in parts or []:
        merged.update(part or {})
    return merged


def full_weights(engine) -> dict[str, torch.Tensor]:
    """The model's full weights under HF names: on rank 0 (other ranks may get a partial dict)."""
    kind = type(engine).__name__
    if kind == "DeepSpeedEngine":
        return _deepspeed_weights(engine)
    if kind in ("ShardedEngine", "PipelineEngine"):
        return _dtensor_weights(engine)
    return _plain_weights(engine)


def write_full_weights(engine, spec: ModelSpec, directory: Path) -> None:
    """Collective: gather the full weights and, on rank 0, write them with the model's config."""
    from safetensors.torch import save_file  # deferred: only boundaries between layouts need it
    from transformers import AutoConfig

    weights = full_weights(engine)
    if _rank() != 0:
        return
    directory.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(**spec.hf_config)
    if getattr(config, "tie_word_embeddings", False):
        weights.pop("lm_head.weight", None)  # one storage in the model: safetensors refuses shared tensors
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(directory / "model.safetensors"))
    config.save_pretrained(str(directory))
