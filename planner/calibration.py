"""Fit the cost model's efficiency factors to a few real training steps of the target model.

The cost model's step time of a layout is affine in eight unknowns (for fixed everything else):

    x_gemm = 1 / efficiency.gemm             dense GEMM FLOPs at the measured GEMM rate (set to
                                             1, not fitted: `MEASURED`)
    x_memory = 1 / efficiency.memory_bandwidth   memory-bound traffic (element-wise kernels) at the
                                             measured copy rate (on CPU the optimizer step is the
                                             profile's measured AdamW rate, not fitted)
    x_adapter = 1 / efficiency.adapter_gemm  LoRA adapters' skinny GEMMs
    overhead = efficiency.micro_batch_overhead_s   fixed time per micro-batch (Python, launches)
    contention = efficiency.node_contention  slow-down when every device of the node computes
    x_collective = 1 / efficiency.intra_node_collective   the node's collectives under load at the
                                             measured (idle) link rate: read off data-parallel
                                             steps at mbs 1 (traffic-heavy) and 8 (compute-heavy)
    slope = efficiency.gemm_tokens_slope     GEMM time per doubling of tokens per micro-batch (the
                                             CPU's caches): read off steps at mbs 1, 4 and seq 512
    wait = efficiency.tp_collective_wait_s   seconds each tensor-parallel collective waits beyond its
                                             transfer (the ranks' skew at each blocking call): read
                                             off a tp=2 step

`decompose` reads the slope of each unknown off the cost model itself (planner/cost_model.py,
evaluated at a reference point and with each unknown moved by one), so the fit never re-derives a
formula. `fit_factors` solves the bounded least-squares problem over the measured steps, each
weighted by 1/t so that every layout counts by its relative error; an unknown that no measured
layout depends on (no LoRA layout, one device) keeps its value. The contention multiplies the
compute, so the step is bilinear in the unknowns: `fit_to_steps` re-linearises and solves again
until the factors settle. The fitted GEMM and memory factors may exceed 1: a profile's "peak" is
its own micro-benchmark, and training kernels may beat it.

The steps themselves are measured by the profiler (profiler/calibration_steps.py); `calibrate`
fits the factors to them and records the fit in the profile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import lsq_linear

from specs.profile import Calibration, CalibrationStep, HardwareProfile
from specs.core import Efficiency, HardwareSpec, Layout
from planner.cost_model import estimate_from_trace
from profiler.calibration_steps import CalibrationSteps
from specs.model_depth import layer_count_key
from profiler.model_trace import ModelTrace, trace_model

# name -> (Efficiency field, reciprocal?, bounds of the unknown)
UNKNOWNS: dict[str, tuple[str, bool, tuple[float, float]]] = {
    "gemm": ("gemm", True, (0.5, 20.0)),
    # eager element-wise ops on one CPU thread run at about 1/20 of the copy rate
    "memory_bandwidth": ("memory_bandwidth", True, (0.5, 100.0)),
    "adapter_gemm": ("adapter_gemm", True, (0.5, 50.0)),
    "micro_batch_overhead_s": ("micro_batch_overhead_s", False, (0.0, 1.0)),
    "node_contention": ("node_contention", False, (0.0, 4.0)),
    "gemm_tokens_slope": ("gemm_tokens_slope", False, (-0.5, 2.0)),
    # the node's collectives while its devices compute: gloo's all-reduce shares the cores with the
    # backward it overlaps, and ran 2.7x slower than alone (gqa-50k's gradients, 2 ranks on this CPU)
    "intra_node_collective": ("intra_node_collective", True, (1.0, 20.0)),
    # each tensor-parallel collective's wait beyond its transfer: 8 ms per blocking all-reduce between
    # two ranks computing 24 ms GEMM chunks here, where the idle link prices a 1 MiB one at 1.4 ms
    "tp_collective_wait_s": ("tp_collective_wait_s", False, (0.0, 0.1)),
}
FACTORS = tuple(UNKNOWNS)
# Not fitted: the profile measured the GEMM rate on the model's own shapes (profiler.hardware_bench.
# model_gemm_shapes), so training GEMMs run at efficiency 1.0 of it. Fitted too, it traded off
# against the element-wise time (both grow with the tokens in every calibration layout): two quick
# profiles of one machine fitted 0.86 and 2.0 with equal residuals, and held-out models with
# another balance of GEMMs and element-wise work paid for it (bench/accuracy.py: median 8.6% -> 5.3%).
MEASURED = {"gemm": 1.0}
# Not fitted on a GPU, where each is a CPU's effect or measured apart: the tokens a GEMM is fed move a
# GPU's rate through its waves (priced from the tile grid) and the profile's GEMM shapes, not through
# caches; a GPU's devices share no cores (no contention); the per-micro-batch host time is the host
# floor, measured per op (profiler/host_ops.py). Fitted there too, the slope traded off against the
# memory-bound time across the host floor's kinks (a 1.1B Llama's bf16 steps at known factors: the
# memory factor came back 0.675 for 0.6, the slope 0.023 for 0).
NOT_FITTED_ON_GPU = ("gemm_tokens_slope", "node_contention", "micro_batch_overhead_s")


def unknowns_of(eff: Efficiency) -> dict[str, float]:
    """The fit's variables at these factors (reciprocals of the efficiencies)."""
    out = {}
    for name, (fld, reciprocal, _) in UNKNOWNS.items():
        value = getattr(eff, fld)
        if value is None:  # adapter_gemm unset: as gemm
            value = eff.gemm
        out[name] = 1 / value if reciprocal else value
    return out


