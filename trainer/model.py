"""The model a plan trains: the HF causal LM from its config (or local weights), in the layout's
dtype, with its recomputation and its method (full fine-tuning, LoRA or QLoRA).

Every engine, the benches' step harness and calibration build their model here, so that what is
timed is what `advisor train` runs.
"""

from __future__ import annotations

import torch

from advisor.errors import UsageError
from advisor.specs import Layout, ModelSpec, layers_per_stage
from profiler.hardware_bench import TORCH_DTYPES
from trainer.engines.base import device
from trainer.materialize import build_on_meta, materialize, pending_init


def build_model(spec: ModelSpec, layout: Layout, seed: int, weights: str | None = None) -> torch.nn.Module:
    """The HF model from its config (or the config of a local folder of weights) with its
    parameters on the meta device: the engine shards it, then fills only what each rank holds
    (`trainer.materialize`: a seeded init equal to the unsplit model's, or the folder's safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: loaded only when a model is built

    torch.manual_seed(seed)
    config = (AutoConfig.from_pretrained(weights, local_files_only=True) if weights
              else AutoConfig.for_model(**spec.hf_config))
    config.use_cache = False
    model = build_on_meta(lambda: AutoModelForCausalLM.from_config(config, attn_implementation="sdpa",
                                                                   dtype=torch.float32), seed, weights)
    if layout.dtype != "fp32" and layout.zero == 0:
        model = model.to(TORCH_DTYPES[layout.dtype])  # DeepSpeed casts itself from its config
    if layout.recompute != "none":
        apply_recomputation(model, layout)
    if layout.method in ("lora", "qlora"):
        materialize(model, pending_init(model), device())  # peft wraps a real base: adapters are replicated
        model = apply_lora(model, layout)
    return model


def apply_recomputation(model: torch.nn.Module, layout: Layout) -> None:
    """Checkpoint the layers the plan recomputes: in each pipeline stage, the first
    `recompute_layers[s]` of its own layers (all when unset).

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
    """Global indices of the decoder layers that recompute: stage by stage (the split of
    `layers_per_stage`, which the pipeline engine cuts too), the first `recompute_layers[s]`."""
    if layout.recompute == "none":
        return set()
    split = layers_per_stage(n_layers, layout)
    counts = layout.recompute_layers or split
    out: set[int] = set()
    first = 0
    for held, count in zip(split, counts):
        out.update(range(first, first + min(count, held)))
        first += held
    return out


def apply_lora(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """LoRA adapters of rank `lora_rank` on every linear layer (alpha 2r, no dropout); the base
    stays frozen."""
    if layout.method == "qlora" and not torch.cuda.is_available():
        raise UsageError("QLoRA needs bitsandbytes' 4-bit kernels on CUDA; this machine has none (use lora)")
    from peft import LoraConfig, get_peft_model  # heavy optional dependency, only for LoRA plans

    return get_peft_model(model, LoraConfig(r=layout.lora_rank, lora_alpha=2 * layout.lora_rank,
                                            lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"))
