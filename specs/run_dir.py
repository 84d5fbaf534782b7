"""The run-dir contract: what `advisor train` and `advisor run` leave in a run directory.

Every module that reads or writes a run dir names its files here (`RunDir`, the `*_FILE` and `*_DIR`
names), reads and appends its JSON-lines files through `read_json_lines` / `JsonLines` (a torn or
unreadable line, left by a crash or a full disk mid-append, is skipped and counted, never fatal), and
writes and reads `events.jsonl` as the typed records below (`Event`): one pydantic model per event,
told apart by its `event` field. An event this code does not know (an older or a newer trainer's)
reads as `OtherEvent`, so a reader never crashes on another version's run dir.

`summary.json`'s per-segment figures are `SegmentFigures`: a segment is a stretch of steps trained
under one layout in one launch (a fresh start, a resume, an out-of-memory fallback: each starts one,
logged as a `segment_start` event), with the plan's prediction for that layout against the steps it
measured. docs/contracts.md's run-dir table is `files_table()` (tests/test_run_dir.py checks it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

# -- the files ---------------------------------------------------------------------------------------

RUN_FILE = "run.json"
PLAN_FILE = "plan.yaml"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
SUMMARY_FILE = "summary.json"
VERIFY_FILE = "verify.json"
FEEDBACK_FILE = "feedback.json"
OOM_RELAUNCH_FILE = "oom_relaunch.json"
LAUNCH_FILE = "launch.json"
LOCK_FILE = "run.lock"
CHECKPOINT_STATE_FILE = "trainer.json"  # in each checkpoints/<step>/
CHECKPOINTS_DIR = "checkpoints"
TENSORBOARD_DIR = "tensorboard"
MODEL_DIR = "model"
STAGES_DIR = "stages"
VERIFY_DIR = "verify"
REPORT_DIR = "report"
DATA_CACHE_DIR = "data_cache"
LOGS_DIR = "logs"


@dataclass(frozen=True)
class RunFile:
    """One entry of the run-dir contract, as docs/contracts.md lists it."""

    name: str
    writer: str
    what: str
    folder: bool = False


ENTRIES: tuple[RunFile, ...] = (
    RunFile(RUN_FILE, "train", "which run this is: run id, fingerprint, file digests (trainer/run_identity.py)"),
    RunFile(PLAN_FILE, "train, run", "the plan that runs now (a re-plan rewrites it)"),
    RunFile(METRICS_FILE, "train", "one line per optimizer step: step, stage, loss, lr, grad_norm, tokens_per_s, step_s"),
    RunFile(EVENTS_FILE, "train, run", "one line per event, typed by `event` (specs/run_dir.py `Event`)"),
    RunFile(SUMMARY_FILE, "train", "predicted against measured (whole run and per segment), per-stage results"),
    RunFile(VERIFY_FILE, "run", "the verification trials: predicted against measured per candidate"),
    RunFile(FEEDBACK_FILE, "run", "the profile's refit after training: factors and step-time error"),
    RunFile(OOM_RELAUNCH_FILE, "train", "the layout a rank out of memory asks the launcher to restart with"),
    RunFile(LAUNCH_FILE, "train", "what torchrun's workers run (`launch.node<N>.json` on node N > 0)"),
    RunFile(LOCK_FILE, "train", "held while a trainer runs in the dir (`run.node<N>.lock` on node N > 0)"),
    RunFile(CHECKPOINTS_DIR, "train", "`step-<n>/`: trainer.json (the loop state), manifest.json, the engine's state",
            folder=True),
    RunFile(TENSORBOARD_DIR, "train", "TensorBoard scalars next to metrics.jsonl", folder=True),
    RunFile(MODEL_DIR, "train", "the final artifact: an HF model folder, or a LoRA/QLoRA adapter", folder=True),
    RunFile(STAGES_DIR, "train", "`<stage>/model/`: the same artifact at every stage end", folder=True),
    RunFile(VERIFY_DIR, "run", "`<rank>/`: each verification trial's own run dir", folder=True),
    RunFile(REPORT_DIR, "run, report", "the run report (HTML and Markdown)", folder=True),
    RunFile(DATA_CACHE_DIR, "train", "tokenised raw data, reused by resumes and trials", folder=True),
    RunFile(LOGS_DIR, "train, run", "third-party warnings and the workers' output", folder=True),
)


# Any of these makes a directory a run dir to a reader (a crashed run may lack the others).
RUN_DIR_MARKERS = (PLAN_FILE, METRICS_FILE, EVENTS_FILE, SUMMARY_FILE)


def launch_file_name(node_rank: int = 0) -> str:
    """This node's launch file (nodes may share the run dir)."""
    return LAUNCH_FILE if node_rank == 0 else f"launch.node{node_rank}.json"


