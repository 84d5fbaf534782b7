"""The model a plan trains: the HF causal LM from its config (or local weights), in the layout's
dtype, with its recomputation and its method (full fine-tuning, LoRA or QLoRA).

Every engine, and so the timed steps of calibration, verification and the benches, builds its
model here, so that what is timed is what `advisor train` runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from advisor.capabilities import DOCUMENT_ATTENTION, attention_implementation
from advisor.specs import Layout, ModelSpec
from advisor.task import AdapterSpec
from profiler.hardware_bench import TORCH_DTYPES
from trainer.adapters import apply_lora
from trainer.attention import register_document_attention
from trainer.engines.base import device
from trainer.materialize import build_on_meta, materialize, pending_init
from trainer.recompute import apply_recomputation
from trainer.remote_code import refuse_remote_code


def build_model(spec: ModelSpec, layout: Layout, seed: int, weights: str | None = None,
                adapter: AdapterSpec | None = None) -> torch.nn.Module:
    """The HF model from its config (or the config of a local folder of weights) with its
    parameters on the meta device: the engine shards it, then fills only what each rank holds
    (`trainer.materialize`: a seeded init equal to the unsplit model's, or the folder's safetensors).
    LoRA/QLoRA: `adapter`'s alpha and targets (default: alpha 2r on every linear)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: loaded only when a model is built

    torch.manual_seed(seed)
    if weights:
        refuse_remote_code(Path(weights), "config.json", "--weights")
    # trust_remote_code=False: a folder whose config names its own Python code (`auto_map`) is refused
    # at once, rather than transformers asking "run the custom code? [y/N]" inside a training log
    config = (AutoConfig.from_pretrained(weights, local_files_only=True, trust_remote_code=False) if weights
              else AutoConfig.for_model(**spec.hf_config))
    config.use_cache = False
    attention = attention_implementation(device().type)
    if attention == DOCUMENT_ATTENTION:
        register_document_attention()
    model = build_on_meta(lambda: AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                                   dtype=torch.float32), seed, weights)
    if layout.dtype != "fp32" and layout.zero == 0 and layout.method != "full":
        # LoRA/QLoRA: the frozen base in 16 bits, peft's adapters in fp32 (advisor.capabilities
        # `precision`: frozen16). Full fine-tuning keeps fp32 weights whatever the dtype: autocast or
        # FSDP2's MixedPrecisionPolicy computes in 16 bits, DeepSpeed casts itself from its config.
        model = model.to(TORCH_DTYPES[layout.dtype])
    if layout.recompute != "none":
        apply_recomputation(model, layout)
    if layout.method in ("lora", "qlora"):
        materialize(model, pending_init(model), device())  # peft wraps a real base: adapters are replicated
        model = apply_lora(model, layout, adapter)
    return model




def build_filled_model(spec: ModelSpec, layout: Layout, seed: int, weights: str | None = None,
                       on: torch.device | None = None) -> torch.nn.Module:
    """`build_model`, filled whole on one device (`on`, default this rank's) without an engine: for
    evaluation models and for tests that run a model directly. The values are the ones every engine's
    shards are cut from."""
    model = build_model(spec, layout, seed, weights)
    materialize(model, pending_init(model), on or device())
    return model
