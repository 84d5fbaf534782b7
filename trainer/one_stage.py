"""A plan made without `--task`, trained as one stage over `advisor train --data PATH`.

The launching process turns such a plan into an ordinary one-stage plan (a task whose single stage
reads PATH, sized here) and writes it into the run directory as the run's plan.yaml; the workers and
a later `--resume` then run it like any other plan, through the loop's one data path.

The stage's length: `--steps`, else `--tokens` (rounded up to whole optimizer steps of the plan's
global batch), else one pass over the data: as many sequences as PATH packs into at the plan's
sequence length, rounded up to whole steps.
"""

from __future__ import annotations

import glob
import math
from pathlib import Path

from advisor.errors import UsageError
from advisor.plan_file import Plan
from advisor.task import DataSource, StageSpec, TaskSpec
from planner.granularity import plan_stage
from planner.plan import PlanOptions
from trainer.corpus import load_source, tokenizer_for
from trainer.data.manifest import MANIFEST_NAME
from trainer.data.sources import EXTENSIONS

FORMATS = ("jsonl", "parquet", "text")
STAGE_NAME = "train"
CACHE = "data_cache"  # the run dir's cache of packed sequences, which the loop reads too (trainer/loop.py)


def data_format(path: str) -> str:
    """jsonl, parquet or text, from the files' extensions: a file (text unless its extension says
    otherwise), or a folder or glob of one kind of file."""
    given = Path(path)
    if given.is_dir() and (given / MANIFEST_NAME).is_file():
        raise UsageError(f"--data {path} is an `advisor data prepare` folder: its shards belong to the task it "
                         "was prepared for; plan with --task TASK, or pass the raw files")
    if given.is_dir():
        files = [f for f in given.rglob("*") if f.is_file()]
    else:
        files = [Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file()]
    kinds = {fmt for f in files for fmt in FORMATS if f.name.endswith(EXTENSIONS[fmt])}
    if given.is_file():
        return next(iter(kinds), "text")
    if not kinds:
        raise UsageError(f"--data {path}: no {'/'.join(e for f in FORMATS for e in EXTENSIONS[f])} files there")
    if len(kinds) > 1:
        raise UsageError(f"--data {path} mixes {' and '.join(sorted(kinds))} files: point it at one kind")
    return kinds.pop()


def one_stage_plan(plan: Plan, data: str, run_dir: Path, steps: int | None, tokens: int | None) -> Plan:
    """`plan` with a one-stage task over `data`, sized by `steps`, `tokens` or one pass."""
    if steps is not None and tokens is not None:
        raise UsageError("give --steps or --tokens, not both")
    layout = plan.chosen.layout
    source = DataSource(path=str(Path(data).resolve()), format=data_format(data))  # type: ignore[arg-type]
    if steps is None and tokens is None:
        draft = _task(plan, source, steps=1)
        vocab = int(plan.model.hf_config.get("vocab_size", 0))
        tokenizer = tokenizer_for(draft, plan.model.name, vocab)
        sequences = len(load_source(source, draft, tokenizer, layout.seq, run_dir / CACHE))
        if sequences == 0:
            raise UsageError(f"--data {data}: no text to train on")
        steps = math.ceil(sequences / layout.global_batch)
    elif steps is None:
        steps = max(1, math.ceil(tokens / layout.tokens_per_step))  # type: ignore[operator]
    task = _task(plan, source, steps)
    nodes = math.ceil(layout.devices / plan.gpus_per_node)
    stage = plan_stage(task, task.stages[0], layout, plan.chosen.estimate, nodes, PlanOptions.mtbf_hours,
                       PlanOptions.checkpoint_write_gbs, plan.min_compute_fraction)
    return plan.model_copy(update={"task": task, "stages": [stage]})


def _task(plan: Plan, source: DataSource, steps: int) -> TaskSpec:
    layout = plan.chosen.layout
    return TaskSpec(name=f"data:{Path(source.path).name}", model=plan.model.name, seq_len=layout.seq,
                    global_batch=layout.global_batch, base_dir=str(Path(source.path).parent),
                    stages=[StageSpec(name=STAGE_NAME, sources=[source], steps=steps)])
