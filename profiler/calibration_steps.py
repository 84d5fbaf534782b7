"""Calibration steps: a few real training steps of the target model, timed through a step runner.

The profiler only measures here. The runner that executes the steps is handed in by the composition
root (the CLI passes the trainer's timed steps, trainer/timed_steps.py: `advisor train`'s own
engines and step code), and the factors are fitted to the times by `planner/calibration.py`.

Which layouts (`fit_layouts`): mbs 1, 2, 4 and 8 separate per-token from per-micro-batch work and
follow the GEMM rate over the tokens per micro-batch (four points on that axis: with two, its slope
traded off freely against the other factors), a second micro-batch (gas 2) pins the overhead, seq
512 weighs attention, full recomputation adds forward work without the optimizer, LoRA separates
the adapters and the element-wise traffic (LoRA skips most of the optimizer), and one
data-parallel step over every device of the node measures contention and the collectives under
load, twice: at mbs 1 the gradients' all-reduce weighs most, at mbs 8 the compute; and one
tensor-parallel step on two devices measures what each blocking collective waits beyond its
transfer (the ranks' skew: 5 ms per all-reduce in a 2-rank TP step here, where the link prices 1.4).
The node's ranks slow each other's compute by a few percent, while the all-reduce, sharing the
cores with the backward it overlaps, runs slower than the profile measured it alone: one step
cannot tell the two apart (at mbs 2 alone the fit read 47% contention where two independent ranks
computing at once measured 3-9%, and `advisor run`'s demo step at mbs 8 was priced 36% slow).
Eleven steps for seven fitted factors (planner/calibration.py): the fit is over-determined, so one
noisy step cannot move a factor alone.

On a GPU the same layouts run in bf16 (fp32 master weights, bf16 autocast: what `dtype=bf16` trains
as) at twice the sequence: a GPU's narrow steps are bound by the host's launches, which the profile
measured apart (profiler/host_ops.py), so the steps weigh the memory-bound kernels and the adapters
against a measured floor. A layout that runs out of the device's memory (the step runner returns
None: two decoder layers of a 405B model at full width with their embedding and head hold about
170 GB of states) is left out of the fit, and what ran is what the fit uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from specs.capabilities import config_shape, runnable_problem
from specs.layout_rules import ModelShape
from specs.core import Layout, ModelSpec
from specs.model_depth import first_layers, layer_count_key

CALIBRATION_LAYERS = 2  # decoder layers that run (at the model's full width)
# The first steps run slower while glibc raises its mmap threshold and caches warm up.
WARMUP_STEPS = 3


class StepRunner(Protocol):
    """Runs `steps` optimizer steps of `layout` on `model` for real and returns the median step's
    seconds after `warmup` (the trainer's timed steps: `advisor train`'s engine and step code), or
    None when the layout ran out of the device's memory."""

    def __call__(self, model: ModelSpec, layout: Layout, *, steps: int, threads: int,
                 warmup: int) -> float | None: ...


@dataclass
class CalibrationSteps:
    """What ran and how long each step took: the input of the fit (planner/calibration.py)."""

    model: str  # the target model's name
    small: ModelSpec  # the cut of it that ran
    threads: int
    steps: int
    layouts: list[Layout]  # those that ran (a layout out of the device's memory is left out)
    measured_s: list[float]
    out_of_memory: list[Layout] = field(default_factory=list)


def calibration_model(model: ModelSpec, layers: int = CALIBRATION_LAYERS) -> ModelSpec:
    """The target model cut to `layers` decoder layers at its full width."""
    key = layer_count_key(model.hf_config)
    cfg = first_layers(model.hf_config, min(int(model.hf_config[key]), layers))
    return ModelSpec(name=f"{model.name}[{cfg[key]} layers]", hf_config=cfg, source=model.source)


def calibration_dtype(device_type: str) -> str:
    """fp32 on a CPU (what it trains in); bf16 on a GPU (fp32 master weights, bf16 compute)."""
    return "fp32" if device_type == "cpu" else "bf16"


def fit_layouts(seq: int, devices: int, max_seq: int | None = None, shape: ModelShape | None = None,
                device_type: str = "cpu") -> list[Layout]:
    """What calibration runs (see the module docstring); the last ones on two devices when the
    node has them, tensor parallel where the model's `shape` splits in two (every shape, unset)."""
    dtype = calibration_dtype(device_type)
    layouts = [
        Layout(mbs=1, seq=seq, dtype=dtype),
        Layout(mbs=2, seq=seq, dtype=dtype),
        Layout(mbs=4, seq=seq, dtype=dtype),
        Layout(mbs=8, seq=seq, dtype=dtype),
        Layout(mbs=1, gas=2, seq=seq, dtype=dtype),
        Layout(mbs=1, seq=min(2 * seq, max_seq or 2 * seq), dtype=dtype),
        Layout(mbs=2, seq=seq, dtype=dtype, recompute="full"),
        Layout(mbs=2, seq=seq, dtype=dtype, method="lora"),
    ]
    if devices >= 2:
        layouts += [Layout(dp=2, mbs=1, seq=seq, dtype=dtype), Layout(dp=2, mbs=8, seq=seq, dtype=dtype)]
        tensor_parallel = Layout(tp=2, mbs=2, seq=seq, dtype=dtype)
        if shape is None or runnable_problem(tensor_parallel, shape, device_type) is None:
            layouts.append(tensor_parallel)
    return layouts


def max_seq(model: ModelSpec) -> int:
    return int(model.hf_config.get("max_position_embeddings") or model.hf_config.get("n_positions") or 2048)


def calibration_seq(model: ModelSpec, quick: bool, device_type: str = "cpu") -> int:
    seq = 256 if quick else 512
    return min(max_seq(model), seq if device_type == "cpu" else 2 * seq)


def measure_calibration_steps(
    model: ModelSpec, devices: int, threads: int, quick: bool, step_runner: StepRunner, steps: int | None = None,
    progress: Callable[[str], None] | None = None, device_type: str = "cpu",
) -> CalibrationSteps:
    """Run the fit layouts for real on the cut model (a CPU: fp32, ranks of `threads` threads; a GPU:
    bf16 at twice the sequence), leaving out the layouts that run out of memory."""
    small = calibration_model(model)
    layouts = fit_layouts(calibration_seq(model, quick, device_type), devices, max_seq(model),
                          config_shape(small.hf_config), device_type)
    steps = steps or (7 if quick else 12)
    ran, measured, out_of_memory = [], [], []
    for layout in layouts:
        if progress:
            progress(f"calibration {layout.short()}")
        seconds = step_runner(small, layout, steps=steps, threads=threads, warmup=WARMUP_STEPS)
        if seconds is None:
            out_of_memory.append(layout)
        else:
            ran.append(layout)
            measured.append(seconds)
    return CalibrationSteps(model=model.name, small=small, threads=threads, steps=steps, layouts=ran,
                            measured_s=measured, out_of_memory=out_of_memory)
