"""The trainer's engines behind one contract (``Engine`` in ``trainer.engines.base``), and the
choice of which one runs a layout.

- ``plain``: one process, or DDP across data-parallel ranks;
- ``deepspeed_zero``: DeepSpeed ZeRO 1-3, optionally offloaded;
- ``fsdp2`` (``sharded``): DTensor tensor parallelism and/or FSDP2 (DP x TP);
- ``pipeline``: ``torch.distributed.pipelining`` stages (DP x PP, TP inside a stage).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from specs.capabilities import EngineChoice, EngineName, check_runnable, engine_for, config_shape
from specs.engine_traits import traits
from specs.errors import UsageError
from specs.core import Layout
from trainer.engines.base import Engine, device
from trainer.engines.deepspeed_zero import DeepSpeedEngine
from trainer.engines.pipeline import PipelineEngine
from trainer.engines.plain import PlainEngine
from trainer.engines.sharded import ShardedEngine

__all__ = ["Engine", "EngineChoice", "device", "make_engine", "select_backend"]

def select_backend(layout: Layout, engine: str = "auto") -> EngineName:
    """Which engine runs `layout`: the declaration's `engine_for` (specs/capabilities.py)."""
    return engine_for(layout, engine)


def make_engine(model: torch.nn.Module, layout: Layout, deepspeed_config: dict[str, Any] | None, clip: float,
                engine: EngineChoice = "auto") -> Engine:
    """The engine for `layout` (see `select_backend`); `deepspeed_config` is the planner's export,
    needed only when DeepSpeed runs."""
    check_runnable(layout, config_shape(model.config), device().type, engine)
    backend = select_backend(layout, engine)
    if traits(backend).deepspeed:
        if deepspeed_config is None:
            raise UsageError("DeepSpeed runs this layout and needs the planner's exported config")
        return DeepSpeedEngine(model, layout, deepspeed_config, clip)
    return _RUNTIME[backend](model, layout, clip)


# The runtime class of each engine the declaration names (DeepSpeed's also takes its config).
_RUNTIME: dict[str, Callable[[torch.nn.Module, Layout, float], Engine]] = {
    "plain": PlainEngine, "fsdp2": ShardedEngine, "pipeline": PipelineEngine}
