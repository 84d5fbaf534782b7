"""The spike guard reads its margins from the task's `spike_guard` setting.

Truths: planted loss and gradient-norm sequences whose outliers are known by construction (a
gradient norm ten times its steady level with the loss flat, as the demo's reasoning stage showed
when it learnt; a loss that triples; a non-finite value), and the margins written in the task files.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from specs.errors import UsageError
from specs.task import SpikeGuardSpec, read_task_file
from presets import load_task
from trainer.spike import SpikeGuard

WARMUP = 20
STEADY_GRAD = [0.55, 0.45, 0.6, 0.5]  # a plateau's gradient norms, repeated
STEADY_LOSS = 0.9


def verdicts(guard: SpikeGuard, steps: list[tuple[float, float]]) -> list[int]:
    """The 1-based steps the guard flags among `steps` (loss, gradient norm)."""
    return [i for i, (loss, grad) in enumerate(steps, start=1) if guard.check(loss, grad) is not None]


def plateau_then(*planted: tuple[float, float]) -> list[tuple[float, float]]:
    """30 steady steps (past the warm-up window), then the planted ones, then 5 steady again."""
    steady = [(STEADY_LOSS, STEADY_GRAD[i % len(STEADY_GRAD)]) for i in range(30)]
    return [*steady, *planted, *steady[:5]]


def test_a_learning_jump_of_the_gradient_norm_is_a_spike_by_default_but_not_at_the_demos_setting() -> None:
    steps = plateau_then((STEADY_LOSS, 5.8))  # the loss stays flat: the model learns, nothing diverges
    assert verdicts(SpikeGuard.for_task(SpikeGuardSpec(), WARMUP), steps) == [31]
    assert verdicts(SpikeGuard(warmup_steps=WARMUP), steps) == [31]  # the guard's own defaults are the spec's
    demo = load_task("demo").spike_guard
    assert demo.grad_norm_ratio is not None and demo.grad_norm_ratio > SpikeGuardSpec().grad_norm_ratio
    assert verdicts(SpikeGuard.for_task(demo, WARMUP), steps) == []


def test_the_demos_setting_still_guards_a_diverging_loss_and_a_runaway_gradient_norm() -> None:
    demo = SpikeGuard.for_task(load_task("demo").spike_guard, WARMUP)
    assert verdicts(demo, plateau_then((3 * STEADY_LOSS, 0.5))) == [31]
    demo = SpikeGuard.for_task(load_task("demo").spike_guard, WARMUP)
    assert verdicts(demo, plateau_then((STEADY_LOSS, 1000.0))) == [31]
    demo = SpikeGuard.for_task(load_task("demo").spike_guard, WARMUP)
    assert verdicts(demo, plateau_then((math.nan, 0.5))) == [31]


def test_null_margins_turn_a_check_off_but_never_the_non_finite_check() -> None:
    spec = SpikeGuardSpec(grad_norm_sigmas=None, grad_norm_ratio=None, loss_sigmas=None, loss_ratio=None)
    assert verdicts(SpikeGuard.for_task(spec, WARMUP), plateau_then((3.0, 1e6))) == []
    assert verdicts(SpikeGuard.for_task(spec, WARMUP), plateau_then((STEADY_LOSS, math.inf))) == [31]
    # one margin alone: the ratio binds where the deviation margin is left out
    ratio_only = SpikeGuardSpec(grad_norm_sigmas=None, grad_norm_ratio=4.0)
    assert verdicts(SpikeGuard.for_task(ratio_only, WARMUP), plateau_then((STEADY_LOSS, 1.9))) == []
    assert verdicts(SpikeGuard.for_task(ratio_only, WARMUP), plateau_then((STEADY_LOSS, 2.3))) == [31]


def _task_file(tmp_path: Path, setting: str) -> Path:
    path = tmp_path / "task.yaml"
    path.write_text(f"name: t\nstages: [{{name: s, tokens: 1000}}]\nspike_guard: {setting}\n")
    return path


def test_a_task_file_sets_the_margins_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    task = read_task_file(_task_file(tmp_path, "{grad_norm_ratio: 12, loss_sigmas: null}"))
    assert (task.spike_guard.grad_norm_ratio, task.spike_guard.loss_sigmas) == (12.0, None)
    assert task.spike_guard.grad_norm_sigmas == SpikeGuardSpec().grad_norm_sigmas  # unnamed keys keep defaults
    assert read_task_file(_task_file(tmp_path, "{}")).spike_guard == SpikeGuardSpec()
    for bad, named in (("{grad_norm_ratio: 0.5}", "spike_guard.grad_norm_ratio"),
                       ("{grad_ratio: 12}", "spike_guard.grad_ratio: unknown key"), ("off", "spike_guard")):
        with pytest.raises(UsageError) as caught:
            read_task_file(_task_file(tmp_path, bad))
        assert named in str(caught.value) and "\n" not in str(caught.value)
