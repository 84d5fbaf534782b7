"""Learning rate schedules of a curriculum, chosen by the task's `lr_schedule`.

- `stage_lr` (rewarm_cosine): linear re-warm-up at every stage start, then cosine decay to a floor.
  The source article: each sub-task's data distribution differs, so the rate warms up again at the
  start of each stage and decays as the stage goes on.
- `wsd_lr` (wsd): warmup-stable-decay across the whole run (MiniCPM, OLMo-2): one warm-up, each
  stage's rate held, then one linear decay over the run's last steps, which therefore fall on the
  last stage's data (the target or high-quality mix).
"""

from __future__ import annotations

import math


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
