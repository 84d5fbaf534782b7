"""Real training steps of a small HF model on this machine: the shared core of the benches and
of `advisor profile`'s calibration.

A *run layout* is a plain dict (``world, zero, mbs, seq, gas, recompute, method, dtype``; see
``LAYOUT_DEFAULTS``): what the CPU benches can run. ``run_layout(spec)`` converts an
``advisor.specs.Layout``. Each run builds a randomly initialised model (``demo-tiny`` unless an
HF config is given) and the engine that `advisor train` would run for the layout (plain torch, DDP
when world > 1, DeepSpeed ZeRO when zero > 0), through the trainer's own ``build_model`` and
``make_engine``, and runs optimizer steps under a ``Meter`` that sees every forward, backward and
optimizer region. Only the DeepSpeed bucket sizes are the harness's own (``ZERO_SETTINGS``).

Ranks are forked from a parent that has already imported torch, transformers and DeepSpeed
(``launch``), on gloo with a free port: 0.4 s for 2 DDP ranks instead of ~6 s with torchrun
(shared/NOTES-cpu-stack.md, "Time").
"""

from __future__ import annotations

import os

# DeepSpeed probes for a GPU at import unless told the accelerator; it must be set before import.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

import torch

from advisor.specs import Layout, ModelSpec
from profiler.ranks import finish_rank, free_port, init_rank, launch  # noqa: F401  (re-exported for callers)
from trainer.engines import Engine, make_engine, select_backend
from trainer.engines.plain import DDP_SETTINGS  # noqa: F401  (re-exported: the memory bench records it)
from trainer.loop import TrainOptions
from trainer.model import build_model as build_trained_model

RunLayout = dict[str, Any]

# The `demo-tiny` preset.
MODEL_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
SEED = 0
LEARNING_RATE = 1e-4
CLIP = TrainOptions().clip  # `advisor train`'s gradient clipping

LORA_RANK = 16  # adapters on every linear layer, alpha 2r, no dropout (trainer/model.py)

# DeepSpeed ZeRO settings, in elements. Small round numbers so that bucket buffers are visible
# next to the 3.95 M-parameter model. `stage3_max_reuse_distance` is 0 because the default (1e9)
# would keep every gathered ZeRO-3 parameter of this small model alive from forward to backward.
ZERO_SETTINGS: dict[str, Any] = {
    "reduce_bucket_size": 500_000,
    "allgather_bucket_size": 500_000,
    "overlap_comm": False,
    "contiguous_gradients": True,
    "stage3_prefetch_bucket_size": 500_000,
    "stage3_param_persistence_threshold": 0,
    "stage3_max_live_parameters": 1_000_000,
    "stage3_max_reuse_distance": 0,
    "sub_group_size": 1_000_000_000,
}

LAYOUT_DEFAULTS: RunLayout = {
    "world": 1,
    "zero": 0,
    "mbs": 1,
    "seq": 256,
    "gas": 1,
    "recompute": "none",
    "method": "full",
    "dtype": "fp32",
}


def normalize_layout(layout: RunLayout) -> RunLayout:
    """Fill defaults and reject what these steps do not cover."""
    full = {**LAYOUT_DEFAULTS, **layout}
    if full["world"] not in (1, 2) or full["zero"] not in (0, 1, 2, 3):
        raise ValueError(f"unsupported world/zero: {full}")
    if full["recompute"] not in ("none", "selective", "full") or full["method"] not in ("full", "lora"):
        raise ValueError(f"unsupported recompute/method: {full}")
    if full["dtype"] != "fp32":
        raise ValueError("only fp32 is measured on CPU")
    return full


def run_layout(spec: Any) -> RunLayout:
    """The run layout of an ``advisor.specs.Layout`` (data parallel only: dp, zero, mbs, gas...)."""
    if spec.tp != 1 or spec.pp != 1:
        raise ValueError(f"only data parallel layouts run here (got tp={spec.tp}, pp={spec.pp})")
    return normalize_layout({
        "world": spec.dp, "zero": spec.zero, "mbs": spec.mbs, "seq": spec.seq, "gas": spec.gas,
        "recompute": spec.recompute, "method": spec.method, "dtype": spec.dtype,
    })


