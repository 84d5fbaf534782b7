"""The settings of a fine-tune: a plan made without `--task`, trained over `--data` from `--weights`.

A task's defaults (specs/task.py: lr 3e-4, 20 warm-up steps) are pre-training's. Fine-tuning a
trained model wants others, the ones fine-tuning recipes use: LoRA and QLoRA around 2e-4, full
fine-tuning around 1e-5 (a rate that high would undo what the weights learned), a warm-up that is
a share of the run's own steps (a fixed 20 steps is the whole of a short run), then cosine decay to
the end of the run. The one-stage plan (trainer/one_stage.py) takes them from here; every one of
them yields to its `advisor train` flag, which a plan without `--weights` also takes.
"""

from __future__ import annotations

from dataclasses import dataclass

from specs.errors import UsageError
from specs.core import Layout
from specs.task import AdapterSpec, DataSource, TaskSpec

LEARNING_RATES = {"full": 1e-5, "lora": 2e-4, "qlora": 2e-4}
WARMUP_RATIO = 0.1


@dataclass(frozen=True)
class FineTuneFlags:
    """`advisor train`'s flags for a plan without a task; None: the default."""

    lr: float | None = None
    warmup_ratio: float | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: list[str] | None = None
    val_size: float | None = None
    packing: bool = True


def check_lora_rank(layout: Layout, rank: int | None) -> None:
    """`--lora-rank` names the rank the plan priced, or is refused: the rank sets the adapters'
    weights, gradients and optimizer states, which the plan's memory and step time count
    (planner/stage_memory.py), so a rank other than the plan's is a re-plan, not a training flag."""
    if rank is None or rank == layout.lora_rank:
        return
    if layout.method == "full":
        raise UsageError(f"--lora-rank {rank}: this plan fine-tunes all weights (method full); plan with "
                         f"--method lora --lora-rank {rank}")
    raise UsageError(f"--lora-rank {rank}: the plan priced LoRA rank {layout.lora_rank}; plan again with "
                     f"`advisor plan --lora-rank {rank}` (the rank sets the adapters' memory, which the plan counts)")


def fine_tune_task(task: TaskSpec, layout: Layout, weights: str | None, flags: FineTuneFlags) -> TaskSpec:
    """The one-stage `task` with its schedule, adapters and packing: the flags given, else fine-tuning's
    defaults when the run starts from `weights`, else the task's own (pre-training's)."""
    check_lora_rank(layout, flags.lora_rank)
    if (flags.lora_alpha is not None or flags.lora_targets) and layout.method == "full":
        raise UsageError("--lora-alpha and --lora-targets set LoRA adapters; this plan fine-tunes all weights "
                         "(method full)")
    update: dict = {}
    if weights:
        update = {"lr": LEARNING_RATES[layout.method], "warmup_ratio": WARMUP_RATIO}
    if flags.lr is not None:
        update["lr"] = flags.lr
    if flags.warmup_ratio is not None:
        update["warmup_ratio"] = flags.warmup_ratio
    if flags.val_size is not None:
        update["eval_sources"] = _held_out(task.stages[0].sources, flags.val_size, "val")
        update["sources"] = _held_out(task.stages[0].sources, flags.val_size, "train")
    stages = [stage.model_copy(update=update) for stage in task.stages]  # the flags were checked by the CLI
    adapter = AdapterSpec(alpha=flags.lora_alpha, targets=flags.lora_targets)
    return task.model_copy(update={"stages": stages, "adapter": adapter, "packing": flags.packing})


def _held_out(sources: list[DataSource], val_size: float, split: str) -> list[DataSource]:
    """Each source's `split` side of its `val_size` rows held out (trainer/data/holdout.py)."""
    return [DataSource.model_validate({**source.model_dump(), "val_size": val_size, "split": split})
            for source in sources]
