"""Whether a run dir already holds the run a plan would train there: finished (its results can be read
instead of trained again), resumable (same run, stopped after a checkpoint), or neither.

"The same run" means run.json's fingerprint (trainer/run_identity.py) equals, field for field, the one
this plan and these options would write now: the task, seed, model, data and tokenizer by content, the
layout, the stages' lengths and the evaluation's size. The loop's claim takes its fingerprint through
`run_fingerprint` too, so the two cannot drift apart.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any

from specs.plan_file import Plan
from specs.run_dir import CHECKPOINTS_DIR, SUMMARY_FILE
from trainer import checkpoint
from trainer.corpus import tokenizer_for
from trainer.file_digests import FileDigests
from trainer.options import TrainOptions
from trainer.prepared import prepared_dir
from trainer.run_identity import fingerprint, read_run, saved_digests


class Held(Enum):
    """What a run dir holds, for the plan and options asked about."""

    FINISHED = "finished"  # this very run, finished: read it
    RESUMABLE = "resumable"  # this very run, stopped after a verified checkpoint: resume it
    OTHER = "other"  # nothing, another run, or this run without a checkpoint: train afresh (moving it aside)


def vocab_size(plan: Plan) -> int:
    return int(plan.model.hf_config.get("vocab_size", 0))


def run_tokenizer(plan: Plan, options: TrainOptions) -> Any:
    """The tokenizer a run of `plan` with `options` reads its data with (the loop's, and the one its
    fingerprint names)."""
    assert plan.task is not None
    return tokenizer_for(plan.task, plan.model.name, vocab_size(plan), options.weights, options.template,
                         options.trust_remote_code)


def run_fingerprint(plan: Plan, options: TrainOptions, tokenizer: Any, digests: FileDigests) -> dict[str, Any]:
    """The fingerprint a run of `plan` with `options` writes to run.json (`tokenizer`: the one the run
    reads with; its files count by content)."""
    assert plan.task is not None, "a plan without a task is made one stage (trainer/prepare.py) before it runs"
    prepared = prepared_dir(plan.task, options.data, plan.chosen.layout.seq, vocab_size(plan))
    return fingerprint(plan, plan.chosen.layout, options, prepared, getattr(tokenizer, "path", None), digests)


def finished(run_dir: Path) -> bool:
    """Whether the run dir's summary.json says its run finished (False without a readable one)."""
    try:
        return json.loads((run_dir / SUMMARY_FILE).read_text()).get("finished") is True
    except (OSError, ValueError, AttributeError):
        return False


def held(plan: Plan, run_dir: Path, options: TrainOptions) -> Held:
    """What `run_dir` holds of the run `plan` with `options` would train there."""
    record = read_run(run_dir)
    if record is None or plan.task is None:
        return Held.OTHER
    current = run_fingerprint(plan, options, run_tokenizer(plan, options), saved_digests(run_dir))
    # compared as run.json stores it: JSON (tuples become lists)
    if record.get("fingerprint") != json.loads(json.dumps(current, default=str)):
        return Held.OTHER
    if finished(run_dir):
        return Held.FINISHED
    return Held.RESUMABLE if checkpoint.latest(run_dir / CHECKPOINTS_DIR) is not None else Held.OTHER
