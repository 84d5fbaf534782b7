"""The full model weights at a segment boundary, in the one format every engine reads back.

A curriculum stage may run its own layout: other devices, another method, other degrees
(`specs.plan_file.stage_segments`). Engines' own checkpoints do not cross that line: DeepSpeed's
partitions, FSDP2's and the pipeline's DCP shards and a LoRA model's adapters each describe one
layout. So the last checkpoint of a segment also holds `model/`: the full weights under Hugging
Face's parameter names (LoRA adapters merged into their base), in the training's master precision,
as `config.json` + `model.safetensors`. The next segment builds its model from that folder as from
local weights (`build_model(..., weights=...)`), with a fresh optimizer.

The same gathering makes the run's artifacts (`write_model`): at every stage end
`RUN/stages/<stage>/model/`, and at the run's end `RUN/model/`, a folder transformers or peft load
as it is. Full training: an HF model folder (`config.json`, `model.safetensors` or its shards with
their index, `generation_config.json`, the tokenizer) in the training dtype. LoRA/QLoRA: a peft
adapter folder (`adapter_config.json`, `adapter_model.safetensors`, the tokenizer), and with
`--merge` the merged full weights in its `merged/` subfolder.

Gathering is collective: every rank calls `write_full_weights` / `write_model`; rank 0 writes.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from specs.remote_code import save_model_code
from specs.core import ModelSpec
from specs.run_dir import MODEL_DIR
from trainer.data.tokenizer import load_tokenizer

HANDOFF_DIR = "model"
ARTIFACT_DIR = MODEL_DIR  # RUN/model/ and RUN/stages/<stage>/model/
MERGED_DIR = "merged"  # LoRA with --merge: the adapters folded into full weights, inside the artifact
GENERATION_CONFIG = "generation_config.json"
BYTES_README = ("This model was trained on UTF-8 bytes: ids 0-255 are the bytes of the text, 256 ends a "
                "document. It has no tokenizer files; encode text as list(text.encode('utf-8')).\n")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _is_peft(module: torch.nn.Module) -> bool:
    return hasattr(module, "peft_config")


def trained_module(engine) -> torch.nn.Module:
    """The module an engine trains (the HF model, its peft wrapper, or this rank's pruned pipeline model)."""
    return engine.engine.module if type(engine).__name__ == "DeepSpeedEngine" else engine.module


def merged_lora_weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A peft LoRA model's weights under the base model's HF names, each adapted weight W + (alpha/r)·B·A,
    computed aside on the CPU.

    Hand-written around peft's own pieces (`get_delta_weight`, `dequantize_bnb_weight`) rather than
    `merge_and_unload`: that folds the adapters into the training model in place (a stage end
    goes on training it, and unmerging again would not restore the weights bit for bit), and on
    a 4-bit base it re-quantises the merged weight, where the artifact wants it in 16 bits."""
    from peft.tuners.lora import LoraLayer  # peft: only LoRA models reach here
    from peft.utils.integrations import dequantize_bnb_weight

    base = module.get_base_model()
    adapted = {name: layer for name, layer in base.named_modules() if isinstance(layer, LoraLayer)}
    out = {}
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, attr = name.replace(".base_layer.", ".").rpartition(".")
        value = param.detach()
        if getattr(param, "quant_state", None) is not None:  # a bitsandbytes 4-bit base
            value = dequantize_bnb_weight(param, state=param.quant_state)
        layer = adapted.get(owner)
        if layer is not None and attr == "weight":
            delta = sum(layer.get_delta_weight(a).float() for a in layer.active_adapters)
            value = (value.float() + delta).to(value.dtype)
        out[f"{owner}.{attr}" if owner else attr] = value.cpu().clone()
    return out


def _plain_weights(engine) -> dict[str, torch.Tensor]:
    module = engine.module
    if _is_peft(module):
        return merged_lora_weights(module)
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def _deepspeed_weights(engine) -> dict[str, torch.Tensor]:
    """Full fine-tuning: DeepSpeed's own accessor for the fp32 master of every parameter. LoRA: the
    module gathered (a no-op below ZeRO-3) and its adapters merged; its frozen base has no master.
    Both gather under ZeRO-3, a collective, so every rank walks the parameters in the same order."""
    import deepspeed  # deferred: DeepSpeed loads only where it runs
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.engine.module
    if _is_peft(module):
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return merged_lora_weights(module)
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


def write_full_weights(engine, spec: ModelSpec, directory: Path,
                       weights: dict[str, torch.Tensor] | None = None) -> None:
    """Collective: gather the full weights (unless `weights`, what `full_weights` gave, are passed
    on every rank) and, on rank 0, write them with the model's config, in the master precision."""
    from transformers import AutoConfig  # deferred: only boundaries between layouts need it

    weights = full_weights(engine) if weights is None else weights
    if _rank() == 0:
        _write_hf_model(AutoConfig.for_model(**spec.hf_config), weights, None, directory, None, None)


# -- the run's artifacts ----------------------------------------------------------------------------


def adapter_weights(engine) -> dict[str, torch.Tensor]:
    """Collective under ZeRO-3: the LoRA adapters under peft's saved names (rank 0 gets them all)."""
    from peft import get_peft_model_state_dict  # peft: only LoRA models reach here

    module = trained_module(engine)
    gathered: contextlib.AbstractContextManager = contextlib.nullcontext()
    if type(engine).__name__ == "DeepSpeedEngine":
        import deepspeed  # deferred: DeepSpeed loads only where it runs

        gathered = deepspeed.zero.GatheredParameters([p for p in module.parameters() if p.requires_grad])
    with gathered:
        return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(module).items()}


