"""Real optimizer steps of one layout, timed and measured, through `advisor train`'s own code.

The profiler's calibration, `advisor run`'s verification trials and the accuracy benches measure
here, so that what they time is what the trainer runs: the engine comes from the loop's
`build_engine` (the trainer's model, the engine the capability declaration names, DeepSpeed
configured as the plan's export) and every step goes through the loop's `optimizer_step`. Only
the data differ: random token ids, reproducible per rank, step and micro-batch, instead of a
task's stream (the time and memory of a step do not depend on which tokens it reads).

Ranks are forked from this process (profiler/ranks.py) after it has imported the model code and
DeepSpeed: 0.4 s for two ranks instead of seconds of torchrun and imports per trial
(docs/notes-cpu-stack.md, "Time"). Each rank joins its process group as `advisor train`'s
workers do (gloo on CPU, nccl on CUDA).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from specs.capabilities import EngineChoice, check_runnable, config_shape
from specs.engine_traits import traits
from specs.core import Layout, ModelSpec
from profiler.ranks import finish_rank, free_port, init_rank, launch
from trainer.batch import MicroBatch
from trainer.engines import device, select_backend
from trainer.engines.deepspeed_zero import import_deepspeed
from trainer.engine_build import build_engine, optimizer_step
from trainer.native_ops import build_cpu_comm_op_now
from trainer.options import TrainOptions

SEED = 0
LEARNING_RATE = 1e-4


class Meter(Protocol):
    """Watches the steps (bench/measure_memory.py follows live tensor bytes with one); regions are
    entered and left in order, never nested."""

    def start(self) -> None: ...  # before the engine is built
    def attach(self, model: torch.nn.Module, optimizer: Any) -> None: ...  # once the engine exists
    def begin(self, step: int, phase: str) -> None: ...  # phase: forward | backward | optimizer
    def end(self) -> None: ...
    def finish(self) -> Any: ...  # what it read (JSON, or a dataclass of it)


@dataclass
class TimedSteps:
    """What the steps measured: per step, the slowest rank's seconds and the ranks' mean loss."""

    steps_s: list[float]
    losses: list[float]
    warmup: int
    threads: int
    peak_bytes: int | None  # the allocator's peak over the steps, highest rank (CUDA only)
    peak_source: str | None

    @property
    def step_s(self) -> float:
        """The median step after the warm-up."""
        return statistics.median(self.steps_s[self.warmup:])


def random_batch(layout: Layout, vocab: int, data_rank: int, step: int, micro: int) -> MicroBatch:
    """Random token ids of one micro-batch, every token trained, different per data-parallel rank,
    step and micro-batch, reproducible."""
    generator = torch.Generator().manual_seed(SEED + 1000 * data_rank + 10 * step + micro)
    return MicroBatch.from_ids(torch.randint(0, vocab, (layout.mbs, layout.seq), generator=generator))


def run_steps(model: ModelSpec, layout: Layout, steps: int, rank: int, meter: Meter | None = None,
              engine: EngineChoice = "auto") -> tuple[list[float], list[float]]:
    """Build `advisor train`'s engine for `layout` in this rank and take `steps` optimizer steps;
    each step's seconds and this rank's mean loss."""
    dev = device()
    trained = build_engine(model, layout, dev.type, engine, TrainOptions(seed=SEED), dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the steps' peak, as the cost model prices it
    vocab = int(model.hf_config["vocab_size"])
    data_rank = getattr(trained, "data_rank", rank)  # as in the loop: TP/PP ranks of one replica read the same data
    current = [0]
    if meter is not None:
        meter.attach(trained.model, getattr(trained, "optimizer", None))
        hook = trained.model.register_forward_hook(lambda *_: _forward_done(meter, current))
    seconds, losses = [], []
    for step in range(1, steps + 1):
        current[0] = step
        batches = (random_batch(layout, vocab, data_rank, step, micro).to(dev) for micro in range(layout.gas))
        started = time.perf_counter()
        micro_losses, _ = optimizer_step(trained, _metered(batches, meter, step), LEARNING_RATE)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
        if meter is not None:
            meter.end()  # the optimizer region
        losses.append(statistics.fmean(x for x in micro_losses if x is not None))
    if meter is not None:
        hook.remove()
    del trained
    return seconds, losses


def _forward_done(meter: Meter, current: list[int]) -> None:
    """The model returned: its forward region ends and the backward region begins (an engine's
    micro-step is forward and backward in one call)."""
    meter.end()
    meter.begin(current[0], "backward")


def _metered(batches: Iterator[MicroBatch], meter: Meter | None, step: int) -> Iterator[MicroBatch]:
    """The micro-batches, each opening the meter's forward region as the engine takes it and
    closing the backward region when it asks for the next; the last one opens the optimizer region."""
    for batch in batches:
        if meter is not None:
            meter.begin(step, "forward")
        yield batch
        if meter is not None:
            meter.end()
    if meter is not None:
        meter.begin(step, "optimizer")


def prepare_forks(layouts: list[Layout], engine: EngineChoice = "auto", model: ModelSpec | None = None) -> None:
    """Import the model code (`model`'s family where given), and peft and DeepSpeed where a layout needs
    them, once in this process, so that forked ranks inherit them loaded (each rank would otherwise
    spend seconds importing them)."""
    from transformers import AutoModelForCausalLM  # noqa: F401  deferred: seconds of imports the forks inherit

    if model is not None:
        import_model_family(model)

    if any(layout.method in ("lora", "qlora") for layout in layouts):
        from peft import get_peft_model  # noqa: F401  deferred, as above (1-4 s more, with bitsandbytes)

    if any(traits(select_backend(layout, engine)).deepspeed for layout in layouts):
        import_deepspeed()
        if not torch.cuda.is_available():
            build_cpu_comm_op_now()  # DeepSpeed's CPU comm op: 30-45 s on a cold TORCH_EXTENSIONS_DIR


def import_model_family(model: ModelSpec) -> None:
    """Import the transformers modules of `model`'s family (its config and modelling code). Importing
    `AutoModelForCausalLM` loads none of them: transformers imports a family lazily, on first use, and
    in a forked rank that first use cost 2.5 s per trial here (demo-tiny's Llama: 11 calibration
    layouts and 3 verification trials in every `advisor run`). A family transformers does not know
    (a folder's own code) is left to the rank, whose model build says what is wrong."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(**model.hf_config)
        AutoModelForCausalLM._model_mapping[type(config)]  # the lookup imports the modelling module
    except (KeyError, ValueError, TypeError):
        return


def _rank(rank: int, model: ModelSpec, layout: Layout, steps: int, port: int, out_dir: str, threads: int | None,
          engine: EngineChoice, meter_factory: Callable[[], Meter] | None) -> None:
    world = layout.devices
    distributed = world > 1 or traits(select_backend(layout, engine)).deepspeed  # DeepSpeed needs a group of one
    # the device and group `advisor train`'s workers take (trainer/launch.py), with their timeout
    init_rank(rank, world, port, distributed=distributed, threads=threads,
              device_type="cuda" if torch.cuda.is_available() else "cpu", timeout_s=TrainOptions().timeout_s)
    meter = meter_factory() if meter_factory else None
    if meter is not None:
        meter.start()
    seconds, losses = run_steps(model, layout, steps, rank, meter, engine)
    peak = int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
    reading = meter.finish() if meter is not None else None
    record = {"seconds": seconds, "losses": losses, "peak_bytes": peak,
              "meter": asdict(reading) if is_dataclass(reading) else reading}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    finish_rank(distributed)


def time_layout(model: ModelSpec, layout: Layout, steps: int = 6, warmup: int = 1, threads: int | None = None,
                engine: EngineChoice = "auto", meter_factory: Callable[[], Meter] | None = None,
                readings: list[Any] | None = None) -> TimedSteps:
    """Take `steps` optimizer steps of `layout` on `model` in freshly forked ranks (randomly
    initialised, seeded alike on every rank).

    `threads` per rank defaults to the cores shared out evenly. A `meter_factory` makes each rank's
    meter; what its `finish()` returns lands in `readings`, one per rank.
    """
    if steps <= warmup:
        raise ValueError(f"need more than {warmup} steps to time a steady step")
    check_runnable(layout, config_shape(model.hf_config), device().type, engine)  # the trainer's refusal, here
    prepare_forks([layout], engine, model)
    world = layout.devices
    with tempfile.TemporaryDirectory(prefix="timed_steps_") as out_dir:
        launch(_rank, world, (model, layout, steps, free_port(), out_dir, threads, engine, meter_factory),
               start_method="spawn" if torch.cuda.is_available() else "fork")
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]
    if readings is not None:
        readings.extend(r["meter"] for r in ranks)
    peaks = [r["peak_bytes"] for r in ranks if r["peak_bytes"] is not None]
    return TimedSteps(
        steps_s=[max(per_step) for per_step in zip(*(r["seconds"] for r in ranks))],
        losses=[statistics.fmean(per_step) for per_step in zip(*(r["losses"] for r in ranks))],
        warmup=warmup, threads=threads or max(1, (os.cpu_count() or 1) // world),
        peak_bytes=max(peaks) if peaks else None,
        peak_source="torch.cuda.max_memory_allocated" if peaks else None)
