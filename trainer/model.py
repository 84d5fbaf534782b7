"""The model a plan trains: the HF causal LM from its config (or local weights), in the layout's
dtype, with its recomputation and its method (full fine-tuning, LoRA or QLoRA).

Every engine, and so the timed steps of calibration, verification and the benches, builds its
model here, so that what is timed is what `advisor train` runs.
"""

from __future__ import annotations

import torch

from advisor.specs import Layout, ModelSpec
from profiler.hardware_bench import TORCH_DTYPES
from trainer.adapters import apply_lora
from trainer.recompute import apply_recomputation


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


