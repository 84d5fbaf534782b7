"""The model a plan trains: the HF causal LM from its config (or local weights), in the layout's
dtype, with its recomputation and its method (full fine-tuning, LoRA or QLoRA).

Every engine, the benches' step harness and calibration build their model here, so that what is
timed is what `advisor train` runs.
"""

from __future__ import annotations

import torch

from advisor.errors import UsageError
from advisor.specs import Layout, ModelSpec, chunk_layers, layers_per_stage
from profiler.hardware_bench import TORCH_DTYPES


def build_model(spec: ModelSpec, layout: Layout, seed: int, weights: str | None = None) -> torch.nn.Module:
    """The HF model from its config (random init, seeded) or from a local folder of weights."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: loaded only when a model is built

    torch.manual_seed(seed)
    if weights:
        model = AutoModelForCausalLM.from_pretrained(weights, local_files_only=True, attn_implementation="sdpa")
    else:
        config = AutoConfig.for_model(**spec.hf_config)
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if layout.dtype != "fp32" and layout.zero == 0:
        model = model.to(TORCH_DTYPES[layout.dtype])  # DeepSpeed casts itself from its config
    if layout.recompute != "none":
        apply_recomputation(model, layout)
    if layout.method in ("lora", "qlora"):
        model = apply_lora(model, layout)
    return model


def apply_recomputation(model: torch.nn.Module, layout: Layout) -> None:
    """Checkpoint the layers the plan recomputes: on each pipeline device, the first
    `recompute_layers[s]` of its own layers (all when unset; see `recomputed_layer_indices`).

    transformers checkpoints every layer or none; the plan may recompute only some, so we flip the
    per-layer flag that its GradientCheckpointingLayer reads. Applied before LoRA wraps the model,
    and for every engine (DeepSpeed's included), which is why it lives here and not among the
    DTensor `apply_*` steps of `trainer.parallelize`.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")
              and m.__class__.__name__.endswith("DecoderLayer")]
    recomputed = recomputed_layer_indices(len(layers), layout)
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index in recomputed


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


def apply_lora(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """LoRA adapters of rank `lora_rank` on every linear layer (alpha 2r, no dropout); the base
    stays frozen."""
    if layout.method == "qlora" and not torch.cuda.is_available():
        raise UsageError("QLoRA needs bitsandbytes' 4-bit kernels on CUDA; this machine has none (use lora)")
    from peft import LoraConfig, get_peft_model  # heavy optional dependency, only for LoRA plans

    return get_peft_model(model, LoraConfig(r=layout.lora_rank, lora_alpha=2 * layout.lora_rank,
                                            lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"))
