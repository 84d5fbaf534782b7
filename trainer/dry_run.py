"""`advisor train PLAN --dry-run`: every stage's layout checked against this trainer on the meta
device (no devices, no data), and what each rank would hold.

The checks are the trainer's own: the capability declaration (`specs.capabilities`, as
`make_engine` calls it), the built model's module layout (`check_parallel_layout`, as the TP and
pipeline engines call it) and the pipeline cut (`layers_per_stage`). The model is built on the
meta device, so a 405B model costs seconds and no memory.

The elements per rank are counted here from the meta model's parameter shapes: what tensor
parallelism splits (the Megatron projections; embeddings, norms and the LM head stay whole) and
what a pipeline stage holds. How each engine keeps them (dtypes, fp32 masters, ZeRO or FSDP2
sharding across dp, offload) is `planner.memory.model_state_bytes`, the one function the cost
model prices with too. The cost model's own terms, from the model trace
(`planner.cost_model.stage_memory`), are reported next to them: where the two differ, the trace's
split of the model differs from its real modules.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch

from specs.capabilities import COLUMN_PARALLEL, ROW_PARALLEL, check_runnable, config_shape, engine_for
from specs.engine_traits import traits
from specs.errors import UsageError
from specs.plan_file import Plan
from specs.core import Layout, ModelSpec, layers_per_stage
from planner.cost_model import default_split, stage_memory
from planner.memory import model_state_bytes
from profiler.attention_support import SDPA, runnable_attention
from profiler.model_trace import trace_model
from trainer.adapters import apply_lora
from trainer.parallelize import check_parallel_layout

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@dataclass
class RankStates:
    """What one rank of a pipeline stage holds, in bytes, beside the cost model's terms."""

    pipeline_stage: int
    decoder_layers: int
    parameters: int
    gradients: int
    optimizer: int
    host: int  # offloaded to host memory (DeepSpeed ZeRO-Offload)
    predicted: dict[str, int] = field(default_factory=dict)  # weights, gradients, optimizer, host


@dataclass
class LayoutCheck:
    """One stage's layout: the engine that runs it and what each of its ranks holds."""

    stage: str | None  # None: a plan without stages
    layout: Layout
    engine: str
    devices: int
    ranks: list[RankStates]

    def as_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "layout": self.layout.short(), "engine": self.engine, "devices": self.devices,
                "ranks": [asdict(r) for r in self.ranks]}


def where(stage: str | None) -> str:
    return f"stage {stage}" if stage is not None else "the run"


def meta_model(spec: ModelSpec, layout: Layout) -> torch.nn.Module:
    """The HF model with the layout's method applied, on the meta device: shapes, no storage."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: loaded only when a model is built

    config = AutoConfig.for_model(**spec.hf_config)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=runnable_attention(config, SDPA))
        if layout.method in ("lora", "qlora"):
            # the adapters' structure is the same for QLoRA; its 4-bit base is counted below
            model = apply_lora(model, layout.model_copy(update={"method": "lora"}))
    return model


def dry_run(plan: Plan) -> list[LayoutCheck]:
    """Check every layout the plan runs; raise UsageError naming the first stage that cannot run."""
    device_type = plan.hardware.device_type
    shape = config_shape(plan.model.hf_config)
    models: dict[tuple[str, int], torch.nn.Module] = {}
    checks = []
    for name, layout in plan.stage_layouts():
        try:
            check_runnable(layout, shape, device_type, plan.engine)
            key = (layout.method, layout.lora_rank)
            if key not in models:
                models[key] = meta_model(plan.model, layout)
            model = models[key]
            engine = engine_for(layout, plan.engine)
            if traits(engine).dtensor:
                check_parallel_layout(model, layout)
            split = layers_per_stage(shape.num_layers, layout)
        except UsageError as exc:
            raise UsageError(f"{where(name)} ({layout.short()}): {exc}") from None
        ranks = _rank_states(model, layout, engine, split)
        _add_predictions(ranks, plan, layout)
        checks.append(LayoutCheck(name, layout, engine, layout.devices, ranks))
    return checks


def _stage_of(name: str, split: list[int]) -> int:
    """The pipeline stage of a parameter: its decoder layer's, the first for the embedding, the
    last for the final norm and LM head."""
    match = _LAYER.search(name)
    if match:
        layer, bound = int(match.group(1)), 0
        for stage, held in enumerate(split):
            bound += held
            if layer < bound:
                return stage
    if "embed_tokens" in name:
        return 0
    return len(split) - 1


def _tp_share(name: str, shape: torch.Size, tp: int) -> tuple[int, list[int]]:
    """Elements rank 0 holds of a parameter under tensor parallelism: DTensor's even sharding
    (torch.chunk: the first ranks take the ceiling) of the Megatron projections, column-parallel
    weights and biases by rows, row-parallel weights by columns (their bias stays whole)."""
    dims = list(shape)
    module = name.rsplit(".", 1)[0]
    column = any(module.endswith(p) for p in COLUMN_PARALLEL)
    row = any(module.endswith(p) for p in ROW_PARALLEL) and name.endswith("weight")
    if tp > 1 and (column or row):
        axis = 0 if column else 1
        dims[axis] = math.ceil(dims[axis] / tp)
    return math.prod(dims), dims


def _rank_states(model: torch.nn.Module, layout: Layout, engine: str, split: list[int]) -> list[RankStates]:
    """Bytes on rank 0 of each pipeline stage (the most loaded rank of its data-parallel group): its
    elements counted from the meta model's real shapes (tensor-parallel shares, the stage's layers),
    then kept as its engine keeps them (`planner.memory.model_state_bytes`, the cost model's one
    function for it: dtypes, masters, ZeRO or FSDP2 sharding across dp, offload)."""
    counts = [[0.0, 0.0, 0.0, 0] for _ in split]  # per stage: trainable, frozen, frozen 4-bit, 4-bit tensors
    for name, param in model.named_parameters():
        stage = _stage_of(name, split)
        numel, _ = _tp_share(name, param.shape, layout.tp)
        if param.requires_grad:
            counts[stage][0] += numel
        elif layout.method == "qlora" and _LAYER.search(name) and param.ndim == 2:
            counts[stage][2] += numel  # bitsandbytes quantises the decoder's linear weights, not norms or embeddings
            counts[stage][3] += 1
        else:
            counts[stage][1] += numel
    ranks = []
    for stage, (trainable, frozen, nf4, nf4_tensors) in enumerate(counts):
        states = model_state_bytes(trainable + frozen + nf4, trainable, layout, quantizable=nf4,
                                   nf4_tensors=nf4_tensors, engine=engine)
        ranks.append(RankStates(stage, split[stage], round(states.weights), round(states.gradients),
                                round(states.optimizer), round(states.host)))
    return ranks


def _add_predictions(ranks: Iterable[RankStates], plan: Plan, layout: Layout) -> None:
    """The cost model's model-state terms for the same rank (planner.cost_model.stage_memory)."""
    trace = trace_model(plan.model, layout.seq, dtype=layout.dtype, method=layout.method,  # type: ignore[arg-type]
                        lora_rank=layout.lora_rank, device_type=plan.hardware.device_type)
    split, recomputed = default_split(trace, layout)
    for rank in ranks:
        s = rank.pipeline_stage
        memory = stage_memory(trace, layout, plan.hardware, s, split[s], recomputed[s])
        rank.predicted = {"weights": round(memory.weights), "gradients": round(memory.gradients),
                          "optimizer": round(memory.optimizer), "host": round(memory.host)}
