"""Run-time preparation: what every caller of the launcher (trainer/launch.py) does before any rank
starts, so that `advisor train`, `advisor run` and `curriculum compare` start their runs alike.

1. TORCH_EXTENSIONS_DIR points at this machine's compiled ops (trainer/native_ops.py), which every
   rank started afterwards inherits;
2. the run dir is claimed: an old run refused, or moved aside with `overwrite`, and what training
   would write over in a directory of no run moved aside (only on the node of rank 0: another
   node's launcher may start after rank 0 has claimed the directory for this very run);
3. a plan without a task becomes one stage over the data asked for, saved as the run's plan.yaml;
4. DeepSpeed's CPU communication op is built once, here, when a layout to run needs it.

Holding the run dir (trainer/run_lock.py) for the length of the launch stays with the caller, which
takes it before it routes its console output into the run dir.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from specs.errors import UsageError
from specs.plan_file import Plan
from specs.run_dir import PLAN_FILE
from specs.core import Layout
from trainer.data.mixing import Reading
from trainer.fine_tune import FineTuneFlags
from trainer.run_identity import move_in_the_way_aside, refuse_or_move_aside

Say = Callable[[str], None]


@dataclass(frozen=True)
class OneStageRequest:
    """What makes a plan without a task one stage (`advisor train`'s --data and the flags beside it)."""

    data: Path | None
    steps: int | None = None
    tokens: int | None = None
    epochs: float | None = None
    weights: str | None = None
    datasets: list[str] | None = None  # names in a registry's dataset_info.json (`data` names the registry)
    reading: Reading = field(default_factory=Reading)
    template: str | None = None
    lr_schedule: str | None = None
    flags: FineTuneFlags = field(default_factory=FineTuneFlags)
    trusted: bool = False  # --trust-remote-code: the weights' and tokenizer's folders may run their own code


@dataclass(frozen=True)
class PreparedRun:
    plan: Plan  # the plan to launch (a plan without a task: its one stage, as written to the run dir)
    data: Path | None  # the prepared-data folder the loop reads (None: the task's own files)


def prepare_run(plan: Plan, out: Path, *, resumed: bool, overwrite: bool, node_rank: int = 0,
                data: Path | None = None, one_stage: OneStageRequest | None = None, claim: bool = True,
                layouts: Sequence[Layout] | None = None, say: Say = print) -> PreparedRun:
    """Prepare `out` and this machine for launching `plan` (see the module's steps). `claim=False`
    when the caller has already claimed the run dir under its own rules (`advisor run` moves a
    previous run aside before its verification trials write there); `layouts`: every layout the
    caller will launch (default: the plan's stages)."""
    # deferred: torch, which the CLI imports only for the verbs that need it
    from trainer.native_ops import build_cpu_comm_op, use_persistent_extensions_dir

    use_persistent_extensions_dir()
    if claim:
        claim_run_dir(out, resumed, overwrite, node_rank, say)
    if plan.task is None:
        plan, data = _one_stage(plan, one_stage or OneStageRequest(data), out, say)
    build_cpu_comm_op(layouts or [s.layout for s in plan.stages] or [plan.chosen.layout], plan.engine, say)
    return PreparedRun(plan, data)


def claim_run_dir(out: Path, resumed: bool, overwrite: bool, node_rank: int, say: Say) -> None:
    """Refuse a used run dir, or move its run aside, before any worker starts (a refusal is one line)."""
    if node_rank == 0 and os.environ.get("SLURM_NODEID", "0") == "0":
        moved = refuse_or_move_aside(out, resumed, overwrite)
        if moved is not None:
            say(f"moved the previous run in {out} aside to {moved}")
        for aside in move_in_the_way_aside(out):  # a model/ or stages/ of no run: kept, under a dated name
            say(f"moved {aside.name.split('.old-')[0]} in {out}, which holds no run, aside to {aside}")


def _one_stage(plan: Plan, request: OneStageRequest, out: Path, say: Say) -> tuple[Plan, Path | None]:
    """A plan made without --task as one stage over the request's data (trainer/one_stage.py), saved
    as the run's plan; and the prepared-data folder the loop reads (None: raw files)."""
    if request.data is None:
        raise UsageError("this plan has no task: give the data to train on with --data FILE, GLOB or FOLDER "
                         "(JSON lines or array, parquet, CSV, text, a saved dataset or a prepared folder), "
                         "or plan with --task")
    # deferred: reads and tokenizes the data (the counting pass of the default length)
    from trainer.one_stage import one_stage_plan

    r = request
    plan, prepared = one_stage_plan(plan, str(r.data), out, r.steps, r.tokens, r.epochs, r.weights,
                                    datasets=r.datasets, reading=r.reading, template=r.template,
                                    lr_schedule=r.lr_schedule, flags=r.flags, trusted=r.trusted)
    sources = plan.task.stages[0].sources if plan.task else []
    if len(sources) == 1:
        say(f"--data {r.data}: {sources[0].format} rows (detected from their fields)")
    elif sources:  # datasets of a registry or an Axolotl config
        kinds = ", ".join(f"{Path(s.path).name} ({s.format}, {s.weight:.0%})" for s in sources)
        say(f"--data {r.data}: {kinds}, {r.reading.mix}")
    plan.write(out / PLAN_FILE)
    return plan, prepared
