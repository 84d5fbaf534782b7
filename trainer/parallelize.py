"""Apply a plan's parallel degrees to an HF decoder model with PyTorch's own pieces.

In torchtitan's order and spirit: one device mesh owns the degrees (``ParallelMesh``, built
from ``advisor.specs.Layout``), then small ``apply_*`` functions each do one thing: tensor
parallelism (DTensor ``parallelize_module``), then sharded data parallelism (FSDP2
``fully_shard``). The same module holds what every DTensor engine needs besides: a gradient
norm that spans tensor, data and pipeline groups, and torch.distributed.checkpoint (DCP) saving
and loading of model and optimizer state.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from advisor.errors import UsageError
from advisor.specs import Layout

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Megatron's split of a Llama-style decoder layer (Shoeybi et al. 2019, section 3): the first
# linear of each block is split by output columns, the second by input rows, so each block
# needs one all-reduce forward and one backward.
COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


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


def unsupported_reason(layout: Layout, config: Any) -> str | None:
    """Why the trainer cannot run `layout` on a model of this HF config (None: it can). Reads the
    config only, so `advisor run` can filter plans before building anything."""
    try:
        _check_config(layout, config)
    except UsageError as exc:
        return str(exc)
    return None


def check_parallel_layout(model: torch.nn.Module, layout: Layout) -> None:
    """One clear line for every combination the DTensor engines cannot run."""
    _check_config(layout, model.config, n_layers=len(decoder_layers(model)) if layout.pp > 1 else None,
                  dtensor_engine=True)
    if layout.tp > 1:
        first = next(iter(decoder_layers(model).children()))
        missing = [n for n in COLUMN_PARALLEL + ROW_PARALLEL if not _has(first, n)]
        if missing:
            raise UsageError(f"tensor parallelism needs Llama-style projections; this model's layers lack "
                             f"{', '.join(missing)}")


def _check_config(layout: Layout, config: Any, n_layers: int | None = None, dtensor_engine: bool = False) -> None:
    """`dtensor_engine`: the layout runs on the TP/FSDP2/pipeline engines (always when tp or pp > 1;
    plain, DDP and DeepSpeed run any HF model, offload and LoRA included)."""
    if not (dtensor_engine or layout.tp > 1 or layout.pp > 1):
        return
    if layout.method != "full" and (layout.tp > 1 or layout.pp > 1):
        raise UsageError(f"method={layout.method} with tp/pp is not supported (LoRA adapters are not split); "
                         "plan with tp=1, pp=1 for LoRA")
    if layout.sp:
        raise UsageError("sequence parallelism (sp=1) is not run by this trainer yet; plan with sp=0")
    if layout.vpp > 1:
        raise UsageError("interleaved pipelines (vpp>1) are not run by this trainer yet; plan with vpp=1")
    if layout.offload != "none":
        raise UsageError("offload runs through DeepSpeed, which this trainer does not combine with tp/pp or FSDP2")
    if layout.tp == 1 and layout.pp == 1:
        return  # FSDP2 alone shards any HF model
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    if layout.tp > 1:
        heads = get("num_attention_heads")
        for name, value in (("num_attention_heads", heads), ("num_key_value_heads", get("num_key_value_heads") or heads),
                            ("intermediate_size", get("intermediate_size"))):
            if value is None:
                raise UsageError(f"tensor parallelism needs a Llama-style config; this one has no {name}")
            if value % layout.tp:
                raise UsageError(f"tp={layout.tp} does not divide the model's {name} ({value})")
    if layout.pp > 1:
        n_layers = n_layers or int(get("num_hidden_layers") or 0)
        if layout.pp > n_layers:
            raise UsageError(f"pp={layout.pp} is more pipeline stages than the model's {n_layers} decoder layers")
        if layout.stage_layers and sum(layout.stage_layers) != n_layers:
            raise UsageError(f"stage_layers {layout.stage_layers} sum to {sum(layout.stage_layers)}, "
                             f"the model has {n_layers} decoder layers")
        if get("tie_word_embeddings", False):
            raise UsageError("pp>1 with tied input/output embeddings is not supported (the first and last "
                             "stages would share one weight)")


def _has(module: torch.nn.Module, name: str) -> bool:
    try:
        return isinstance(module.get_submodule(name), torch.nn.Linear)
    except AttributeError:
        return False


def apply_tensor_parallel(layers: torch.nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron column/row split of every decoder layer's attention and MLP projections.

    Embeddings, norms and the LM head stay replicated (plain tensors): their gradients are
    whole on every TP rank because a column-parallel linear all-reduces its input gradient.
    HF attention reshapes with ``view(..., -1, head_dim)``, so each rank runs its local share of
    heads without touching the config's head counts (the divisibility check sits in
    ``check_parallel_layout``).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {name: ColwiseParallel() for name in COLUMN_PARALLEL}
    plan.update({name: RowwiseParallel() for name in ROW_PARALLEL})
    for layer in layers.children():
        parallelize_module(layer, tp_mesh, plan)


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


# DTensor warns that a (dp, tp)-sharded sum is made whole by one all-reduce per mesh dimension.
# For the norm that is harmless: every rank of a collective receives the same result, so all
# ranks end with the same norm and clip coefficient.
logging.getLogger("torch.distributed.tensor._redistribute").addFilter(
    lambda record: "sequential all_reduce" not in record.getMessage())


def grad_norm_squared(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient entries over this rank's parameters, each counted once.

    DTensor gradients (TP shards, FSDP shards) are summed per (mesh, placements) group and made
    whole with one collective per group; plain gradients are replicas and count as they are.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    parts = []
    for key, grads in groups.items():
        part = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        parts.append(part.full_tensor() if key is not None else part)
    if not parts:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        return torch.zeros((), device=device)
    return torch.stack(parts).sum()


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float,
                   pp_group: dist.ProcessGroup | None = None) -> float:
    """Global gradient norm (all stages, all shards), and clip to ``max_norm`` when it is > 0.

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` (coefficient max_norm/(norm+1e-6),
    capped at 1), which cannot mix plain tensors with DTensors or sum over pipeline stages.
    """
    squared = grad_norm_squared(params)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squared, group=pp_group)  # each stage holds different parameters
    norm = squared.sqrt()
    if max_norm > 0:
        coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return float(norm)


def _flat_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def save_distributed(module: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """DCP checkpoint of model and optimizer: every rank writes its own shards, once each.

    The optimizer is left out before its first step: asking DCP for the state of an empty
    optimizer would initialise it with a zero-gradient step and advance Adam's step count. Its
    state is flattened to one key per parameter (hyper-parameters included): pipeline stages hold
    different parameter groups, which one shared `param_groups` entry could not describe.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    if optimizer.state:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer, options=_flat_options())
    dcp.save(state, checkpoint_id=str(directory / "dcp"))


def load_distributed(module: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load what ``save_distributed`` wrote, in place (DCP reshards if the layout changed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = str(directory / "dcp")
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    has_optimizer = any(key.startswith("optimizer.") for key in saved)
    if has_optimizer:
        state["optimizer"] = get_optimizer_state_dict(module, optimizer, options=_flat_options())
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["model"])
    if has_optimizer:
        set_optimizer_state_dict(module, optimizer, state["optimizer"], options=_flat_options())
    else:  # a checkpoint taken before the first step: a fresh optimizer
        optimizer.state.clear()
