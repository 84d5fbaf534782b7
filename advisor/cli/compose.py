"""Profiling this machine, as `advisor profile` and `advisor run` both do it: measuring (profiler/,
whose calibration steps run through the trainer's step runner), then deciding (planner/ fits the
cost model's efficiencies to those steps), then writing profile.json.

Importing this module loads torch, transformers and DeepSpeed: the verbs import it when they run.
"""

from __future__ import annotations

from typing import Any

from advisor.profile import HardwareProfile
from planner.calibration import calibrate
from profiler.run_profile import ProfileOptions, run_profile
from trainer.steps import normalize_layout, prepare_parent, run_layout, time_steps


def _time_layout_steps(layout: Any, **kwargs: Any) -> dict[str, Any]:
    """The profiler's step runner: a Layout's steps, timed by the trainer's step harness."""
    return time_steps(run_layout(layout), **kwargs)


def profile_this_machine(opts: ProfileOptions, progress: Any = None) -> HardwareProfile | None:
    """Measure, fit, write `opts.out`; None where a torchrun job wrote the profile itself."""
    measured = run_profile(opts, progress, step_runner=_time_layout_steps,
                           prepare_forks=lambda: prepare_parent(normalize_layout({})))
    if measured is None:
        return None
    profile = measured.profile
    if measured.calibration_steps is not None:
        profile = calibrate(profile, measured.calibration_steps)
    profile.write(opts.out)
    return profile

