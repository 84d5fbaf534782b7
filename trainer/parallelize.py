"""Apply a plan's parallel degrees to an HF decoder model with PyTorch's own pieces.

In torchtitan's order and spirit: one device mesh owns the degrees (``ParallelMesh``, built
from ``specs.core.Layout``), then small ``apply_*`` functions each do one thing, applied in a
fixed order by ``parallelize``: tensor parallelism (DTensor ``parallelize_module``), then
sharded data parallelism (FSDP2 ``fully_shard``, gathering 16-bit weights from fp32 shards);
without it the weights stay fp32 and the engine computes under autocast (``trainer.engines.base``).
With ``sp``, sequence parallelism runs inside the tensor-parallel step (``apply_tensor_parallel``,
``apply_sequence_parallel_ends``). Activation checkpointing is applied when the model is built
(``trainer.recompute``), since every engine, DeepSpeed's included, needs it. What these engines run is declared in
``specs.capabilities``; ``check_parallel_layout`` adds what only the built model shows.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from specs.capabilities import COLUMN_PARALLEL, ROW_PARALLEL, SEQUENCE_PARALLEL_NORMS
from specs.errors import UsageError
from specs.core import Layout
from profiler.hardware_bench import TORCH_DTYPES


@dataclass
class ParallelMesh:
    """The (pp, dp, tp) device mesh of a layout and this rank's place in it.

    Tensor parallelism is the innermost dimension (the fastest links), the pipeline the
    outermost, as in Megatron-LM and torchtitan.
    """

    mesh: DeviceMesh
    pp: int
    dp: int
    tp: int

    @classmethod
    def build(cls, layout: Layout) -> "ParallelMesh":
        world = dist.get_world_size()
        if world != layout.pp * layout.dp * layout.tp:
            raise UsageError(f"the layout needs pp*dp*tp = {layout.devices} processes, this launch has {world}")
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
        return cls(mesh, layout.pp, layout.dp, layout.tp)

    def coordinate(self, dim: str) -> int:
        return self.mesh[dim].get_local_rank()

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.mesh[dim].get_group()


def decoder_layers(model: torch.nn.Module) -> torch.nn.Module:
    """The container of decoder layers of an HF causal LM (``model.model.layers``)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(model, "lm_head"):
        raise UsageError(f"tensor and pipeline parallelism support HF decoder models laid out as "
                         f"model.layers + lm_head (Llama, Mistral, Qwen2...); {type(model).__name__} is not")
    return layers


def check_parallel_layout(model: torch.nn.Module, layout: Layout) -> None:
    """What the declaration (specs/capabilities.py, checked in `make_engine`) cannot see from a
    config: the Llama-style module layout that tensor and pipeline parallelism cut."""
    decoder_layers(model)
    if layout.tp > 1:
        first = next(iter(decoder_layers(model).children()))
        missing = [n for n in COLUMN_PARALLEL + ROW_PARALLEL if not _has(first, n)]
        if missing:
            raise UsageError(f"tensor parallelism needs Llama-style projections; this model's layers lack "
                             f"{', '.join(missing)}")
        norms = [n for n in SEQUENCE_PARALLEL_NORMS if not hasattr(first, n)] if layout.sp else []
        if norms:
            raise UsageError(f"sequence parallelism needs Llama-style norms; this model's layers lack "
                             f"{', '.join(norms)}")


def _has(module: torch.nn.Module, name: str) -> bool:
    try:
        return isinstance(module.get_submodule(name), torch.nn.Linear)
    except AttributeError:
        return False


