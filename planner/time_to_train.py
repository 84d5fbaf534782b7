"""Time to train: the one definition of how long a job takes on the wall clock.

Training time, plus checkpoints at Young's interval, plus the work that expected failures throw
away. `advisor plan --objective cost --deadline`, the stage plan's hours and `advisor report
capacity` all read it, so they agree about the same deadline.

The optimal checkpoint interval is Young's first-order formula, tau = sqrt(2 * delta * M), with
delta the time to write a checkpoint and M the job's mean time between failures (Young 1974;
Daly 2006 adds higher-order terms that matter only when delta is close to M). A job on n nodes
fails n times as often as one node. Over a whole job, checkpoints cost write time / interval of the
training time, and each failure loses, on average, half an interval of work plus the restart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specs.plan_file import DEFAULT_RESTART_S
from specs.core import DTYPE_BYTES, Estimate, Layout

RESTART_S = DEFAULT_RESTART_S  # re-queue, reload the last checkpoint, rebuild NCCL communicators: 10 minutes


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
    interval_s: float  # Young's (or the given) interval, at most the whole job (one checkpoint at the end, always)
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


def time_to_train(train_s: float, write_s: float, nodes: int, mtbf_hours: float, restart_s: float = RESTART_S,
                  interval_s: float | None = None) -> FailureOverhead:
    """Wall-clock time of a job of `train_s` seconds of training on `nodes` nodes, with its
    checkpoint and failure time; `interval_s` is the checkpoint interval (default: Young's).

    Failures arrive at nodes / MTBF-per-node over the job's *wall-clock* time, which includes the
    time they cost: wall = base + (wall / job_mtbf) * lost, so wall = base / (1 - lost / job_mtbf).
    """
    job_mtbf_s = mtbf_hours * 3600 / nodes
    interval_s = min(young_interval_s(write_s, job_mtbf_s) if interval_s is None else interval_s, train_s)
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