def trainer_layout(layout: RunLayout) -> Layout:
    """The ``advisor.specs.Layout`` that `advisor train` runs for a run layout."""
    return Layout(dp=layout["world"], zero=layout["zero"], mbs=layout["mbs"], seq=layout["seq"], gas=layout["gas"],
                  recompute=layout["recompute"], method=layout["method"], dtype="fp32", lora_rank=LORA_RANK)


def uses_deepspeed(layout: RunLayout) -> bool:
    """ZeRO 1-3 run through DeepSpeed; ZeRO 0 is plain torch (DDP when world > 1)."""
    return select_backend(trainer_layout(layout)) == "deepspeed"


# --------------------------------------------------------------------------------------------
# Meters: what watches the steps (memory in bench/measure_memory.py, wall time here).
# --------------------------------------------------------------------------------------------


class Meter(Protocol):
    """Watches the steps; regions are entered and left in order, never nested."""

    def attach(self, model: torch.nn.Module, optimizer: Any) -> None: ...  # once both exist
    def begin(self, step: int, phase: str) -> None: ...  # phase: forward | backward | optimizer
    def end(self) -> None: ...


@contextlib.contextmanager
def region(meter: Meter, step: int, phase: str) -> Iterator[None]:
    """Measure the enclosed code as region ``phase`` of optimizer step ``step``."""
    meter.begin(step, phase)
    try:
        yield
    finally:
        meter.end()


class StepTimer:
    """Wall time of each optimizer step: from its first forward to the end of its last region."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self._step = 0

    def attach(self, model: torch.nn.Module, optimizer: Any) -> None:
        pass

    def begin(self, step: int, phase: str) -> None:
        self._step = step
        self.started.setdefault(step, time.perf_counter())

    def end(self) -> None:
        self.ended[self._step] = time.perf_counter()

    def seconds(self) -> list[float]:
        return [self.ended[s] - self.started[s] for s in sorted(self.started)]


# --------------------------------------------------------------------------------------------
# Training: model, back-end, steps.
# --------------------------------------------------------------------------------------------


def build_model(layout: RunLayout, hf_config: dict[str, Any] | None = None) -> torch.nn.Module:
    """A randomly initialised fp32 causal LM (``demo-tiny`` by default, else any HF config), with
    the layout's recomputation and method: the trainer's own `build_model`, so that benches and
    calibration time the model `advisor train` runs."""
    config = dict(hf_config) if hf_config is not None else {"model_type": "llama", **MODEL_CONFIG}
    model = build_trained_model(ModelSpec(name="bench", hf_config=config), trainer_layout(layout), SEED)
    model.train()  # same init on every rank: the seed is fixed
    return model


def deepspeed_config(layout: RunLayout) -> dict[str, Any]:
    """DeepSpeed ZeRO config: fp32 and our explicit bucket sizes (the trainer's DeepSpeed engine
    adds its AdamW and clipping)."""
    return {
        "train_micro_batch_size_per_gpu": layout["mbs"],
        "gradient_accumulation_steps": layout["gas"],
        "train_batch_size": layout["mbs"] * layout["gas"] * layout["world"],
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "zero_optimization": {"stage": layout["zero"], **ZERO_SETTINGS},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def random_batch(layout: RunLayout, rank: int, step: int, micro: int, vocab: int | None = None) -> torch.Tensor:
    """Random token ids, different per rank and micro-batch, reproducible."""
    gen = torch.Generator().manual_seed(SEED + 1000 * rank + 10 * step + micro)
    vocab = vocab or MODEL_CONFIG["vocab_size"]
    return torch.randint(0, vocab, (layout["mbs"], layout["seq"]), generator=gen)


def build_engine(layout: RunLayout, hf_config: dict[str, Any] | None = None) -> Engine:
    """The engine `advisor train` runs for ``layout`` (``make_engine``), on the harness's model."""
    config = deepspeed_config(layout) if uses_deepspeed(layout) else None
    return make_engine(build_model(layout, hf_config), trainer_layout(layout), config, CLIP)


