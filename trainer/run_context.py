"""What the components of one training run share and never change: the plan, the options, the run
dir's files, the device, this process's rank, the tokenizer; and the ranks' one all-reduce of a step.

The loop (trainer/loop.py) is split as torchtitan splits its trainer: the run's files
(trainer/run_files.py), the recovery that owns the layout in force (trainer/recovery.py), the stage
runner (trainer/stage_runner.py), the evaluator (trainer/evaluator.py) and the summary
(trainer/run_summary.py), each with its own state. They share `LoopState` (trainer/loop_state.py,
what a checkpoint holds besides the engine) and read this context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from specs.plan_file import Plan
from specs.task import TaskSpec
from trainer.options import TrainOptions
from trainer.run_files import RunFiles


def rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sum_across_ranks(values: list[float]) -> list[float]:
    """One all-reduce for all of a step's numbers (a collective per number would cost latency)."""
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


@dataclass(frozen=True)
class RunContext:
    plan: Plan
    options: TrainOptions
    files: RunFiles
    dev: torch.device
    rank: int
    world: int
    tokenizer: Any  # trainer/corpus.py tokenizer_for: a TextTokenizer or the ByteTokenizer
    vocab: int

    @property
    def task(self) -> TaskSpec:
        assert self.plan.task is not None  # the loop refuses a plan without a task first
        return self.plan.task

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes the run dir's files."""
        return self.rank == 0
