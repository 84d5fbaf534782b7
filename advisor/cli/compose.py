"""Profiling this machine, as `advisor profile` and `advisor run` both do it: measuring (profiler/,
whose calibration steps run through the trainer's timed steps), then deciding (planner/ fits the
cost model's efficiencies to those steps), then writing profile.json.

Importing this module loads torch, transformers and DeepSpeed: the verbs import it when they run.
"""

from __future__ import annotations

from typing import Any

from specs.profile import HardwareProfile
from specs.core import Layout, ModelSpec
from planner.calibration import calibrate
from profiler.run_profile import ProfileOptions, run_profile
from trainer.oom import is_oom
from trainer.timed_steps import prepare_forks, time_layout


def time_layout_steps(model: ModelSpec, layout: Layout, *, steps: int, threads: int, warmup: int) -> float | None:
    """The profiler's step runner: the median step of `advisor train`'s engine for `layout`; None when
    it ran out of the device's memory (a rank's error, re-raised by the launcher, says so)."""
    try:
        return time_layout(model, layout, steps=steps, warmup=warmup, threads=threads).step_s
    except Exception as exc:  # torch.multiprocessing re-raises a rank's error as its own type, text kept
        if is_oom(exc) or "out of memory" in str(exc).lower():
            return None
        raise


def profile_this_machine(opts: ProfileOptions, progress: Any = None) -> HardwareProfile | None:
    """Measure, fit, write `opts.out`; None where a torchrun job wrote the profile itself."""
    measured = run_profile(opts, progress, step_runner=time_layout_steps, prepare_forks=lambda: prepare_forks([]))
    if measured is None:
        return None
    profile = measured.profile
    if measured.calibration_steps is not None:
        profile = calibrate(profile, measured.calibration_steps)
    profile.write(opts.out)
    return profile
