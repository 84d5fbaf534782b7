"""Sub-task granularity: steps per curriculum stage, the checkpoint cadence, and splits too fine.

The optimal checkpoint interval is Young's first-order formula, tau = sqrt(2 * delta * M), with
delta the time to write a checkpoint and M the job's mean time between failures (Young 1974;
Daly 2006 adds higher-order terms that matter only when delta is close to M). A job on n nodes
fails n times as often as one node.

Over a whole job, checkpoints cost write time / interval of the training time, and each failure
loses, on average, half an interval of work plus the restart (`failure_overhead`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from advisor.plan_file import StagePlan
from advisor.specs import DTYPE_BYTES, Estimate, Layout
from advisor.task import StageSpec, TaskSpec


def checkpoint_bytes(est: Estimate, layout: Layout) -> float:
    """Everything a resume needs, summed over devices: trainable weights in fp32 with their Adam
    moments, plus the frozen weights (once) for full training."""
    trainable = est.model.trainable_params
    frozen = est.model.params - trainable
    return trainable * (4 + 8) + (frozen * DTYPE_BYTES[layout.dtype] if layout.method == "full" else 0)


def checkpoint_write_s(est: Estimate, layout: Layout, nodes: int, write_gbs_per_node: float) -> float:
    """Seconds to write one checkpoint: every node writes its share in parallel."""
    return checkpoint_bytes(est, layout) / (write_gbs_per_node * 1e9 * nodes)


def young_interval_s(write_s: float, mtbf_s: float) -> float:
    """Young (1974): the interval that minimises expected lost work plus checkpoint cost."""
    return math.sqrt(2 * write_s * mtbf_s)


@dataclass(frozen=True)
class FailureOverhead:
    """What checkpoints and failures add to a job's training time (all seconds)."""

    train_s: float
    write_s: float
    interval_s: float  # Young's interval, at most the whole job (one checkpoint at the end, always)
    checkpoints: int
    checkpoint_s: float  # checkpoints x write time
    failures: float  # expected over the job's wall-clock time
    lost_per_failure_s: float  # half an interval of work redone, plus the restart
    failure_s: float  # failures x lost work per failure
    wall_s: float  # train + checkpoints + failures; inf when failures come faster than progress

    @property
    def checkpoint_fraction(self) -> float:
        return self.checkpoint_s / self.train_s

    @property
    def failure_fraction(self) -> float:
        return self.failure_s / self.train_s


def failure_overhead(train_s: float, write_s: float, nodes: int, mtbf_hours: float,
                     restart_s: float) -> FailureOverhead:
    """Checkpoint and failure time of a job of `train_s` seconds of training on `nodes` nodes.

    Failures arrive at nodes / MTBF-per-node over the job's *wall-clock* time, which includes the
    time they cost: wall = base + (wall / job_mtbf) * lost, so wall = base / (1 - lost / job_mtbf).
    """
    job_mtbf_s = mtbf_hours * 3600 / nodes
    interval_s = min(young_interval_s(write_s, job_mtbf_s), train_s)
    checkpoints = max(1, math.ceil(train_s / interval_s - 1e-9))
    checkpoint_s = checkpoints * write_s
    lost_per_failure_s = interval_s / 2 + restart_s
    base_s = train_s + checkpoint_s
    if lost_per_failure_s >= job_mtbf_s:
        wall_s, failures = math.inf, math.inf
    else:
        wall_s = base_s / (1 - lost_per_failure_s / job_mtbf_s)
        failures = wall_s / job_mtbf_s
    return FailureOverhead(train_s=train_s, write_s=write_s, interval_s=interval_s, checkpoints=checkpoints,
                           checkpoint_s=checkpoint_s, failures=failures, lost_per_failure_s=lost_per_failure_s,
                           failure_s=wall_s - base_s, wall_s=wall_s)


def plan_stage(
    task: TaskSpec, stage: StageSpec, layout: Layout, est: Estimate, nodes: int, mtbf_hours: float,
    checkpoint_write_gbs: float, min_compute_fraction: float,
) -> StagePlan:
    tokens_per_step = layout.tokens_per_step
    tokens = task.stage_tokens(stage, tokens_per_step)
    steps = max(1, math.ceil(tokens / tokens_per_step))
    step_s = est.time.step_s
    write_s = checkpoint_write_s(est, layout, nodes, checkpoint_write_gbs)
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