def write_model(engine, directory: Path, dtype: torch.dtype, tokenizer: Path | None, source: str | None,
                merge: bool = False, chat_template: str | None = None,
                trusted: bool = False) -> dict[str, torch.Tensor] | None:
    """Collective: the artifact of the engine's model in `directory` (written aside, renamed into
    place by rank 0). Full training: an HF model folder in `dtype`; LoRA/QLoRA: the peft adapter
    folder, with `merge` also `merged/`. `tokenizer` is the folder (or tokenizer.json) training
    read, None for the byte-level fallback (a README says so); `source` the --weights folder, whose
    generation config is kept; `chat_template` the built-in template training rendered chats with
    (`advisor train --template`), saved with the tokenizer so that inference renders them alike. Returns the full weights when it gathered them (every rank; rank
    0's are whole), for the handoff of the same checkpoint to reuse. `trusted`: --trust-remote-code (the
    tokenizer is loaded again to be saved)."""
    module = trained_module(engine)
    peft = _is_peft(module)
    adapters = adapter_weights(engine) if peft else None
    weights = full_weights(engine) if merge or not peft else None
    if _rank() == 0:
        base = module.get_base_model() if peft else module
        with _written_aside(directory) as out:
            if peft:
                _write_adapters(module, adapters, out, source)
            if weights is not None:
                full = out / MERGED_DIR if peft else out
                _write_hf_model(base.config, weights, dtype, full, source, getattr(base, "generation_config", None))
                _write_tokenizer(tokenizer, full, chat_template, trusted)
            _write_tokenizer(tokenizer, out, chat_template, trusted)
    return weights


def _write_adapters(module: torch.nn.Module, adapters: dict[str, torch.Tensor], out: Path,
                    source: str | None) -> None:
    """What peft's `save_pretrained` writes, from the gathered adapters: its config (for inference,
    naming the base folder when there is one) and `adapter_model.safetensors`."""
    from safetensors.torch import save_file  # deferred: only artifacts need it

    config = copy.deepcopy(module.peft_config[module.active_adapter])
    config.inference_mode = True
    config.base_model_name_or_path = str(Path(source).resolve()) if source else None
    config.save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in adapters.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})


def _write_hf_model(config, weights: dict[str, torch.Tensor], dtype: torch.dtype | None, out: Path,
                    source: str | None, generation_config) -> None:
    """config.json, the safetensors (sharded above 5 GB, with their index, by huggingface_hub as
    `save_pretrained` does) and generation_config.json: the --weights folder's when it has one.
    `dtype` None keeps the weights' own (the handoff's master precision)."""
    from huggingface_hub import save_torch_state_dict  # transformers' own dependency

    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    config.use_cache = True  # off for training (trainer/model.py); generation wants it
    if dtype is not None:
        config.dtype = dtype
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # merged QLoRA weights are 16-bit
    tensors = {name: t if dtype is None else t.to(dtype) for name, t in weights.items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # one storage in the model: from_pretrained ties it again
    save_torch_state_dict(tensors, str(out))
    config.save_pretrained(str(out))
    save_model_code(config, out)  # a folder's own model (--trust-remote-code) keeps its code
    kept = Path(source) / GENERATION_CONFIG if source else None
    if kept is not None and kept.is_file():
        shutil.copy2(kept, out / GENERATION_CONFIG)
    elif generation_config is not None:
        generation_config.save_pretrained(str(out))


def _write_tokenizer(tokenizer: Path | None, out: Path, chat_template: str | None = None,
                     trusted: bool = False) -> None:
    """The tokenizer training read, as transformers saves it (with the chat template training used);
    the byte-level fallback has no files."""
    if tokenizer is None:
        (out / "README.md").write_text(BYTES_README)
        return
    loaded = load_tokenizer(tokenizer, trusted)
    if chat_template is not None:
        loaded.chat_template = chat_template
    loaded.save_pretrained(str(out))


@contextlib.contextmanager
def _written_aside(directory: Path) -> Iterator[Path]:
    """A fresh folder beside `directory`, renamed into its place when the block ends (an older one
    is renamed away first and deleted last): a reader never sees a half-written artifact."""
    tmp = directory.parent / f".tmp-{directory.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    old = directory.parent / f".old-{directory.name}"
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)


def copy_model(source: Path, directory: Path) -> None:
    """Rank 0: `source` (a stage's artifact) as `directory` too (RUN/model/), hard-linked where the
    filesystem allows, renamed into place."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    with _written_aside(directory) as out:
        shutil.rmtree(out)
        shutil.copytree(source, out, copy_function=link)
