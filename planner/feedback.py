"""Feed measured steps back into the profile, so that predictions on this machine improve.

Every `advisor run` measures real steps: the verification trials of its top plans and the
training run itself. Each becomes an `Observation` (layout, model, measured step and peak memory,
the cost model's prediction at the time). `feed_back` appends them to a bounded history kept in
the profile (`profile.feedback.observations`, oldest dropped first), refits the efficiency
factors over the whole history with the calibration's own least squares (planner/calibration.py:
`decompose` reads the slopes off the cost model, `fit_to_steps` minimises the squared relative
step-time errors), and writes the profile back atomically with a `FeedbackRound`: the
RMS relative error over the history before and after the refit, and the error of the new
observations under the factors they were predicted with (the out-of-sample figure).

Least squares cannot make the error over the set it fits worse than the factors it starts from
(those are one feasible point of the same problem). The cost model is only piecewise affine in
the factors (pipeline and overlap maxima; node contention multiplies the compute), so the refit is
checked on the real cost model and kept only when it does not raise the error.

The first refit also takes in the profile's calibration steps (a cut of the same model), so a
run that measured only two similar layouts still fits against several.

On CPU, a "device" of the profile is `threads_per_device` cores: observations at another thread
count describe another device and are kept out of the fit (they are still recorded).

`advisor run` also asks, before it trains, whether the refit can price the plan it chose at all:
`refitted_hardware` is the same refit with nothing written, and `can_price` the rule (MAX_PRICE_MISS).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specs.errors import UsageError
from specs.profile import Feedback, FeedbackRound, HardwareProfile, Observation, load_profile
from specs.core import HardwareSpec, Layout, ModelSpec, parse_layout_string
from planner.calibration import fit_to_steps, with_factors
from planner.cost_model import estimate_from_trace
from presets import load_model
from profiler.calibration_steps import calibration_model
from profiler.model_trace import trace_model

MAX_OBSERVATIONS = 48  # history kept in the profile: about a dozen runs of 3 trials and a run
MAX_ROUNDS = 24
FITTED = ("gemm", "memory_bandwidth")
# A plan whose measured step and refitted prediction differ by more than this factor, either way,
# cannot be priced on this machine. From a quick profile the cost model misses demo-tiny's steps by
# 20% at worst (docs/benchmarks.md, bench.step_time_accuracy), and a trial of a few steps on a shared
# machine adds tens of percent of noise; a miss of 3x after the refit is neither: the model lacks
# something about this machine (a device or kernels the profile did not measure), so its ranking of
# the plans and the run's time estimates mean nothing.
MAX_PRICE_MISS = 3.0


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def observation(source: str, model: ModelSpec, layout: Layout, step_s: float, predicted_step_s: float,
                threads: int = 0, peak_bytes: int | None = None, predicted_peak_bytes: int | None = None,
                peak_source: str | None = None, steps: int = 0, run_dir: str | None = None) -> Observation:
    """One measured layout (a convenience over the pydantic constructor)."""
    return Observation(source=source, model=model.name, hf_config=model.hf_config, layout=layout, step_s=step_s,
                       predicted_step_s=predicted_step_s, threads=threads, peak_bytes=peak_bytes,
                       predicted_peak_bytes=predicted_peak_bytes, peak_source=peak_source, steps=steps,
                       run_dir=run_dir, at=now())


# --------------------------------------------------------------------------------------------
# the maths: predictions, errors and the refit over a set of observations


def _trace(obs: Observation, hardware: HardwareSpec):
    layout = obs.layout
    return trace_model(ModelSpec(name=obs.model, hf_config=obs.hf_config), layout.seq, dtype=layout.dtype,
                       method=layout.method, lora_rank=layout.lora_rank, device_type=hardware.device_type)


def predict_step(obs: Observation, hardware: HardwareSpec) -> float:
    """The cost model's step time of the observed layout on `hardware`."""
    return estimate_from_trace(_trace(obs, hardware), obs.layout, hardware).time.step_s


def relative_errors(observations: list[Observation], hardware: HardwareSpec) -> list[float]:
    """predicted / measured - 1 per observation."""
    return [predict_step(o, hardware) / o.step_s - 1 for o in observations]


def price_miss(measured_s: float, predicted_s: float) -> float:
    """How many times the prediction misses the measured step, either way (1: exact; inf when
    either is not positive)."""
    if measured_s <= 0 or predicted_s <= 0:
        return math.inf
    return max(measured_s / predicted_s, predicted_s / measured_s)


def can_price(measured_s: float, predicted_s: float) -> bool:
    """Whether the cost model prices a plan whose step measured `measured_s`: its prediction (after
    the refit) is within MAX_PRICE_MISS of it, either way."""
    return price_miss(measured_s, predicted_s) <= MAX_PRICE_MISS


