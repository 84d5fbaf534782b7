"""Fit the cost model's efficiency factors to a few real training steps of the target model.

The cost model's step time of a 1-device layout is affine in two reciprocals:

    t = a * x + b * y + c,   x = 1 / efficiency.gemm,   y = 1 / efficiency.memory_bandwidth

where `a` is the GEMM time at the measured GEMM rate (FLOPs over `peak_tflops`), `b` the time of
the memory-bound traffic at the measured copy bandwidth (element-wise kernels and, on CPU, the
optimizer step), and `c` the rest (zero for one device). `decompose` reads a, b and c off the
cost model itself (planner/cost_model.py, evaluated at three settings of the factors), so the fit
never re-derives a formula. `fit_factors` then solves the least-squares problem over the
measured steps, each weighted by 1/t so that every layout counts by its relative error, with
x >= 1 and y >= 1 (an `Efficiency` is at most 1 of the measured peak).

Which layouts: `fit_layouts` returns one overhead-heavy (mbs 1), one GEMM-heavy (mbs 4) and one
without a full optimizer (LoRA, mbs 2): LoRA separates the optimizer's memory traffic from the
GEMMs, and the two micro-batch sizes separate per-token work from per-step work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from advisor.specs import HardwareSpec, Layout, ModelSpec
from planner.cost_model import estimate_from_trace
from profiler.hardware_bench import _nonnegative_lstsq
from profiler.model_trace import ModelTrace, trace_model
from profiler.profile_spec import Calibration, CalibrationStep

CALIBRATION_LAYERS = 2  # decoder layers that run (at the model's full width)
# The first steps run slower while glibc raises its mmap threshold and caches warm up.
WARMUP_STEPS = 3


@dataclass(frozen=True)
class Terms:
    """t = gemm_s * x + memory_s * y + rest_s for one layout (x, y: reciprocal efficiencies)."""

    gemm_s: float
    memory_s: float
    rest_s: float

    def at(self, gemm: float, memory_bandwidth: float) -> float:
        return self.gemm_s / gemm + self.memory_s / memory_bandwidth + self.rest_s


def with_factors(hardware: HardwareSpec, gemm: float, memory_bandwidth: float) -> HardwareSpec:
    eff = hardware.efficiency.model_copy(update={"gemm": gemm, "memory_bandwidth": memory_bandwidth})
    return hardware.model_copy(update={"efficiency": eff})


def decompose(trace: ModelTrace, layout: Layout, hardware: HardwareSpec) -> Terms:
    """Read the affine terms off the cost model: at (1, 1), at (1/2, 1) and at (1, 1/2)."""
    base = estimate_from_trace(trace, layout, with_factors(hardware, 1.0, 1.0)).time.step_s
    slow_gemm = estimate_from_trace(trace, layout, with_factors(hardware, 0.5, 1.0)).time.step_s
    slow_memory = estimate_from_trace(trace, layout, with_factors(hardware, 1.0, 0.5)).time.step_s
    gemm_s, memory_s = slow_gemm - base, slow_memory - base
    return Terms(gemm_s, memory_s, base - gemm_s - memory_s)


def fit_factors(terms: list[Terms], measured_s: list[float]) -> dict[str, float]:
    """Least squares of relative errors: min sum(((a x + b y + c) / t - 1)^2), x, y >= 1.

    Returns {"gemm": 1/x, "memory_bandwidth": 1/y}. With x = 1 + u, y = 1 + v it is a
    two-unknown non-negative least-squares problem in (u, v)."""
    import numpy as np

    if len(terms) != len(measured_s) or not terms:
        raise ValueError("need one measured time per layout")
    t = np.array(measured_s, dtype=float)
    a = np.array([x.gemm_s for x in terms]) / t
    b = np.array([x.memory_s for x in terms]) / t
    c = np.array([x.rest_s for x in terms]) / t
    u, v = _nonnegative_lstsq(np.stack([a, b], axis=1), 1 - a - b - c)
    return {"gemm": 1 / (1 + u), "memory_bandwidth": 1 / (1 + v)}


def calibration_model(model: ModelSpec, layers: int = CALIBRATION_LAYERS) -> ModelSpec:
    """The target model cut to `layers` decoder layers at its full width."""
    from profiler.model_trace import _layers_key

    cfg = dict(model.hf_config)
    key = _layers_key(cfg)
    cfg[key] = min(int(cfg[key]), layers)
    return ModelSpec(name=f"{model.name}[{cfg[key]} layers]", hf_config=cfg, source=model.source)


def fit_layouts(seq: int) -> list[Layout]:
    return [
        Layout(mbs=1, seq=seq, dtype="fp32"),
        Layout(mbs=4, seq=seq, dtype="fp32"),
        Layout(mbs=2, seq=seq, dtype="fp32", method="lora"),
    ]


def calibration_seq(model: ModelSpec, quick: bool) -> int:
    limit = int(model.hf_config.get("max_position_embeddings") or model.hf_config.get("n_positions") or 2048)
    return min(limit, 256 if quick else 512)


def calibrate(
    model: ModelSpec, hardware: HardwareSpec, threads: int, quick: bool, steps: int | None = None,
    progress: Any = None,
) -> tuple[HardwareSpec, Calibration]:
    """Run the fit layouts for real (CPU, fp32, one rank of `threads` threads), fit the factors,
    and return the hardware with them and the record of what was run."""
    from trainer.steps import run_layout, time_steps

    small = calibration_model(model)
    seq = calibration_seq(model, quick)
    layouts = fit_layouts(seq)
    steps = steps or (7 if quick else 12)
    measured, terms = [], []
    for layout in layouts:
        if progress:
            progress(f"calibration {layout.short()}")
        result = time_steps(run_layout(layout), steps=steps, hf_config=small.hf_config, threads=threads,
                            warmup=WARMUP_STEPS)
        measured.append(result["step_s"])
        trace = trace_model(small, layout.seq, dtype=layout.dtype, method=layout.method,
                            lora_rank=layout.lora_rank, device_type=hardware.device_type)
        terms.append(decompose(trace, layout, hardware))
    factors = fit_factors(terms, measured)
    fitted = with_factors(hardware, factors["gemm"], factors["memory_bandwidth"])
    before = hardware.efficiency
    record = Calibration(
        model=model.name, layers=int(small.hf_config[_layers(small)]), threads=threads, factors=factors,
        steps=[CalibrationStep(layout=lay.short(), measured_s=m, steps=steps,
                               predicted_before_s=term.at(before.gemm, before.memory_bandwidth),
                               predicted_after_s=term.at(factors["gemm"], factors["memory_bandwidth"]))
               for lay, m, term in zip(layouts, measured, terms)],
    )
    return fitted, record


def _layers(model: ModelSpec) -> str:
    from profiler.model_trace import _layers_key

    return _layers_key(model.hf_config)
