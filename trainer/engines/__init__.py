"""The trainer's engines behind one contract (``Engine`` in ``trainer.engines.base``), and the
choice of which one runs a layout.

- ``plain``: one process, or DDP across data-parallel ranks;
- ``deepspeed_zero``: DeepSpeed ZeRO 1-3, optionally offloaded;
- ``sharded``: DTensor tensor parallelism and/or FSDP2 (DP x TP);
- ``pipeline``: ``torch.distributed.pipelining`` stages (DP x PP, TP inside a stage).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from advisor.errors import UsageError
from advisor.specs import Layout
from trainer.engines.base import Engine, device
from trainer.engines.deepspeed_zero import DeepSpeedEngine
from trainer.engines.pipeline import PipelineEngine
from trainer.engines.plain import PlainEngine
from trainer.engines.sharded import ShardedEngine

__all__ = ["Engine", "EngineChoice", "device", "make_engine", "select_backend"]

EngineChoice = Literal["auto", "deepspeed", "fsdp2"]


def select_backend(layout: Layout, engine: EngineChoice = "auto") -> str:
    """Which engine runs `layout`: "pipeline", "sharded" (DTensor TP and/or FSDP2), "deepspeed"
    or "plain" (one process or DDP). `engine` is the plan's (or `--engine`'s) choice for sharded
    data parallelism; "auto" takes DeepSpeed for ZeRO unless tensor parallelism needs FSDP2."""
    if engine not in ("auto", "deepspeed", "fsdp2"):
        raise UsageError(f"unknown engine {engine!r}: choose auto, deepspeed or fsdp2")
    if engine == "deepspeed" and (layout.tp > 1 or layout.pp > 1):
        raise UsageError(f"engine=deepspeed runs data parallelism and ZeRO only; the plan asks for tp={layout.tp}, "
                         f"pp={layout.pp} (use --engine auto or fsdp2)")
    if layout.pp > 1:
        return "pipeline"
    if layout.tp > 1:
        return "sharded"
    if engine == "fsdp2" and (layout.zero or layout.dp > 1):
        return "sharded"
    if layout.zero:
        return "deepspeed"
    return "plain"


def make_engine(model: torch.nn.Module, layout: Layout, deepspeed_config: dict[str, Any] | None, clip: float,
                engine: EngineChoice = "auto") -> Engine:
    """The engine for `layout` (see `select_backend`); `deepspeed_config` is the planner's export,
    needed only when DeepSpeed runs."""
    backend = select_backend(layout, engine)
    if backend == "pipeline":
        return PipelineEngine(model, layout, clip)
    if backend == "sharded":
        return ShardedEngine(model, layout, clip)
    if backend == "deepspeed":
        if deepspeed_config is None:
            raise UsageError("DeepSpeed runs this layout and needs the planner's exported config")
        return DeepSpeedEngine(model, layout, deepspeed_config, clip)
    return PlainEngine(model, layout, clip)
