"""Learning rate schedules of a curriculum, chosen by the task's `lr_schedule`.

- `stage_lr` (rewarm_cosine): linear re-warm-up at every stage start, then cosine decay to a floor.
  The source article: each sub-task's data distribution differs, so the rate warms up again at the
  start of each stage and decays as the stage goes on.
- `wsd_lr` (wsd): warmup-stable-decay across the whole run (MiniCPM, OLMo-2): one warm-up, each
  stage's rate held, then one linear decay over the run's last steps, which therefore fall on the
  last stage's data (the target or high-quality mix).
- `constant_lr` (constant): each stage's warm-up, then its rate held to its end. The only schedule
  whose rates do not depend on the stage's length, so a finished run extended with `--resume` and a
  larger length trains as if that length had been asked for from the start.

`first_changed_rate` tells whether a new run length changes the rate of a step already trained.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specs.task import TaskSpec


def stage_lr(step_in_stage: int, stage_steps: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Rate for the optimizer step `step_in_stage` (0-based) of a stage of `stage_steps` steps."""
    warmup = min(warmup, max(stage_steps - 1, 0))
    if warmup and step_in_stage < warmup:
        return peak * (step_in_stage + 1) / (warmup + 1)
    span = max(stage_steps - warmup - 1, 1)
    progress = min(max(step_in_stage - warmup, 0) / span, 1.0)
    floor = peak * min_ratio
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def wsd_lr(run_step: int, run_steps: int, peak: float, warmup: int, decay_steps: int, min_ratio: float) -> float:
    """Rate for the run's optimizer step `run_step` (0-based over all stages) of `run_steps`, where
    `peak` is the current stage's rate: warm-up as `stage_lr`'s, then `peak`, then over the last
    `decay_steps` a linear fall that reaches `peak * min_ratio` at the last step."""
    warmup = min(warmup, max(run_steps - 1, 0))
    if warmup and run_step < warmup:
        return peak * (run_step + 1) / (warmup + 1)
    decay_steps = max(1, min(decay_steps, run_steps - warmup))
    into_decay = run_step - (run_steps - decay_steps) + 1
    if into_decay <= 0:
        return peak
    return peak * (1 - (1 - min_ratio) * min(into_decay / decay_steps, 1.0))


def constant_lr(step_in_stage: int, peak: float, warmup: int) -> float:
    """Warm-up as `stage_lr`'s but whatever the stage's length, then `peak`."""
    return peak * (step_in_stage + 1) / (warmup + 1) if step_in_stage < warmup else peak


def scheduled_lr(task: "TaskSpec", stage: int, step_in_stage: int, stage_steps: int, run_steps: list[int],
                 lr_scale: float = 1.0) -> float:
    """The task's rate at `step_in_stage` of `stage`, which runs `stage_steps` steps; `run_steps`: every
    stage's steps as WSD counts them (its position counts the stages' steps as the run takes them)."""
    spec = task.stages[stage]
    peak = spec.lr * lr_scale
    if task.lr_schedule == "wsd":
        total = sum(run_steps)
        return wsd_lr(sum(run_steps[:stage]) + step_in_stage, total, peak, task.stages[0].warmup_for(total),
                      round(task.wsd_decay_fraction * total), spec.min_lr_ratio)
    if task.lr_schedule == "constant":
        # its warm-up is the stage's steps, not clamped to its length, so that a longer run keeps every
        # trained step's rate (a share of the length, `warmup_ratio`, cannot)
        warmup = spec.warmup_steps if spec.warmup_ratio is None else spec.warmup_for(stage_steps)
        return constant_lr(step_in_stage, peak, warmup)
    return stage_lr(step_in_stage, stage_steps, peak, spec.warmup_for(stage_steps), spec.min_lr_ratio)


def first_changed_rate(task: "TaskSpec", trained: list[int], old: tuple[list[int], list[int]],
                       new: tuple[list[int], list[int]]) -> tuple[int, float, float] | None:
    """The first step already trained (`trained[i]` steps of stage i) whose rate the new length
    changes: (its 1-based number in the run, the rate it had, the rate it would have), else None.
    `old` and `new`: the stages' steps, and the steps WSD counts, before and after."""
    step = 0
    for stage, done in enumerate(trained):
        for k in range(done):
            step += 1
            had = scheduled_lr(task, stage, k, old[0][stage], old[1])
            now = scheduled_lr(task, stage, k, new[0][stage], new[1])
            if had != now:
                return step, had, now
    return None
