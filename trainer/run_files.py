"""The run dir's files one training run writes and reads back (specs/run_dir.py names them).

Rank 0 writes; every rank may read what rank 0 broadcasts. Claiming the folder (this run's, or
refused) is collective: every rank raises the same refusal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specs.errors import UsageError
from specs.plan_file import Plan, load_plan
from specs.run_dir import (CHECKPOINTS_DIR, DATA_CACHE_DIR, EVENTS_FILE, METRICS_FILE, PLAN_FILE, STAGES_DIR,
                           SUMMARY_FILE, TENSORBOARD_DIR, JsonLines, MovedAsideEvent, RollbackEvent, events_of,
                           read_events)
from specs.task import check_stage_name
from trainer import checkpoint
from trainer.handoff import ARTIFACT_DIR, copy_model
from trainer.options import TrainOptions
from trainer.prepared import prepared_dir
from trainer.run_identity import claim, fingerprint, read_run, saved_digests
from trainer.scalars import ScalarLog


class RunFiles:
    """metrics.jsonl, events.jsonl, the TensorBoard scalars, the checkpoints' and the stages' folders."""

    def __init__(self, run_dir: Path, main: bool):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir, self.main = run_dir, main
        self.checkpoints = run_dir / CHECKPOINTS_DIR
        self.cache = run_dir / DATA_CACHE_DIR
        self.metrics = JsonLines(run_dir / METRICS_FILE, main)
        self.events = JsonLines(run_dir / EVENTS_FILE, main)
        self.scalars = ScalarLog(run_dir / TENSORBOARD_DIR, main)  # opens lazily, after any purge is set

    def logged(self, kind: type, key: str, here: dict[str, Any]) -> dict[str, Any]:
        """Per stage, `key` of the `kind` events of this process (`here`) and of earlier launches
        (segments, resumes) from the log."""
        events = events_of(read_events(self.events.path)[0], kind) if self.main else []
        logged = {e.stage: getattr(e, key) for e in events if getattr(e, key) is not None}
        return {**logged, **here}

    def rollbacks_logged(self) -> int:
        return len(events_of(read_events(self.events.path)[0], RollbackEvent)) if self.main else 0

    def stage_model_dir(self, stage: str) -> Path:
        """RUN/stages/<stage>/model/. The name was checked when the task was read; checked again here,
        where it becomes a path, so that no way around the loaders writes outside the run dir."""
        return self.run_dir / STAGES_DIR / check_stage_name(stage) / ARTIFACT_DIR

    def final_model(self, last_stage: str) -> str | None:
        """RUN/model/: the last stage's artifact (rank 0 links it there); its path in the run dir."""
        last = self.stage_model_dir(last_stage)
        if self.main and last.is_dir():
            copy_model(last, self.run_dir / ARTIFACT_DIR)
        return ARTIFACT_DIR if (self.run_dir / ARTIFACT_DIR).is_dir() else None

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.main:
            tmp = self.run_dir / f"{SUMMARY_FILE}.tmp"
            tmp.write_text(json.dumps(summary, indent=2))
            tmp.replace(self.run_dir / SUMMARY_FILE)

    def claim(self, plan: Plan, options: TrainOptions, tokenizer: Any, vocab: int,
              resume: bool) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Rank 0 makes the run dir this run's (run_identity.claim) and every rank takes its answer:
        a refusal is raised on all of them, the same line. The run's length as its checkpoint was
        trained (on a resume) and as asked now (trainer/run_identity.py `fingerprint`)."""
        refusal, saved_length, length = None, None, None
        if self.main:
            try:
                digests = saved_digests(self.run_dir)
                assert plan.task is not None
                prepared = prepared_dir(plan.task, options.data, plan.chosen.layout.seq, vocab)
                current = fingerprint(plan, plan.chosen.layout, options, prepared, getattr(tokenizer, "path", None),
                                      digests)
                length = current["length"]
                saved_length = (read_run(self.run_dir) or {}).get("fingerprint", {}).get("length") if resume else None
                moved = claim(self.run_dir, current, resume, options.overwrite, digests)
            except (UsageError, OSError) as exc:  # the other ranks wait for the answer: give them one
                refusal = str(exc)
            else:
                if moved is not None:
                    self.events.write(MovedAsideEvent(to=str(moved)))
                if not resume or _replanned(self.run_dir / PLAN_FILE, plan):
                    plan.write(self.run_dir / PLAN_FILE)  # the plan that runs now (a re-plan too)
        refusal, saved_length, length = checkpoint.broadcast((refusal, saved_length, length))
        if refusal is not None:
            raise UsageError(refusal)
        return saved_length, length


def _replanned(path: Path, plan: Plan) -> bool:
    """Whether the run dir's plan.yaml is missing or lays its stages out otherwise than `plan` (a plan
    re-made for another number of devices, resumed)."""
    try:
        return load_plan(path).stage_layouts() != plan.stage_layouts()
    except (OSError, ValueError, UsageError):
        return True