def rms(errors: list[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else float("nan")


def with_efficiency(hardware: HardwareSpec, factors: dict[str, float]) -> HardwareSpec:
    return with_factors(hardware, **{k: v for k, v in factors.items() if k in type(hardware.efficiency).model_fields})


def refit(observations: list[Observation], hardware: HardwareSpec) -> dict[str, float]:
    """The efficiency factors that minimise the squared relative step-time errors over
    `observations`: the calibration's own fit (calibration.fit_to_steps, least squares on the slopes
    calibration.decompose reads off the cost model). Factors no observation depends on are left out."""
    if not observations:
        raise UsageError("no observations to fit")
    cases = [(_trace(o, hardware), o.layout) for o in observations]
    measured = [o.step_s for o in observations]
    return dict(fit_to_steps(cases, measured, hardware))


def current_efficiencies(hardware: HardwareSpec, names: Any) -> dict[str, float]:
    """The current value of each named Efficiency field (an unset adapter_gemm reads as gemm)."""
    eff = hardware.efficiency
    out = {}
    for name in names:
        value = getattr(eff, name, None)
        out[name] = float(eff.gemm if value is None and name == "adapter_gemm" else value or 0.0)
    return out


@dataclass
class Refit:
    factors_before: dict[str, float]
    factors_after: dict[str, float]
    error_before: float
    error_after: float
    kept_old: bool  # the refit raised the error on the real cost model: the old factors stay
    errors_before: list[float]
    errors_after: list[float]


def refit_checked(observations: list[Observation], hardware: HardwareSpec) -> Refit:
    """Refit, and keep the result only if the real cost model's error over the set does not rise."""
    errors_before = relative_errors(observations, hardware)
    factors = refit(observations, hardware)
    before = current_efficiencies(hardware, [*FITTED, *(k for k in factors if k not in FITTED)])
    fitted = with_efficiency(hardware, factors)
    errors_after = relative_errors(observations, fitted)
    after = {**before, **factors}
    kept_old = rms(errors_after) > rms(errors_before)
    if kept_old:
        after, errors_after = before, errors_before
    return Refit(before, after, rms(errors_before), rms(errors_after), kept_old, errors_before, errors_after)


# --------------------------------------------------------------------------------------------
# the profile: history, comparability, the atomic write


def comparable(obs: Observation, profile: HardwareProfile) -> bool:
    """Whether the observation ran on a device as the profile defines one (CPU: its thread count)."""
    if profile.hardware.device_type != "cpu":
        return True
    return obs.threads == profile.inventory.threads_per_device


def calibration_observations(profile: HardwareProfile) -> list[Observation]:
    """The profile's calibration steps as observations (the cut model they ran), when its model loads."""
    cal = profile.calibration
    if cal is None:
        return []
    try:
        small = calibration_model(load_model(cal.model), cal.layers)
    except UsageError:
        return []  # a model file that is no longer there
    out = []
    for step in cal.steps:
        layout = Layout(**parse_layout_string(step.layout))
        out.append(Observation(source="calibration", model=small.name, hf_config=small.hf_config, layout=layout,
                               step_s=step.measured_s, predicted_step_s=step.predicted_after_s, threads=cal.threads,
                               steps=step.steps, at=profile.created))
    return out


def _history(profile: HardwareProfile, new: list[Observation]) -> tuple[Feedback, list[Observation]]:
    """The profile's feedback record (seeded with its calibration steps) and the bounded history with `new`."""
    feedback = profile.feedback or Feedback(observations=calibration_observations(profile))
    return feedback, (feedback.observations + list(new))[-MAX_OBSERVATIONS:]


def refitted_hardware(profile_path: Path | None, hardware: HardwareSpec, new: list[Observation]) -> HardwareSpec:
    """The hardware with the factors `feed_back` would fit with `new` added, nothing written: over the
    profile's comparable history, or with no profile (a preset) over `new` alone on `hardware`."""
    used = list(new)
    if profile_path is not None:
        profile = load_profile(profile_path)
        hardware, used = profile.hardware, [o for o in _history(profile, new)[1] if comparable(o, profile)]
    if not used:
        return hardware
    return with_efficiency(hardware, refit_checked(used, hardware).factors_after)


def feed_back(profile_path: Path, new: list[Observation], run_dir: str | None = None,
              say: Callable[[str], None] = print) -> FeedbackRound | None:
    """Add `new` to the profile's history, refit the factors over the comparable history, write
    the profile back atomically and say the error before and after. None when nothing fits."""
    profile = load_profile(profile_path)
    feedback, history = _history(profile, new)
    used = [o for o in history if comparable(o, profile)]
    fresh = [o for o in new if comparable(o, profile)]
    skipped = len(new) - len(fresh)
    if skipped:
        say(f"feedback: {skipped} observation(s) ran at another thread count than the profile's "
            f"{profile.inventory.threads_per_device} per device; recorded, not fitted")
    if not used:
        profile.feedback = feedback.model_copy(update={"observations": history})
        profile.write(profile_path)
        return None
    hardware = profile.hardware
    result = refit_checked(used, hardware)
    new_error = rms(relative_errors(fresh, hardware)) if fresh else None
    round_ = FeedbackRound(at=now(), run_dir=run_dir, added=len(new), used=len(used),
                           factors_before=result.factors_before, factors_after=result.factors_after,
                           error_before=result.error_before, error_after=result.error_after,
                           new_error_before=new_error)
    profile.hardware = with_efficiency(hardware, result.factors_after)
    profile.feedback = Feedback(observations=history, rounds=(feedback.rounds + [round_])[-MAX_ROUNDS:])
    profile.write(profile_path)
    factors = ", ".join(f"{k} {result.factors_before[k]:.3g} -> {result.factors_after[k]:.3g}"
                        for k in result.factors_after if result.factors_after[k] != result.factors_before.get(k))
    say(f"feedback: step-time error over {len(used)} observations {100 * result.error_before:.1f}% -> "
        f"{100 * result.error_after:.1f}% (RMS relative); {factors}"
        + (" (refit kept out: it did not lower the error)" if result.kept_old else "")
        + (f"; this run's own error before the refit {100 * new_error:.1f}%" if new_error is not None else ""))
    return round_