def efficiencies_of(unknowns: dict[str, float]) -> dict[str, float]:
    """The Efficiency fields these fit variables stand for (inverse of `unknowns_of`)."""
    return {UNKNOWNS[n][0]: (1 / v if UNKNOWNS[n][1] else v) for n, v in unknowns.items()}


def with_factors(hardware: HardwareSpec, **factors: float) -> HardwareSpec:
    eff = hardware.efficiency.model_copy(update=factors)
    return hardware.model_copy(update={"efficiency": eff})


@dataclass(frozen=True)
class Terms:
    """The step of one layout near `reference`: t = base_s + sum_k slope_k * (u_k - reference_k).

    Exact along each unknown alone; the contention multiplies the compute, so jointly the step is
    bilinear and `fit_to_steps` re-linearises at each new estimate (Gauss-Newton)."""

    base_s: float
    slopes: dict[str, float]
    reference: dict[str, float] = field(default_factory=dict)

    def at(self, eff: Efficiency) -> float:
        u = unknowns_of(eff)
        return self.base_s + sum(s * (u[k] - self.reference[k]) for k, s in self.slopes.items())


def decompose(trace: ModelTrace, layout: Layout, hardware: HardwareSpec) -> Terms:
    """Slopes read off the cost model at the hardware's own factors: each unknown moved by one."""
    reference = unknowns_of(hardware.efficiency)

    def at(unknowns: dict[str, float]) -> float:
        return estimate_from_trace(trace, layout, with_factors(hardware, **efficiencies_of(unknowns))).time.step_s

    base = at(reference)
    slopes = {k: at({**reference, k: reference[k] + 1.0}) - base for k in reference}
    return Terms(base, slopes, reference)


def fit_factors(terms: list[Terms], measured_s: list[float], fixed: tuple[str, ...] = ()) -> dict[str, float]:
    """One bounded least-squares solve of relative errors, min sum((t_i(u) / m_i - 1)^2).

    Returns the Efficiency fields the measured layouts determine (memory_bandwidth, adapter_gemm,
    micro_batch_overhead_s, node_contention, gemm_tokens_slope, intra_node_collective,
    tp_collective_wait_s; gemm is `MEASURED`); an unknown no layout depends on (no LoRA layout, one
    device only) or named in `fixed` is left out, so it keeps its value."""
    if len(terms) != len(measured_s) or not terms:
        raise ValueError("need one measured time per layout")
    m = np.array(measured_s, dtype=float)
    names = [n for n in FACTORS if n not in MEASURED and n not in fixed
             and max(abs(t.slopes[n]) / mi for t, mi in zip(terms, m)) > 1e-9]
    slopes = np.array([[t.slopes[n] for n in names] for t in terms]) / m[:, None]
    offset = np.array([t.base_s - sum(t.slopes[n] * t.reference[n] for n in names) for t in terms]) / m
    lower = np.array([UNKNOWNS[n][2][0] for n in names])
    upper = np.array([UNKNOWNS[n][2][1] for n in names])
    solution = lsq_linear(slopes, 1 - offset, bounds=(lower, upper), method="bvls")
    # bvls can land a rounding error outside a bound (-7e-18 for a zero overhead), which the profile's
    # own schema then refuses
    fitted = np.clip(solution.x, lower, upper)
    return efficiencies_of(dict(zip(names, (float(v) for v in fitted))))


def fit_to_steps(cases: list[tuple[ModelTrace, Layout]], measured_s: list[float], hardware: HardwareSpec,
                 iterations: int = 6) -> dict[str, float]:
    """The factors that best explain the measured steps of (trace, layout) cases on the real cost
    model: `fit_factors` re-linearised at each estimate until the factors settle."""
    factors: dict[str, float] = {}
    gpu = hardware.device_type == "cuda"
    current = with_factors(hardware, **MEASURED)
    for _ in range(iterations):
        terms = [decompose(trace, layout, current) for trace, layout in cases]
        new = {**MEASURED, **fit_factors(terms, measured_s, NOT_FITTED_ON_GPU if gpu else ())}
        settled = factors and all(abs(new[k] - factors.get(k, float("inf"))) <= 1e-9 * max(1.0, abs(new[k]))
                                  for k in new)
        factors = new
        current = with_factors(hardware, **factors)
        if settled:
            break
    return factors


def calibrate(profile: HardwareProfile, measured: CalibrationSteps) -> HardwareProfile:
    """The profile with its efficiency factors fitted to the measured calibration steps, and the
    record of the fit (each step's time predicted before and after it)."""
    hardware = profile.hardware
    cases = [(trace_model(measured.small, layout.seq, dtype=layout.dtype, method=layout.method,
                          lora_rank=layout.lora_rank, device_type=hardware.device_type), layout)
             for layout in measured.layouts]
    factors = fit_to_steps(cases, measured.measured_s, hardware)
    fitted = with_factors(hardware, **factors)
    record = Calibration(
        model=measured.model, layers=int(measured.small.hf_config[layer_count_key(measured.small.hf_config)]),
        threads=measured.threads, factors=factors,
        steps=[CalibrationStep(layout=lay.short(), measured_s=m, steps=measured.steps,
                               predicted_before_s=estimate_from_trace(trace, lay, hardware).time.step_s,
                               predicted_after_s=estimate_from_trace(trace, lay, fitted).time.step_s)
               for (trace, lay), m in zip(cases, measured.measured_s)],
    )
    return profile.model_copy(update={"hardware": fitted, "calibration": record})
