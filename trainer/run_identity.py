"""Which run a run directory holds: `run.json` (a run id and a fingerprint), written at a fresh start.

A fresh start refuses a directory that holds another run (its checkpoints would be rotated, rolled
back to and resumed from as if they were this run's) unless `--overwrite` moves that run aside.
`--resume` refuses a checkpoint of another run: a different task, seed, model, sequence length,
global batch, engine, data (raw or prepared, and the files' content), weights or tokenizer (their
content) would silently reuse the old data positions and schedule, or fail deep inside a state-dict
load. The layout may change (an out-of-memory fallback, a re-plan), and so may the run's length (the
stages' steps, tokens or epochs, --epochs, --max-steps-per-stage) where the steps already trained keep
their learning rates (trainer/run_length.py checks that).

`run.json` is also the trust boundary: checkpoints hold pickled metadata (DCP, DeepSpeed), so
`--resume` loads them only from a directory whose `run.json` this trainer wrote, with the same
fingerprint. A restart by torchrun (TORCHELASTIC_RESTART_COUNT > 0) or a Slurm requeue
(SLURM_RESTART_COUNT > 0) is a resume.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil
import uuid
from pathlib import Path
from typing import Any

from specs import environment
from specs.errors import UsageError
from specs.plan_file import Plan
from specs.core import Layout
from specs.run_dir import (CHECKPOINTS_DIR, EVENTS_FILE, FEEDBACK_FILE, METRICS_FILE, MODEL_DIR, OOM_RELAUNCH_FILE,
                           PLAN_FILE, REPORT_DIR, RUN_FILE, STAGES_DIR, SUMMARY_FILE, TENSORBOARD_DIR, VERIFY_DIR,
                           VERIFY_FILE)
from trainer.data.sources import expand_source_path, file_type_of
from trainer.file_digests import FileDigests, combined
from trainer.options import TrainOptions

WRITER = "advisor-trainer/1"  # marks a run.json this code wrote
# What a run leaves in its directory (specs/run_dir.py, docs/contracts.md; `advisor run` adds
# verify/, verify.json, feedback.json and report/): moved aside together. Inputs that callers put there
# (plan.yaml, data/, data_cache/, logs/) stay; plan.yaml is copied aside, the new run rewrites it.
PRODUCTS = (RUN_FILE, METRICS_FILE, EVENTS_FILE, SUMMARY_FILE, CHECKPOINTS_DIR, TENSORBOARD_DIR, MODEL_DIR,
            STAGES_DIR, OOM_RELAUNCH_FILE, VERIFY_DIR, VERIFY_FILE, FEEDBACK_FILE, REPORT_DIR)
# What training writes over, appends to or prunes in its directory: found there without a run (a
# model/ copied in by hand, a run dir of another tool), each is moved aside, never replaced.
IN_THE_WAY = (MODEL_DIR, STAGES_DIR, CHECKPOINTS_DIR, SUMMARY_FILE, EVENTS_FILE, TENSORBOARD_DIR)
# ... and what `advisor run` writes over before training: a run it stopped after verification (a plan it
# could not price) leaves verify/ and verify.json alone, without a run.
RUN_CHAIN_IN_THE_WAY = (*IN_THE_WAY, VERIFY_DIR, VERIFY_FILE, FEEDBACK_FILE, REPORT_DIR)
# The fingerprint fields a resume must match, with the words a refusal uses for them. A field that an
# older run.json lacks is not compared (its run resumes as that trainer checked it).
MUST_MATCH = {"task": "task", "seed": "seed", "model": "model", "seq_len": "sequence length",
              "global_batch": "global batch", "engine": "engine", "data_source": "data (its kind or content)",
              "weights": "weights (their content)", "tokenizer": "tokenizer (its content)",
              "trust_remote_code": "--trust-remote-code setting"}
# Fields of a task's stage that size it: a resume may change them (`length`: trainer/run_length.py checks the steps
# already trained keep their learning rates); everything else of the task decides the stream.
LENGTH_FIELDS = {"steps", "tokens", "epochs"}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _raw_files(plan: Plan) -> list[Path]:
    """Every source file of the task (training and evaluation)."""
    files = []
    task = plan.task
    if task is not None:
        for stage in task.stages:
            for source in [*stage.sources, *stage.eval_sources]:
                files += [path for path in expand_source_path(Path(task.base_dir), source.path,
                                                              file_type_of(Path(task.base_dir), source))
                          if path.is_file()]
    return files


def _prepared_files(prepared: Path) -> list[Path]:
    """A prepared folder's manifest and every shard it lists (a run dir's one-stage view lists the
    shards of the folder it was made from)."""
    manifest = prepared / "manifest.json"
    paths: list[Path] = [manifest]

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if isinstance(value.get("path"), str):
                paths.append(prepared / value["path"])  # an absolute path stays itself
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(json.loads(manifest.read_text()).get("stages", []))
    return [p for p in paths if p.is_file()]


def data_source(plan: Plan, prepared: Path | None, digests: FileDigests) -> str:
    """What the run reads, by content: raw or prepared (the default switches to prepared data once
    `advisor data prepare` has run), the task's source files, and the prepared manifest and shards."""
    base = Path(plan.task.base_dir) if plan.task else Path.cwd()

    def named(path: Path) -> list[str]:
        where = path.resolve()
        inside = where.is_relative_to(base.resolve())
        return [str(where.relative_to(base.resolve()) if inside else where), digests.of_file(path)]

    files = [named(p) for p in _raw_files(plan)]
    shards = [named(p) for p in _prepared_files(prepared)] if prepared is not None else []
    return combined(["prepared" if prepared is not None else "raw", files, shards])


