"""The model a plan trains: the HF causal LM from its config (or local weights), in the layout's
dtype, with its recomputation and its method (full fine-tuning, LoRA or QLoRA).

Every engine, and so the timed steps of calibration, verification and the benches, builds its
model here, so that what is timed is what `advisor train` runs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specs.capabilities import DOCUMENT_ATTENTION, attention_implementation
from specs.errors import UsageError
from specs.core import Layout, ModelSpec
from profiler.attention_support import runnable_attention
from specs.task import AdapterSpec
from profiler.hardware_bench import TORCH_DTYPES
from trainer.adapters import apply_lora
from trainer.attention import register_document_attention
from trainer.engines.base import device
from trainer.materialize import build_on_meta, materialize, pending_init
from trainer.recompute import apply_recomputation
from specs.remote_code import code_loaded, ensure_model_code, load_model_code, refuse_remote_code


# What a saved config.json carries besides the model's computation: where and by what it was saved, the
# dtype of its files (the layout's dtype decides the training one), the inference cache, how a model
# without weights would be initialised, and the special tokens' ids (the tokenizer's to decide: an
# instruct model of a base model's preset names more end tokens)
_NOT_THE_MODEL = {"_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype", "use_cache",
                  "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
                  "_commit_hash", "_attn_implementation_autoset", "_attn_implementation", "attn_implementation"}


def weights_config_differences(spec: ModelSpec, weights: str, trusted: bool = False) -> list[str]:
    """The fields of the `weights` folder's config.json that differ from the plan's model config, as
    `field: <plan's> in the plan, <folder's> in the weights`, both read through transformers (so a
    field one of them leaves at its default compares by that default). `trusted`: --trust-remote-code."""
    from transformers import AutoConfig  # heavy: loaded only when weights are given

    if refuse_remote_code(Path(weights), "config.json", "--weights", trusted):
        load_model_code(Path(weights))  # its model_type registered: the plan's config of that type reads with it
    else:
        ensure_model_code(spec.hf_config, spec.source, trusted, "the plan's model")
    planned = AutoConfig.for_model(**spec.hf_config).to_dict()
    given = AutoConfig.from_pretrained(weights, local_files_only=True, trust_remote_code=trusted).to_dict()
    return [f"{key}: {planned.get(key)} in the plan, {given.get(key)} in the weights"
            for key in sorted((set(planned) | set(given)) - _NOT_THE_MODEL) if planned.get(key) != given.get(key)]


def check_weights(spec: ModelSpec, weights: str | None, trusted: bool = False) -> None:
    """Refuse `--weights` whose model is not the plan's: the plan's memory, time and layout were made for
    its config, and the run would silently train another model. `trusted`: --trust-remote-code."""
    if not weights:
        return
    if not (Path(weights) / "config.json").is_file():
        raise UsageError(f"--weights {weights}: no config.json there (a local Hugging Face model folder)")
    differences = weights_config_differences(spec, weights, trusted)
    if differences:
        shown = "; ".join(differences[:6]) + (f"; and {len(differences) - 6} more" if len(differences) > 6 else "")
        raise UsageError(f"--weights {weights}: its model differs from the plan's ({shown}); "
                         "re-plan with --model pointing at that folder, or give the weights the plan was made for")


def build_model(spec: ModelSpec, layout: Layout, seed: int, weights: str | None = None,
                adapter: AdapterSpec | None = None, trusted: bool = False) -> torch.nn.Module:
    """The HF model from its config (or the config of a local folder of weights) with its
    parameters on the meta device: the engine shards it, then fills only what each rank holds
    (`trainer.materialize`: a seeded init equal to the unsplit model's, or the folder's safetensors).
    LoRA/QLoRA: `adapter`'s alpha and targets (default: alpha 2r on every linear). `trusted`:
    --trust-remote-code, without which a folder naming its own Python code (`auto_map`) is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: loaded only when a model is built

    torch.manual_seed(seed)
    # refused at once without the opt-in, rather than transformers asking "run the custom code? [y/N]"
    # inside a training log; with it, the folder's classes are registered (specs.remote_code)
    if weights and refuse_remote_code(Path(weights), "config.json", "--weights", trusted):
        load_model_code(Path(weights))
    elif not weights and not code_loaded(spec.hf_config, spec.source):
        ensure_model_code(spec.hf_config, spec.source, trusted, "the plan's model")
    config = (AutoConfig.from_pretrained(weights, local_files_only=True, trust_remote_code=trusted) if weights
              else AutoConfig.for_model(**spec.hf_config))
    config.use_cache = False
    attention = attention_implementation(device().type)
    if attention == DOCUMENT_ATTENTION:
        register_document_attention()
    attention = runnable_attention(config, attention)  # eager for a family without an SDPA path (Gemma 2)
    model = build_on_meta(lambda: AutoModelForCausalLM.from_config(config, attn_implementation=attention,
                                                                   dtype=torch.float32), seed, weights)
    if layout.dtype != "fp32" and layout.zero == 0 and layout.method != "full":
        # LoRA/QLoRA: the frozen base in 16 bits, peft's adapters in fp32 (specs.capabilities
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
                       on: torch.device | None = None, trusted: bool = False) -> torch.nn.Module:
    """`build_model`, filled whole on one device (`on`, default this rank's) without an engine: for
    evaluation models and for tests that run a model directly. The values are the ones every engine's
    shards are cut from."""
    model = build_model(spec, layout, seed, weights, trusted=trusted)
    materialize(model, pending_init(model), on or device())
    return model