def apply_tensor_parallel(layers: torch.nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Megatron column/row split of every decoder layer's attention and MLP projections.

    Embeddings, norms and the LM head stay replicated (plain tensors): their gradients are
    whole on every TP rank because a column-parallel linear all-reduces its input gradient.
    HF attention reshapes with ``view(..., -1, head_dim)``, so each rank runs its local share of
    heads without touching the config's head counts (the divisibility check sits in
    ``check_parallel_layout``).

    With sequence parallelism (Korthikanti et al. 2022) the residual stream between the blocks
    is a DTensor sharded along the sequence: the norms run on each rank's tokens
    (``SequenceParallel``, replicated weights), each block's input is all-gathered once
    (``PrepareModuleInput`` to Replicate, so q/k/v and rotary see whole sequences) and the
    row-parallel output is reduce-scattered back to the sequence shards instead of all-reduced.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    plan: dict[str, Any] = {name: ColwiseParallel() for name in COLUMN_PARALLEL}
    if sequence_parallel:
        plan.update({name: RowwiseParallel(output_layouts=Shard(1), use_local_output=False) for name in ROW_PARALLEL})
        plan.update({name: SequenceParallel() for name in SEQUENCE_PARALLEL_NORMS})
        plan["self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                               desired_input_kwarg_layouts={"hidden_states": Replicate()})
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    else:
        plan.update({name: RowwiseParallel() for name in ROW_PARALLEL})
    for layer in layers.children():
        parallelize_module(layer, tp_mesh, plan)


def apply_sequence_parallel_ends(module: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Where the sequence-sharded residual stream begins and ends, on the parts of `module` (a
    whole model or a pipeline stage) that it holds: the embedding's (replicated) output is cut
    into sequence shards, a DTensor whose global shape keeps HF's positions and causal mask whole;
    the final norm runs on the shards; the LM head, replicated as without sp, takes the
    all-gathered sequence, so logits and loss are those of the unsplit model. A pipeline stage
    without the embedding cuts its whole received input at its first layer, and one without the
    head gathers its last layer's output, so that stages exchange plain whole tensors."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (PrepareModuleInput, PrepareModuleOutput, SequenceParallel,
                                                   parallelize_module)

    base = module.model
    layers = list(base.layers.children())
    if getattr(base, "embed_tokens", None) is not None:
        parallelize_module(base.embed_tokens, tp_mesh, PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False))
    else:
        parallelize_module(layers[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)))
    if getattr(module, "lm_head", None) is None:
        parallelize_module(layers[-1], tp_mesh, PrepareModuleOutput(
            output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True))
    if getattr(base, "norm", None) is not None:
        parallelize_module(base.norm, tp_mesh, SequenceParallel())
    if getattr(module, "lm_head", None) is not None:
        parallelize_module(module.lm_head, tp_mesh, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))


def reduce_partial_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum the gradients DTensor leaves partial: the sequence-parallel norms' weights are
    replicated, but each rank's gradient covers its own tokens only (``Partial``). One all-reduce
    each, before clipping, so that the norm and AdamW read whole gradients and every rank takes
    the same step."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
            param.grad = grad.redistribute(placements=[Replicate() if isinstance(p, Partial) else p
                                                       for p in grad.placements])


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one: HF's unsplittable blocks (decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names and hasattr(model, "get_base_model"):  # peft
        names = set(getattr(model.get_base_model(), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def apply_fsdp(module: torch.nn.Module, units: Iterable[torch.nn.Module], dp_mesh: DeviceMesh,
               reshard_after_forward: bool, param_dtype: torch.dtype | None) -> None:
    """FSDP2: one shard group per decoder layer (so only one layer is gathered at a time), then
    the root for embeddings, final norm and LM head."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP2 itself calls the c10d name that c10d deprecates, once per layer and step
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*deprecated", category=FutureWarning)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(module, **kwargs)


def compute_dtype(module: torch.nn.Module, layout: Layout) -> torch.dtype | None:
    """The dtype FSDP2 gathers the fp32 shards in (its MixedPrecisionPolicy's param_dtype, gradients
    reduced in fp32: bf16-mixed); None when the weights already are in the layout's dtype."""
    wanted = TORCH_DTYPES[layout.dtype]
    current = next(module.parameters()).dtype
    return wanted if current != wanted else None


def parallelize(module: torch.nn.Module, mesh: ParallelMesh, layout: Layout, layers: Callable[[], torch.nn.Module],
                fsdp_units: Callable[[], list[torch.nn.Module]], reshard_after_forward: bool) -> None:
    """The layout's degrees on `module` (a whole model or one pipeline stage), in torchtitan's
    order: tensor parallelism inside the decoder `layers()`, then FSDP2 over the data-parallel
    sub-mesh with one shard group per unit of `fsdp_units()` (computing in the layout's dtype over
    fp32 shards). Both are asked for only when needed: FSDP2 alone shards models that have no
    Llama-style layer container."""
    if layout.tp > 1:
        apply_tensor_parallel(layers(), mesh.mesh["tp"], sequence_parallel=bool(layout.sp))
        if layout.sp:
            apply_sequence_parallel_ends(module, mesh.mesh["tp"])
    if layout.dp > 1:
        apply_fsdp(module, fsdp_units(), mesh.mesh["dp"], reshard_after_forward=reshard_after_forward,
                   param_dtype=compute_dtype(module, layout))
    # without FSDP2 the weights stay fp32 and the engine computes under autocast (specs.capabilities
    # `precision`): a cast of the module itself would leave AdamW bf16 weights and moments