def fingerprint(plan: Plan, layout: Layout, options: TrainOptions, prepared: Path | None, tokenizer: Path | None,
                digests: FileDigests) -> dict[str, Any]:
    """What decides a run's trajectory, hashed where the value is large (model config, task, files),
    and its `length`: per stage its planned steps and epochs, and the cap (--max-steps-per-stage)."""
    task = plan.task.model_dump(mode="json", exclude={"base_dir"}) if plan.task else None
    unsized = {**task, "stages": [{k: v for k, v in stage.items() if k not in LENGTH_FIELDS}
                                  for stage in task["stages"]]} if task else None
    weights = Path(options.weights) if options.weights else None
    epochs = [options.epochs or stage.epochs for stage in plan.task.stages] if plan.task else []
    return {"task": _digest(unsized), "task_sized": _digest(task), "seed": options.seed,
            "model": _digest([plan.model.hf_config, options.weights]),
            "seq_len": layout.seq, "global_batch": layout.global_batch, "engine": plan.engine,
            "data_source": data_source(plan, prepared, digests),
            "weights": digests.of_path(weights) if weights else None,
            "tokenizer": digests.of_path(tokenizer) if tokenizer else "bytes",
            # a built-in chat template (--template) renders other tokens from the same files
            "template": options.template,
            # whether the folders' own Python may run: a resume keeps what the run started with
            "trust_remote_code": options.trust_remote_code,
            "length": {"steps": [stage.steps for stage in plan.stages], "epochs": epochs,
                       "max_steps_per_stage": options.max_steps_per_stage},
            "layout": layout.short(), "model_name": plan.model.name, "task_name": plan.task.name if plan.task else None}


def restarted() -> bool:
    """Whether torchrun or Slurm restarted this job: the restart continues the run."""
    return any(_restart_count(name) > 0 for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))


def _restart_count(name: str) -> int:
    """A restart counter from the environment (0 when unset); a value that is not a whole number is
    refused in one line (guessing either way would resume a run by mistake or start one over it)."""
    return environment.whole_number(name) or 0


def read_run(run_dir: Path) -> dict[str, Any] | None:
    """The run.json this trainer wrote in `run_dir`, or None (absent, unreadable, or not ours)."""
    path = run_dir / RUN_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("writer") == WRITER else None


