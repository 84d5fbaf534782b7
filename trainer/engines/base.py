"""The contract every engine keeps with the training loop, and what the engines share.

An engine owns a model and its optimizer under one parallel layout (``specs.core.Layout``,
the single source of truth for degrees, as ``ParallelDims`` is in torchtitan). The loop only
ever calls the five operations of ``Engine``, whichever back-end runs: plain torch or DDP,
DeepSpeed ZeRO, the DTensor sharded engine (TP, FSDP2) or the pipeline.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

import torch

from specs.capabilities import EngineName, chunked_loss, precision
from specs.core import Layout
from profiler.ranks import local_device
from trainer.batch import MicroBatch, as_micro_batch
from profiler.hardware_bench import TORCH_DTYPES
from trainer.chunked_loss import causal_lm, install_chunked_loss
from trainer.checkpoint import load_distributed, load_full_state, plain_state, save_distributed, universal_state


@runtime_checkable
class Engine(Protocol):
    """One model and its optimizer under one layout.

    ``model`` is what evaluation calls as ``model(input_ids=..., labels=..., position_ids=...).loss``; ``data_rank``
    says which data-parallel shard of the batch this rank reads (tensor and pipeline ranks of
    one replica read the same sequences).
    """

    model: torch.nn.Module
    data_rank: int

    def micro_step(self, batch: MicroBatch) -> float | None:
        """Forward and backward of one micro-batch (ids, labels and the position ids of packed rows;
        bare token ids are read as every token trained); its mean loss over the trained tokens, or
        None when the engine defers the work (a pipeline runs all of a step's micro-batches on the
        gas-th call)."""
        ...

    def optimizer_step(self, lr: float) -> float:
        """Clip, step and clear the gradients at learning rate `lr`; the global gradient norm."""
        ...

    def save(self, directory: Path) -> None:
        """Write this rank's part of the full state (model and optimizer) into `directory`."""
        ...

    def load(self, directory: Path) -> None:
        """Read back, in place, what `save` wrote."""
        ...

    def state_bytes(self) -> dict[str, int]:
        """Bytes of ``parameters``, ``gradients`` and ``optimizer`` state THIS rank holds now
        (local shards only), the quantities of the ZeRO paper's Table 1."""
        ...


class DTensorState:
    """Saving, loading and counting the state of a DTensor engine (sharded or pipeline): its
    ``module`` (the model, or this rank's pipeline stage) and its ``optimizer``, in one DCP folder."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def save(self, directory: Path) -> None:
        save_distributed(self.module, self.optimizer, directory)

    def load(self, directory: Path) -> None:
        """Its DCP folder, resharded by DCP for this layout; after a re-plan for another device count,
        the plain engine's `engine.pt` or DeepSpeed's checkpoint (whole tensors by name), sharded."""
        if (directory / "dcp").is_dir():
            load_distributed(self.module, self.optimizer, directory)
        elif (directory / "engine.pt").is_file():
            load_full_state(self.module, self.optimizer, *plain_state(directory / "engine.pt"))
        else:  # DeepSpeed wrote it
            load_full_state(self.module, self.optimizer, *universal_state(directory, self.module))

    def state_bytes(self) -> dict[str, int]:
        parameters = list(self.module.parameters())
        gradients = [p.grad for p in parameters] + fsdp_unsharded_gradients(self.module)
        return state_bytes(parameters, self.optimizer, gradients)


def fsdp_unsharded_gradients(module: torch.nn.Module) -> list[torch.Tensor | None]:
    """Gradients FSDP2 holds unsharded while micro-batches accumulate without a reduce-scatter
    (``set_requires_gradient_sync(False)``, ZeRO-1): on its unsharded parameters, or beside them in
    the reduce dtype. They are not the ``.grad`` of the sharded parameters, and FSDP2 has no public
    accessor for them, hence its private per-module state."""
    from torch.distributed.fsdp import FSDPModule  # loaded when first needed, as DTensor is

    held: list[torch.Tensor | None] = []
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    unsharded = getattr(param, "_unsharded_param", None)
                    held += [getattr(unsharded, "grad", None), param.unsharded_accumulated_grad]
    return held


def device() -> torch.device:
    """This rank's device: the GPU its launcher assigned (LOCAL_RANK), else the CPU; the one
    `profiler.ranks.init_device_and_group` set up (`local_device`).

    LOCAL_RANK rather than ``torch.cuda.current_device()``: the current device is GPU 0 on every
    rank that has not called ``set_device``, while the launcher's assignment holds either way.
    """
    return local_device()


def use_declared_loss(model: torch.nn.Module, layout: Layout, engine: EngineName) -> None:
    """Give `model` the loss the declaration names for `engine` and `layout` (specs.capabilities
    `chunked_loss`), the one the cost model prices: the chunked cross-entropy where it runs, else
    HF's loss over the whole logits."""
    if chunked_loss(layout, engine, model.config.model_type, int(model.config.hidden_size)):
        install_chunked_loss(model)