def lock_file_name(node_rank: int = 0) -> str:
    """This node's lock file (nodes may share the run dir)."""
    return LOCK_FILE if node_rank == 0 else f"run.node{node_rank}.lock"


def _path(name: str) -> property:
    return property(lambda self: self.root / name)


@dataclass(frozen=True)
class RunDir:
    """A run directory's paths by name: `RunDir(out).metrics` is `out/metrics.jsonl`."""

    root: Path

    run = _path(RUN_FILE)
    plan = _path(PLAN_FILE)
    metrics = _path(METRICS_FILE)
    events = _path(EVENTS_FILE)
    summary = _path(SUMMARY_FILE)
    verify = _path(VERIFY_FILE)
    feedback = _path(FEEDBACK_FILE)
    oom_relaunch = _path(OOM_RELAUNCH_FILE)
    checkpoints = _path(CHECKPOINTS_DIR)
    tensorboard = _path(TENSORBOARD_DIR)
    model = _path(MODEL_DIR)
    stages = _path(STAGES_DIR)
    verify_trials = _path(VERIFY_DIR)
    report = _path(REPORT_DIR)
    data_cache = _path(DATA_CACHE_DIR)
    logs = _path(LOGS_DIR)


def files_table() -> str:
    """The Markdown table of the run dir's entries (docs/contracts.md holds it between its markers)."""
    rows = ["| entry | written by | what it holds |", "| --- | --- | --- |"]
    for entry in ENTRIES:
        rows.append(f"| `{entry.name}{'/' if entry.folder else ''}` | {entry.writer} | {entry.what} |")
    return "\n".join(rows) + "\n"


# -- JSON lines ----------------------------------------------------------------------------------------


@dataclass
class JsonLinesRead:
    """A JSON-lines file's records, and how many lines were torn or unreadable (skipped)."""

    records: list[dict[str, Any]]
    skipped: int


def read_json_lines(path: Path) -> JsonLinesRead:
    """The records of a JSON-lines file (none when it is absent). A power cut or a full disk during an
    append leaves partial JSON or NUL bytes: such lines are counted in `skipped`; blank lines are not."""
    if not path.is_file():
        return JsonLinesRead([], 0)
    records, skipped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            skipped += 1
    return JsonLinesRead(records, skipped)