def holds_a_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a training run (this trainer's, or one from before run.json)."""
    checkpoints = run_dir / CHECKPOINTS_DIR
    return ((run_dir / RUN_FILE).exists() or (run_dir / METRICS_FILE).exists()
            or (checkpoints.is_dir() and any(checkpoints.glob("step-*"))))


def _stamp() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")


def move_aside(run_dir: Path) -> Path | None:
    """Move the run in `run_dir` (its PRODUCTS, and a copy of plan.yaml) into
    `run_dir/previous-<UTC time>/`; None when there is none. Nothing is deleted."""
    if not holds_a_run(run_dir):
        return None
    aside = run_dir / f"previous-{_stamp()}"
    aside.mkdir()
    if (run_dir / PLAN_FILE).is_file():
        shutil.copy2(run_dir / PLAN_FILE, aside / PLAN_FILE)
    for name in PRODUCTS:
        if (run_dir / name).exists():
            (run_dir / name).rename(aside / name)
    return aside


TRASH = "trash"


def retire_old_runs(run_dir: Path, keep: int) -> list[Path]:
    """Keep the newest `keep` runs moved aside (`previous-<UTC time>/`, whose names sort by time) and
    move the older ones into `run_dir/trash/`, which the caller names to the user: old runs would
    otherwise pile up without bound, and nothing is deleted that the user did not delete. Returns
    where each went."""
    previous = sorted(p for p in run_dir.glob("previous-*") if p.is_dir())
    retired = previous[:max(len(previous) - keep, 0)]
    if retired:
        (run_dir / TRASH).mkdir(exist_ok=True)
    return [path.rename(run_dir / TRASH / path.name) for path in retired]


def move_in_the_way_aside(run_dir: Path, names: tuple[str, ...] = IN_THE_WAY) -> list[Path]:
    """A directory that holds no run: what training would write over (`names`) renamed to
    `<name>.old-<UTC time>` beside it. Where they went, in order."""
    if holds_a_run(run_dir):
        return []
    stamp, moved = _stamp(), []
    for name in names:
        if (run_dir / name).exists() or (run_dir / name).is_symlink():
            aside = run_dir / f"{name}.old-{stamp}"
            (run_dir / name).rename(aside)
            moved.append(aside)
    return moved


def refuse_or_move_aside(run_dir: Path, resume: bool, overwrite: bool) -> Path | None:
    """Before a fresh start: move an old run aside (`overwrite`) or refuse it. Returns where it went.
    Without a run there is nothing to refuse: callers then move what is in training's way aside
    (`move_in_the_way_aside`)."""
    if resume or not holds_a_run(run_dir):
        return None
    if not overwrite:
        raise UsageError(f"{run_dir} already holds a training run: continue it with --resume, train into "
                         "another --out, or pass --overwrite to move it aside")
    return move_aside(run_dir)


def mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The first fingerprint field a resume may not change, in words, with both values; else None.
    A run.json from before `length` digested its task with the stages' lengths: compared as such."""
    if "length" not in saved and "task_sized" in current:
        current = {**current, "task": current["task_sized"]}
    for key, words in MUST_MATCH.items():
        if key in saved and saved.get(key) != current.get(key):
            return f"{words} ({key}: {saved.get(key)} in the run, {current.get(key)} now)"
    return None


def check_resume(run_dir: Path, current: dict[str, Any]) -> None:
    """Refuse to resume a run this trainer did not write, or one with another fingerprint."""
    record = read_run(run_dir)
    if record is None:
        if holds_a_run(run_dir):
            raise UsageError(f"--resume: {run_dir} has no {RUN_FILE} written by this trainer, so its checkpoints "
                             "are not trusted (they hold pickled data); start fresh with --overwrite")
        return  # nothing to resume: a fresh start
    differs = mismatch(record.get("fingerprint", {}), current)
    if differs is not None:
        raise UsageError(f"--resume: the run in {run_dir} has another {differs}; train into another --out, "
                         "or pass --overwrite without --resume to start over")


def write_run(run_dir: Path, current: dict[str, Any], digests: FileDigests | None = None) -> dict[str, Any]:
    """A new run id, this fingerprint and the file digests it was taken from."""
    record = {"writer": WRITER, "run_id": uuid.uuid4().hex,
              "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "fingerprint": current,
              "file_digests": digests.known if digests else {}}
    return _write_record(run_dir, record)


def update_length(run_dir: Path, length: dict[str, Any]) -> None:
    """A resume that changed the run's length (trainer/run_length.py allowed it): later resumes compare with it."""
    record = read_run(run_dir)
    if record is not None:
        record["fingerprint"]["length"] = length
        _write_record(run_dir, record)


def saved_digests(run_dir: Path) -> FileDigests:
    """The file digests the run's run.json keeps (none for a new run dir)."""
    record = read_run(run_dir) or {}
    return FileDigests(record.get("file_digests") if isinstance(record.get("file_digests"), dict) else None)


def _write_record(run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """run.json written aside and renamed into place."""
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(run_dir / RUN_FILE)
    return record


def claim(run_dir: Path, current: dict[str, Any], resume: bool, overwrite: bool,
          digests: FileDigests | None = None) -> Path | None:
    """Make `run_dir` this run's: check a resume, or start fresh (moving an old run aside when
    `overwrite`, refusing it otherwise; moving aside what is in the way of a new run) and write
    run.json. Returns where an old run (or the first thing in the way) went."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume:
        check_resume(run_dir, current)
        if read_run(run_dir) is None:  # nothing to resume: this is the run's fresh start
            moved = move_in_the_way_aside(run_dir)
            write_run(run_dir, current, digests)
            return moved[0] if moved else None
        return None
    moved = refuse_or_move_aside(run_dir, resume, overwrite) or next(iter(move_in_the_way_aside(run_dir)), None)
    write_run(run_dir, current, digests)
    return moved
