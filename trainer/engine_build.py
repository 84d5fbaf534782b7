"""The engine a layout runs with, and one optimizer step of it: `advisor train` (trainer/recovery.py,
trainer/stage_runner.py) and the timed steps (trainer/timed_steps.py: calibration, verification
trials, benches) build and step theirs here, so that what is timed is what trains."""

from __future__ import annotations

from typing import Iterable

import torch

from specs.capabilities import EngineChoice
from specs.core import Layout, ModelSpec
from specs.engine_traits import traits
from specs.task import AdapterSpec
from planner.export import model_deepspeed_config
from trainer.batch import MicroBatch
from trainer.engines import Engine, make_engine, select_backend
from trainer.model import build_model
from trainer.options import TrainOptions


def build_engine(model: ModelSpec, layout: Layout, device_type: str, engine: EngineChoice, options: TrainOptions,
                 dev: torch.device, adapter: AdapterSpec | None = None) -> Engine:
    """The engine `advisor train` runs `layout` with: the trainer's model, on `dev`, under the engine the
    capability declaration names, DeepSpeed configured as the plan's export."""
    # on meta: the engine fills its shards
    built = build_model(model, layout, options.seed, options.weights, adapter, options.trust_remote_code)
    ds_config = None
    if traits(select_backend(layout, engine)).deepspeed:
        ds_config = model_deepspeed_config(model, device_type, layout)
    return make_engine(built, layout, ds_config, options.clip, engine)


def optimizer_step(engine: Engine, micro_batches: Iterable[MicroBatch], lr: float) -> tuple[list[float | None], float]:
    """One optimizer step of `engine`: forward and backward of each micro-batch, then the update at
    `lr`; the micro-batches' losses and the gradient norm."""
    losses = [engine.micro_step(batch) for batch in micro_batches]
    return losses, engine.optimizer_step(lr)
