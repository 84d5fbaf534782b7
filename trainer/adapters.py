"""Adapters on a frozen base: LoRA over the model's own weights, and QLoRA over a 4-bit NF4 base.

QLoRA is the standard recipe (Dettmers et al. 2023, as transformers, peft and bitsandbytes ship
it): every decoder linear stored as bitsandbytes NF4 with double quantisation and bf16 compute,
then peft's `prepare_model_for_kbit_training`, then LoRA of rank `lora_rank` on all linears. The
planner prices exactly this layout (planner/memory.py `model_state_bytes`): NF4 weights with their
quantisation constants, every other frozen tensor in fp32 (the up-cast of
`prepare_model_for_kbit_training`), fp32 adapters.
"""

from __future__ import annotations

from functools import partial

import torch

from specs.errors import UsageError
from specs.core import Layout
from specs.task import AdapterSpec
from profiler.hardware_bench import TORCH_DTYPES
from trainer.engines.base import device

# bitsandbytes' quantisation settings of the QLoRA recipe; the compute dtype is the layout's.
NF4_SETTINGS = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}


def apply_lora(model: torch.nn.Module, layout: Layout, adapter: AdapterSpec | None = None) -> torch.nn.Module:
    """LoRA adapters of rank `lora_rank`, no dropout, on `adapter`'s targets with its alpha (default:
    every linear layer, alpha 2r); the base stays frozen, in 4-bit NF4 when the method is QLoRA."""
    from peft import LoraConfig, get_peft_model  # heavy optional dependency, only for LoRA plans

    adapter = adapter or AdapterSpec()
    if layout.method == "qlora":
        model = quantize_base(model, layout)
    alpha = adapter.alpha if adapter.alpha is not None else 2 * layout.lora_rank
    targets = adapter.targets or "all-linear"
    try:
        adapted = get_peft_model(model, LoraConfig(r=layout.lora_rank, lora_alpha=alpha, lora_dropout=0.0,
                                                   target_modules=targets, task_type="CAUSAL_LM"))
    except ValueError as exc:  # peft's word for targets the model lacks
        raise UsageError(f"LoRA targets {','.join(adapter.targets or [])}: {str(exc).splitlines()[0]}") from None
    AdapterGradientGuard(adapted)
    return adapted


def quantize_base(model: torch.nn.Module, layout: Layout) -> torch.nn.Module:
    """The model's linear layers as bitsandbytes NF4 (`Linear4bit`), quantised on this rank's
    device, prepared for k-bit training by peft.

    transformers quantises only while `from_pretrained` reads a checkpoint; a model built from its
    config has none, and writing one to disk to read it back would cost a 16-bit copy of the model
    on disk. So we run the two steps of its bitsandbytes quantizer ourselves: `replace_with_bnb_linear`
    (its module swap, skipping the modules it keeps in 16 bits: the LM head and tied weights), then
    each weight handed to a `Params4bit` that quantises when moved to the device, as its
    `Bnb4bitQuantize` does for every weight it loads.
    """
    try:
        import bitsandbytes as bnb  # optional: only QLoRA plans need it
    except ImportError:
        raise UsageError('QLoRA needs bitsandbytes: pip install -e ".[qlora]"') from None
    from peft import prepare_model_for_kbit_training  # heavy optional dependency, only for LoRA plans
    from transformers import BitsAndBytesConfig
    from transformers.integrations import replace_with_bnb_linear
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert

    config = BitsAndBytesConfig(**NF4_SETTINGS, bnb_4bit_compute_dtype=TORCH_DTYPES[layout.dtype])
    # the modules replace_with_bnb_linear swaps; GPT-2's Conv1D stores its weight as (in, out),
    # the Linear4bit that replaces it wants (out, in)
    originals = {name: module for name, module in model.named_modules()
                 if type(module) is torch.nn.Linear or isinstance(module, Conv1D)}
    replace_with_bnb_linear(model, modules_to_not_convert=get_keys_to_not_convert(model), quantization_config=config)
    target = device()
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            original = originals.pop(name)
            weight = original.weight.detach()
            module.weight = bnb.nn.Params4bit(weight.T if isinstance(original, Conv1D) else weight,
                                              requires_grad=False, **module.weight.__dict__).to(target)
            if original.bias is not None:  # created on the meta device by the swap; stays 16-bit
                module.bias = torch.nn.Parameter(original.bias.detach(), requires_grad=False)
            # On a CPU with AVX512-BF16, a forward in eval mode without grad (evaluation) would
            # repack the weight once and for all into an inference-only layout whose matmul has no
            # backward: training afterwards silently stops reaching the adapters (trap 4 of the
            # CPU-stack notes). Training needs the autograd path, so that repack stays off.
            module.support_avx512bf16_for_cpu = False
            module.register_load_state_dict_pre_hook(load_quantized_weight)
    model.is_loaded_in_4bit = True  # what transformers' quantizer marks; peft reads it to pick 4-bit LoRA layers
    # The plan's recomputation is already applied (trainer.model.apply_recomputation); peft's
    # default would checkpoint every layer instead, so it stays off here.
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def load_quantized_weight(module: torch.nn.Module, state_dict: dict, prefix: str, *_args) -> None:
    """Restore a `Linear4bit`'s NF4 weight and quant state from what its `state_dict` wrote (the
    engines' checkpoints, for `--resume`). bitsandbytes saves the quant state beside the weight but
    leaves reading it back to transformers' checkpoint loader; `Params4bit.from_prequantized` is
    its own way to rebuild one, so this hook hands it those entries before torch copies the rest."""
    import bitsandbytes as bnb  # only QLoRA models register this hook

    key = prefix + "weight"
    stats = {name[len(key) + 1:]: state_dict.pop(name) for name in list(state_dict) if name.startswith(key + ".")}
    if stats:
        # the packed data stays in the state dict: torch then copies it into the rebuilt weight
        module.weight = bnb.nn.Params4bit.from_prequantized(state_dict[key], stats, device=module.weight.device,
                                                            module=module)


class AdapterGradientGuard:
    """Refuses, at the second training forward, a model whose first backward reached none or only
    some of its adapters: the way 4-bit peft training silently trains nothing (trap 4 of the
    CPU-stack notes). It then removes its hooks, costing nothing after the first step.

    It watches gradient accumulation (a hook after each adapter's `.grad` is written) rather than
    reading `.grad`, which the optimizer step has already cleared when the next forward starts."""

    def __init__(self, model: torch.nn.Module):
        self.adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.reached: set[str] = set()
        self.training_forwards = 0
        self.handles = [p.register_post_accumulate_grad_hook(partial(self._reached, name))
                        for name, p in self.adapters.items()]
        self.handles.append(model.register_forward_pre_hook(self._check))

    def _reached(self, name: str, _param: torch.Tensor) -> None:
        self.reached.add(name)

    def _check(self, module: torch.nn.Module, _args: tuple) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation does not count
        self.training_forwards += 1
        if self.training_forwards < 2:
            return
        for handle in self.handles:
            handle.remove()
        missing = sorted(set(self.adapters) - self.reached)
        if missing:
            raise UsageError(f"the first backward left {len(missing)} of {len(self.adapters)} adapter weights "
                             f"without a gradient (e.g. {missing[0]}): training would change nothing")
