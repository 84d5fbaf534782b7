"""Which layouts can exist for a model: the structural rules, checked in one place.

`Layout`'s own validator (specs/core.py) refuses combinations that make no sense for any model
(sp without tp, vpp without pp, offload without ZeRO...). The rules here need the model's shape:
tensor parallelism splits attention heads, key/value heads and the MLP width, a pipeline needs a
decoder layer per stage (per chunk when interleaved). The planner's search skips what breaks
them and the cost model refuses it with the same line. What one back-end cannot run yet (a
capability, not a structure) is the trainer's to say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specs.core import Layout

# Where HF configs of the families keep each size (Llama-style names first, then GPT-2's, T5's):
# read through `config_value` by the planner's trace and by the trainer's checks alike.
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim"),
}


def config_value(hf_config: Any, size: str, default: Any = None) -> Any:
    """The first of `CONFIG_KEYS[size]` set (not None) in an HF config, a dict or a PretrainedConfig."""
    for key in CONFIG_KEYS[size]:
        value = hf_config.get(key) if isinstance(hf_config, dict) else getattr(hf_config, key, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class ModelShape:
    """The sizes the layout rules read (from the model trace)."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    num_layers: int
    tied_embeddings: bool = False


def tensor_parallel_problem(tp: int, shape: ModelShape) -> str | None:
    """Why `tp` cannot split this model's layers (None: it can). Key/value heads may also be fewer
    than tp, as long as tp is a multiple of them (each head is then replicated)."""
    if shape.num_heads % tp:
        return f"tp={tp} does not divide the {shape.num_heads} attention heads"
    kv = shape.num_kv_heads
    if kv % tp and tp % kv:
        return f"tp={tp} and the {kv} key/value heads do not divide one another"
    if tp > 1 and shape.intermediate_size % tp:
        return f"tp={tp} does not divide the MLP width {shape.intermediate_size}"
    return None


def pipeline_problem(pp: int, vpp: int, gas: int, stage_layers: list[int] | None, num_layers: int) -> str | None:
    """Why this pipeline cannot cut a model of `num_layers` decoder layers (None: it can).

    Interleaving (vpp > 1) runs torch's `ScheduleInterleaved1F1B`: each device holds vpp chunks of
    at least one layer each, split as `specs.core.chunk_layers` says (uneven splits
    allowed). The schedule runs gas // pp rounds and needs gas divisible by them; we ask for gas
    divisible by pp, so that every round is pp micro-batches: the schedule whose warm-up and
    bubble the cost model prices (Narayanan et al. 2021, section 2.2). Without interleaving any
    gas runs (GPipe below pp micro-batches, 1F1B from there)."""
    if pp > num_layers:
        return f"pp={pp} exceeds the {num_layers} decoder layers"
    if vpp > 1 and pp * vpp > num_layers:
        return f"interleaving needs a decoder layer per chunk: pp*vpp = {pp * vpp} exceeds the {num_layers} layers"
    if vpp > 1 and gas % pp:
        return f"interleaved 1F1B needs gas divisible by pp (gas={gas}, pp={pp})"
    if stage_layers and min(stage_layers) < vpp:
        return f"stage_layers: each device needs at least vpp={vpp} layers (one per chunk)"
    if stage_layers and sum(stage_layers) != num_layers:
        return f"stage_layers sum to {sum(stage_layers)}, the model has {num_layers} layers"
    return None


def layout_problem(layout: Layout, shape: ModelShape) -> str | None:
    """The first structural rule `layout` breaks on this model, or None."""
    return (tensor_parallel_problem(layout.tp, shape)
            or pipeline_problem(layout.pp, layout.vpp, layout.gas, layout.stage_layers, shape.num_layers))


def tp_crosses_nodes(tp: int, devices_per_node: int) -> bool:
    """A tensor-parallel group stays inside one node only if it tiles the node."""
    return tp > devices_per_node or devices_per_node % tp != 0
