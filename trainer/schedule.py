"""Learning rate per stage: linear re-warm-up at every stage start, then cosine decay to a floor.

The source article: each sub-task's data distribution differs, so the rate warms up again at the
start of each stage and decays as the stage goes on.
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
