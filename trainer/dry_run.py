"""`advisor train PLAN --dry-run`: every stage's layout checked against this trainer on the meta
device (no devices, no data), and what each rank would hold.

The checks are the trainer's own: the capability declaration (`advisor.capabilities`, as
`make_engine` calls it), the built model's module layout (`check_parallel_layout`, as the TP and
pipeline engines call it) and the pipeline cut (`layers_per_stage`). The model is built on the
meta device, so a 405B model costs seconds and no memory.

The bytes per rank are counted here from the meta model's parameter shapes and the engines' own
rules: which dtype each engine keeps parameters, gradients and AdamW moments in, what tensor
parallelism splits (the Megatron projections; embeddings, norms and the LM head stay whole), what
a pipeline stage holds, and what ZeRO/FSDP shards across the data-parallel ranks. The cost
model's model-state terms (`planner.cost_model.stage_memory`) are reported next to them, so the
two can be compared: they are independent derivations of the same quantities.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch

from advisor.capabilities import check_runnable, config_shape, engine_for
from advisor.errors import UsageError
from advisor.plan_file import Plan
from advisor.specs import DTYPE_BYTES, Layout, ModelSpec, layers_per_stage
from planner.cost_model import default_split, stage_memory
from planner.memory import NF4_BYTES_PER_PARAM
from profiler.model_trace import trace_model
from trainer.model import apply_lora
from trainer.parallelize import COLUMN_PARALLEL, ROW_PARALLEL, check_parallel_layout

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
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
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
            if engine in ("fsdp2", "pipeline"):
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
    """Bytes on rank 0 of each pipeline stage (the most loaded rank of its data-parallel group)."""
    counts = [[0.0] * 3 for _ in split]  # per stage: trainable, frozen 16-bit, frozen 4-bit elements
    for name, param in model.named_parameters():
        stage = _stage_of(name, split)
        numel, dims = _tp_share(name, param.shape, layout.tp)
        if engine in ("fsdp2", "pipeline") and layout.dp > 1:  # FSDP2 shards dim 0 of the local tensor
            numel = math.ceil(dims[0] / layout.dp) * math.prod(dims[1:])
        if param.requires_grad:
            kind = 0
        elif layout.method == "qlora" and _LAYER.search(name) and param.ndim == 2:
            kind = 2  # bitsandbytes quantises the decoder's linear weights, not norms or embeddings
        else:
            kind = 1
        counts[stage][kind] += numel
    return [RankStates(stage, split[stage], *_engine_bytes(engine, layout, *c)) for stage, c in enumerate(counts)]


def _engine_bytes(engine: str, layout: Layout, trainable: float, frozen: float, nf4: float) -> tuple[int, ...]:
    """(parameters, gradients, optimizer, host) bytes as each engine keeps them.

    - plain (and FSDP2/pipeline without ZeRO): the model is cast to the compute dtype before the
      engine starts (trainer.model.build_model), and torch's AdamW keeps its two moments in the
      parameters' dtype; no fp32 master copy.
    - FSDP2/pipeline with ZeRO: the model stays fp32 and FSDP2 computes in the layout's dtype
      through its mixed-precision policy: fp32 parameters, gradients (reduce dtype fp32) and moments,
      all sharded by FSDP2 across dp (counted in `_rank_states`).
    - DeepSpeed: 16-bit parameters and gradients, an fp32 master partition and two fp32 moments
      (12 bytes, ZeRO paper section 3.1), sharded by ZeRO's stage; offload moves the optimizer
      states (and from ZeRO-2 the fp32 gradient partition) to the host.
    peft keeps LoRA adapters in fp32 whatever the base (autocast_adapter_dtype)."""
    w = DTYPE_BYTES[layout.dtype]
    lora = layout.method in ("lora", "qlora")
    frozen_bytes = frozen * w + nf4 * NF4_BYTES_PER_PARAM
    host = 0.0
    if engine == "deepspeed":
        dp = layout.dp
        weights = (trainable + frozen) * w + nf4 * NF4_BYTES_PER_PARAM
        grads = trainable * w / (dp if layout.zero >= 2 else 1)
        optimizer = trainable * 12 / dp
        if layout.zero >= 3:
            weights /= dp
        if layout.offload != "none":
            host = optimizer + (4 * trainable / dp if layout.zero >= 2 else 0.0)
            optimizer = 0.0
            grads = 0.0 if layout.zero >= 2 else grads
        if layout.offload == "optimizer+params":
            host, weights = host + weights, 0.0
        return round(weights), round(grads), round(optimizer), round(host)
    keeps_fp32 = engine in ("fsdp2", "pipeline") and layout.zero > 0 and layout.dp > 1
    tw = 4 if lora or keeps_fp32 else w
    if keeps_fp32:
        frozen_bytes = frozen * 4 + nf4 * NF4_BYTES_PER_PARAM
    return round(frozen_bytes + trainable * tw), round(trainable * tw), round(2 * trainable * tw), 0


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