def compute_context(layout: Layout, engine: EngineName) -> contextlib.AbstractContextManager[Any]:
    """Where the declaration says `engine` autocasts `layout` (specs.capabilities `precision`:
    bf16-mixed without FSDP2 or DeepSpeed), ``torch.autocast`` in the layout's 16-bit dtype over the
    fp32 weights; elsewhere nothing (fp32, or an engine that casts the weights itself)."""
    if precision(layout, engine).autocast:
        return torch.autocast(device().type, dtype=TORCH_DTYPES[layout.dtype])
    return contextlib.nullcontext()


def autocast_forward(model: torch.nn.Module, layout: Layout, engine: EngineName) -> None:
    """Run `model`'s forward, and so the loss it computes from labels, under `compute_context`, as
    accelerate wraps a model's forward: whatever calls it (DDP, evaluation, the timed steps) computes
    as `advisor train` does, and backward runs outside autocast, as torch recommends."""
    if not precision(layout, engine).autocast:
        return
    lm = causal_lm(model)
    own_forward = lm.forward

    @functools.wraps(own_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with compute_context(layout, engine):
            return own_forward(*args, **kwargs)

    lm.forward = forward


def forward_backward(model: torch.nn.Module, batch: MicroBatch | torch.Tensor, gas: int) -> float:
    """One micro-batch's forward and backward (the loss scaled for accumulation); its loss: the mean
    over its trained tokens, or with `num_items` its share of the step's token mean. Bare token ids
    train every token."""
    loss = model(**as_micro_batch(batch).model_inputs()).loss
    (loss / gas).backward()
    return float(loss.detach())


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of these tensors on this rank: a DTensor counts its local shard; a tensor listed
    twice counts once."""
    from torch.distributed.tensor import DTensor  # ~0.5 s to import: loaded when first needed

    unique = {id(t): t for t in tensors if t is not None}
    local = [t.to_local() if isinstance(t, DTensor) else t for t in unique.values()]
    return sum(t.numel() * t.element_size() for t in local)


def _storage(tensor: torch.Tensor) -> int:
    """Where a tensor's (local) data lives: views of one buffer share it."""
    from torch.distributed.tensor import DTensor  # ~0.5 s to import: loaded when first needed

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def quantization_constants(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a quantised parameter keeps beside its packed data: a bitsandbytes 4-bit
    weight's quant state (block absmax, code books, and the nested state of double quantisation)."""
    out: list[torch.Tensor] = []
    states = [getattr(p, "quant_state", None) for p in parameters]
    while states:
        state = states.pop()
        if state is not None:
            out.extend(t for t in vars(state).values() if torch.is_tensor(t))
            states.append(getattr(state, "state2", None))
    return out


def state_bytes(parameters: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer,
                gradients: Iterable[torch.Tensor] | None = None) -> dict[str, int]:
    """Parameters, gradients and optimizer state held through torch tensors: the parameters,
    the gradients (their ``.grad`` unless the engine keeps them elsewhere), and every tensor of
    the optimizer's per-parameter state (Adam's moments and step), plus the optimizer's own
    parameters when they are copies (DeepSpeed's fp32 master partitions of 16-bit or ZeRO-1/2
    weights) rather than views of the model's own storage. Quantised parameters count their
    quantisation constants too."""
    parameters = list(parameters)
    own = {_storage(p) for p in parameters}
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    masters = [p for p in stepped if _storage(p) not in own]
    moments = [t for per_param in optimizer.state.values() for t in per_param.values() if torch.is_tensor(t)]
    if gradients is None:
        gradients = [p.grad for p in parameters + masters]
    return {
        "parameters": local_bytes(parameters + quantization_constants(parameters)),
        "gradients": local_bytes(gradients),
        "optimizer": local_bytes(masters + moments),
    }