def last_json_line(path: Path, window: int = 4096) -> dict[str, Any] | None:
    """The last whole record of a JSON-lines file that is being appended to (None while there is none):
    read from its last `window` bytes, passing over a line being written."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - window))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:  # a line being written, or cut by the window
            continue
        if isinstance(record, dict):
            return record
    return None


class JsonLines:
    """Append-only JSON lines, one record per line, flushed per record (only where `enabled`: rank 0)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any] | BaseModel) -> None:
        self.write_all([record])

    def write_all(self, records: Iterable[dict[str, Any] | BaseModel]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                for record in records:
                    f.write(json.dumps(event_record(record) if isinstance(record, BaseModel) else record) + "\n")
                    f.flush()

    def read(self) -> JsonLinesRead:
        return read_json_lines(self.path) if self.enabled else JsonLinesRead([], 0)

    def truncate_after(self, step: int | None) -> int:
        """Drop what a crashed run logged after its last checkpoint, `step` (it is redone; None: keep
        every step), and torn lines; returns how many lines were torn."""
        if not self.enabled or not self.path.is_file():
            return 0
        read = read_json_lines(self.path)
        keep = [r for r in read.records if step is None or r.get("step", 0) <= step]
        if read.skipped or len(keep) < len(read.records):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
            tmp.replace(self.path)
        return read.skipped


# -- events ------------------------------------------------------------------------------------------------

Number = Union[int, float]  # kept as written: an int stays an int (the lines stay byte-identical)


class _Event(BaseModel):
    """Fields common to every event; keys this code does not know are kept (a newer writer's). A kind
    names its `event` value once, in its class statement: `class StopEvent(_Event, name="stop")`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    event: str = ""

    def __init_subclass__(cls, name: str | None = None, **kwargs: Any) -> None:
        # before pydantic reads the class's fields: `event` becomes that one value, a Literal, so that a
        # record of another kind never reads as this one (it stays the first field, as declared above)
        if name is not None:
            cls.__annotations__ = {**cls.__dict__.get("__annotations__", {}), "event": Literal[name]}
            cls.event = name
        super().__init_subclass__(**kwargs)

    @classmethod
    def event_name(cls) -> str:
        """The `event` value that marks this kind."""
        return cls.model_fields["event"].default


class _AtStep(_Event):
    """An event at some step of some stage of the run, either of which may be unknown."""

    step: int | None = None
    stage: str | None = None


class _InStage(_Event):
    """An event of one stage, at some step of it (where known)."""

    stage: str
    step: int | None = None


# A start or a resume, and what it finds in the run dir.

class ResumeEvent(_Event, name="resume"):
    from_: str | None = Field(None, alias="from")
    step: int | None = None
    note: str | None = None


class MovedAsideEvent(_Event, name="moved_aside"):
    to: str


class TornLinesEvent(_Event, name="torn_lines"):
    file: str
    skipped: int


class ReshardedEvent(_Event, name="resharded"):
    from_: str = Field(alias="from")
    saved_layout: str
    layout: str


class DataEvent(_Event, name="data"):
    source: str
    dir: str | None = None


class LengthChangedEvent(_Event, name="length_changed"):
    step: int
    stage_steps: list[int]
    was: list[int]


class SegmentStartEvent(_Event, name="segment_start"):
    """Steps after `step` are trained under `layout` (the plan's, or an out-of-memory fallback's),
    until the next segment_start: a fresh start, a resume or a fallback."""

    step: int
    stage: str | None
    layout: str
    why: Literal["start", "resume", "oom_fallback", "rollback"]  # rollback: to before the segment's start


# Checkpoints, and going back to one.

class CheckpointEvent(_AtStep, name="checkpoint"):
    step: int  # always known here
    path: str | None = None
    reason: str | None = None


class CheckpointDamagedEvent(_Event, name="checkpoint_damaged"):
    path: str
    problem: str


class RollbackEvent(_Event, name="rollback"):
    to: str | None = None
    step: int | None = None
    skipped: list[int] | None = None
    lr_scale: Number | None = None
    steps_back: int | None = None
    discarded: list[str] | None = None
    stage: str | None = None  # not written by the trainer: a reader may attribute one


# A stage's course.

class StageStartEvent(_InStage, name="stage_start"):
    step: int  # always known here
    steps: int | None = None
    epochs: Number | None = None
    lr: Number | None = None
    warmup_steps: int | None = None
    rows: dict[str, int] | None = None


class DataPaddingEvent(_Event, name="data_padding"):
    stage: str
    tokens: int
    slots: int
    padding_fraction: Number
    slots_unbucketed: int
    padding_fraction_unbucketed: Number
    slots_saved: int


class EvalEvent(_InStage, name="eval"):
    losses: dict[str, Number] | None = None
    exact_match: dict[str, Number | None] | None = None
    exact_match_note: str | None = None


class StageEndEvent(_InStage, name="stage_end"):
    epochs: dict[str, Number] | None = None


class ModelEvent(_InStage, name="model"):
    step: int  # always known here
    path: str
    kind: Literal["adapter", "full"]


# Giving up, falling back, a loss spike.

class StopEvent(_Event, name="stop"):
    reason: str


class OOMFallbackEvent(_AtStep, name="oom_fallback"):
    error: str | None = None
    failed: str | None = None
    replacement: str | None = None
    from_: str | None = Field(None, alias="from")
    skipped: list[str] = Field(default_factory=list)
    relaunch: bool | None = None  # asked of the launcher (several ranks), which logged it


class SpikeEvent(_AtStep, name="spike"):
    loss: Number | None = None
    grad_norm: Number | None = None
    reason: str | None = None


# `advisor run`: its verification trials and the profile's refit.

class VerifyEvent(_Event, name="verify"):
    """One `advisor run` verification trial (trainer/verify.py `Trial`)."""

    rank: int
    layout: str
    predicted_step_s: Number
    predicted_tokens_per_s: Number
    predicted_peak_bytes: int
    harness: str = ""
    threads: int = 0
    steps: int = 0
    measured_step_s: Number | None = None
    measured_tokens_per_s: Number | None = None
    steps_s: list[Number] = Field(default_factory=list)
    peak_bytes: int | None = None
    peak_source: str | None = None
    seconds: Number = 0.0
    error: str | None = None


class FeedbackEvent(_Event, name="feedback"):
    profile: str
    error_before: Any = None
    error_after: Any = None
    factors_after: Any = None


class OtherEvent(_Event):
    """An event this code does not know, or one whose fields it cannot read: kept as written."""


KNOWN_EVENTS = (ResumeEvent, TornLinesEvent, DataEvent, LengthChangedEvent, ReshardedEvent, MovedAsideEvent,
                CheckpointEvent, CheckpointDamagedEvent, StageStartEvent, EvalEvent, DataPaddingEvent, StageEndEvent,
                ModelEvent, OOMFallbackEvent, StopEvent, SpikeEvent, RollbackEvent, SegmentStartEvent, VerifyEvent,
                FeedbackEvent)
EVENT_NAMES = tuple(cls.event_name() for cls in KNOWN_EVENTS)


def _event_tag(value: Any) -> str:
    name = value.get("event") if isinstance(value, dict) else getattr(value, "event", None)
    return name if name in EVENT_NAMES else "other"


Event = Annotated[Union[tuple(Annotated[cls, Tag(cls.event_name())] for cls in KNOWN_EVENTS)
                        + (Annotated[OtherEvent, Tag("other")],)],  # type: ignore[misc]
                  Discriminator(_event_tag)]


class _EventLine(BaseModel):
    record: Event


def parse_event(record: dict[str, Any]) -> _Event:
    """The typed event of one events.jsonl record; `OtherEvent` for an unknown event, or for a known
    one whose fields do not read (written by another version)."""
    try:
        return _EventLine(record=record).record
    except ValidationError:
        return OtherEvent.model_validate({**record, "event": str(record.get("event", ""))})


def read_events(path: Path) -> tuple[list[_Event], int]:
    """events.jsonl's typed records, and how many lines were torn (skipped)."""
    read = read_json_lines(path)
    return [parse_event(r) for r in read.records], read.skipped


def event_record(event: BaseModel) -> dict[str, Any]:
    """The JSON object an event is written as: `event` first, then the fields it was given, in their
    declared order (unset optional fields are left out, as the trainer always wrote them)."""
    fields = event.model_dump(by_alias=True, exclude_unset=True, exclude={"event"})
    return {"event": getattr(event, "event"), **fields}


def events_of(events: Iterable[_Event], kind: type[_Event]) -> list[Any]:
    """The events of one kind, in their order."""
    return [e for e in events if isinstance(e, kind)]


# -- summary.json's per-segment figures ---------------------------------------------------------------------


class SegmentFigures(BaseModel):
    """One segment of a run in summary.json's `segments`: the plan's prediction for the layout that
    trained it against what its steps measured (the median step time after 2 warm-up steps)."""

    model_config = ConfigDict(extra="allow")

    first_step: int  # the first optimizer step trained in the segment (1-based, as metrics.jsonl counts)
    last_step: int | None  # None: the segment trained no step that was kept
    steps: int
    stages: list[str]
    layout: str
    why: str
    planned: bool  # the layout is the plan's for these stages (not an out-of-memory fallback)
    predicted: dict[str, Number | None]  # step_s, tokens_per_s, peak_bytes (None where the plan has none)
    measured: dict[str, Number | str | None]  # step_s, tokens_per_s; peak_bytes, peak_source: this launch's only


def matching_segment(summary: dict[str, Any], layout: str) -> SegmentFigures | None:
    """The segment of `summary` that trained `layout` (short form) as planned with the most steps
    measured: the pair a refit of that layout's prediction reads. None when no segment did."""
    segments = [SegmentFigures.model_validate(s) for s in summary.get("segments") or []]
    matching = [s for s in segments if s.layout == layout and s.planned and s.measured.get("step_s")]
    return max(matching, key=lambda s: s.steps, default=None)
