"""Sub-task granularity: steps per curriculum stage, the checkpoint cadence, and splits too fine.

The optimal checkpoint interval is Young's first-order formula, tau = sqrt(2 * delta * M), with
delta the time to write a checkpoint and M the job's mean time between failures (Young 1974;
Daly 2006 adds higher-order terms that matter only when delta is close to M). A job on n nodes
fails n times as often as one node.
"""

from __future__ import annotations

import math

from advisor.plan import StagePlan
from advisor.specs import DTYPE_BYTES, Estimate, Layout
from advisor.task import StageSpec, TaskSpec


def checkpoint_bytes(est: Estimate, layout: Layout) -> float:
    """Everything a resume needs, summed over devices: trainable weights in fp32 with their Adam
    moments, plus the frozen weights (once) for full training."""
    trainable = est.model.trainable_params
    frozen = est.model.params - trainable
    return trainable * (4 + 8) + (frozen * DTYPE_BYTES[layout.dtype] if layout.method == "full" else 0)


def young_interval_s(write_s: float, mtbf_s: float) -> float:
    """Young (1974): the interval that minimises expected lost work plus checkpoint cost."""
    return math.sqrt(2 * write_s * mtbf_s)


def plan_stage(
    task: TaskSpec, stage: StageSpec, layout: Layout, est: Estimate, nodes: int, mtbf_hours: float,
    checkpoint_write_gbs: float, min_compute_fraction: float,
) -> StagePlan:
    tokens_per_step = layout.tokens_per_step
    tokens = task.stage_tokens(stage, tokens_per_step)
    steps = max(1, math.ceil(tokens / tokens_per_step))
    step_s = est.time.step_s
    write_s = checkpoint_bytes(est, layout) / (checkpoint_write_gbs * 1e9 * nodes)
    job_mtbf_s = mtbf_hours * 3600 / nodes
    interval_steps = max(1, round(young_interval_s(write_s, job_mtbf_s) / step_s))
    interval_steps = min(interval_steps, steps)  # and one more at the stage end, always
    checkpoints = math.ceil(steps / interval_steps)
    train_s = steps * step_s
    # evaluation runs forward only: about a third of a training step's FLOPs per token
    evals = (1 + (steps // task.eval_every_steps if task.eval_every_steps else 0)) if stage.eval_tokens else 0
    eval_s = evals * stage.eval_tokens / est.throughput.tokens_per_s / 3
    overhead = (checkpoints * write_s + eval_s) / train_s
    flags = []
    if overhead > 1 - min_compute_fraction:
        flags.append(f"split too fine: checkpoints and evaluation add {100 * overhead:.0f}% to this stage "
                     f"(more than the {100 * (1 - min_compute_fraction):.0f}% the compute rule allows); "
                     "merge it with a neighbour or give it more tokens")
    if steps < 10:
        flags.append(f"only {steps} optimizer steps: the learning-rate warm-up alone may take them")
    return StagePlan(
        name=stage.name, method=layout.method, devices=layout.devices, layout=layout, tokens=tokens, steps=steps,
        step_s=step_s, hours=(train_s + checkpoints * write_s + eval_s) / 3600,
        checkpoint_every_steps=interval_steps, checkpoint_write_s=write_s, overhead_fraction=overhead, flags=flags,
    )