def run_steps(
    layout: RunLayout, steps: int, rank: int, meter: Meter, hf_config: dict[str, Any] | None = None
) -> list[float]:
    """Build the engine for ``layout`` and run ``steps`` optimizer steps under ``meter``; this
    rank's mean loss of each step.

    An engine's micro-step is forward and backward in one call: a hook on its model ends the
    forward region when the model returns, and the backward region starts there.
    """
    vocab = int((hf_config or MODEL_CONFIG)["vocab_size"])
    engine = build_engine(layout, hf_config)
    meter.attach(engine.model, engine.optimizer)
    current = [0]

    def forward_done(*_: Any) -> None:
        meter.end()
        meter.begin(current[0], "backward")

    hook = engine.model.register_forward_hook(forward_done)
    losses = []
    for step in range(1, steps + 1):
        current[0] = step
        micro_losses = []
        for micro in range(layout["gas"]):
            ids = random_batch(layout, rank, step, micro, vocab)
            with region(meter, step, "forward"):  # "backward" from the hook on
                micro_losses.append(engine.micro_step(ids))
            del ids
        with region(meter, step, "optimizer"):
            engine.optimizer_step(LEARNING_RATE)
        losses.append(statistics.fmean(micro_losses))
    hook.remove()
    del engine
    return losses


# --------------------------------------------------------------------------------------------
# Ranks: fork launching, set-up and the exit-crash-safe teardown.
# --------------------------------------------------------------------------------------------


def prepare_parent(layout: RunLayout) -> None:
    """Import and build native pieces once in the parent, so forked ranks inherit them loaded
    (each rank would otherwise spend seconds importing the model code)."""
    import deepspeed  # noqa: F401
    from peft import get_peft_model  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    if uses_deepspeed(layout):
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()  # DeepSpeed's CPU comm op: 30-45 s on a cold TORCH_EXTENSIONS_DIR



# --------------------------------------------------------------------------------------------
# Timed steps.
# --------------------------------------------------------------------------------------------


def _timed_worker(rank: int, layout: RunLayout, steps: int, port: int, out_dir: str,
                  hf_config: dict[str, Any] | None, threads: int | None) -> None:
    world = layout["world"]
    distributed = world > 1 or uses_deepspeed(layout)
    init_rank(rank, world, port, distributed, threads)
    timer = StepTimer()
    run_steps(layout, steps, rank, timer, hf_config)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(timer.seconds()))
    finish_rank(distributed)


def time_steps(
    layout: RunLayout, steps: int = 6, hf_config: dict[str, Any] | None = None, threads: int | None = None,
    warmup: int = 1,
) -> dict[str, Any]:
    """Run ``steps`` optimizer steps of ``layout`` in freshly forked ranks.

    Returns ``step_s`` (the median over the steps after ``warmup`` of the slowest rank's step
    time), every step's time and the thread count per rank. ``threads`` defaults to the cores
    shared out evenly between the ranks.
    """
    if steps <= warmup:
        raise ValueError(f"need more than {warmup} steps to time a steady step")
    layout = normalize_layout(layout)
    prepare_parent(layout)
    with tempfile.TemporaryDirectory(prefix="time_steps_") as out_dir:
        launch(_timed_worker, layout["world"], (layout, steps, free_port(), out_dir, hf_config, threads))
        per_rank = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(layout["world"])]
    slowest = [max(times) for times in zip(*per_rank)]
    return {
        "step_s": statistics.median(slowest[warmup:]),
        "steps_s": slowest,
        "threads": threads or max(1, (os.cpu_count() or 1) // layout["world"]),
        "layout": layout,
    }
