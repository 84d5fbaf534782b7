"""The run report: what a training run did against what its plan predicted.

Reads a run dir as its contract (specs/run_dir.py) describes it (plan.yaml, metrics.jsonl,
events.jsonl, checkpoints/, summary.json) and tolerates any optional piece missing: a run that
crashed has no summary, a hand-made dir may have only metrics. A torn last line of a JSON-lines
file (a crash mid-write) is skipped and reported, not fatal; an event of another trainer version
reads as an `OtherEvent`, shown nowhere but never fatal.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specs.errors import UsageError
from specs.plan_file import Plan, load_plan
from specs.core import GiB, read_user_yaml
from specs.run_dir import (CHECKPOINTS_DIR, EVENTS_FILE, FEEDBACK_FILE, METRICS_FILE, PLAN_FILE, RUN_DIR_MARKERS,
                           SUMMARY_FILE, VERIFY_FILE, CheckpointEvent, EvalEvent, RollbackEvent, SegmentFigures,
                           SpikeEvent, StageEndEvent, parse_event, read_json_lines)
from reports import charts
from reports.document import Cell, Document, Table, format_number, num, pct, text
from reports.skill_story import Scores, skill_stories


@dataclass
class RunData:
    run_dir: Path
    plan: Plan | None = None
    plan_raw: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    checkpoints: list[tuple[str, int]] = field(default_factory=list)  # (name, bytes) found on disk
    verify: dict[str, Any] | None = None  # verify.json: `advisor run`'s trials of the top plans
    feedback: dict[str, Any] | None = None  # feedback.json: the profile's refit after the run
    warnings: list[str] = field(default_factory=list)


def _json_lines(path: Path, warnings: list[str]) -> list[dict[str, Any]]:
    read = read_json_lines(path)
    records, bad = read.records, read.skipped
    if bad:
        warnings.append(f"{path.name}: skipped {bad} unreadable line{'s' if bad > 1 else ''}")
    return records


def _json_object(path: Path, warnings: list[str]) -> dict[str, Any] | None:
    """A JSON object file, or None when it is absent; unreadable files become a warning."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except ValueError:
        warnings.append(f"{path.name}: unreadable")
        return None
    return value if isinstance(value, dict) else None


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def read_run_dir(path: str | Path) -> RunData:
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise UsageError(f"run dir not found: {run_dir}")
    data = RunData(run_dir=run_dir)
    if not any((run_dir / name).exists() for name in RUN_DIR_MARKERS):
        raise UsageError(f"{run_dir} is not a run dir: it has none of {', '.join(RUN_DIR_MARKERS)}")
    plan_file = run_dir / PLAN_FILE
    if plan_file.is_file():
        try:
            data.plan = load_plan(plan_file)
        except UsageError as exc:  # another version's plan: keep what can be read
            data.warnings.append(f"{PLAN_FILE}: {exc}")
            try:
                raw = read_user_yaml(plan_file, f"plan file {plan_file}")
                data.plan_raw = raw if isinstance(raw, dict) else None
            except UsageError:
                pass
    data.metrics = [m for m in _json_lines(run_dir / METRICS_FILE, data.warnings) if "step" in m]
    data.events = _json_lines(run_dir / EVENTS_FILE, data.warnings)
    summary_file = run_dir / SUMMARY_FILE
    if summary_file.is_file():
        try:
            summary = json.loads(summary_file.read_text())
            data.summary = summary if isinstance(summary, dict) else None
        except ValueError:
            data.warnings.append(f"{SUMMARY_FILE}: unreadable (the run may have stopped while writing it)")
    data.verify = _json_object(run_dir / VERIFY_FILE, data.warnings)
    data.feedback = _json_object(run_dir / FEEDBACK_FILE, data.warnings)
    ckpt_dir = run_dir / CHECKPOINTS_DIR
    if ckpt_dir.is_dir():
        data.checkpoints = sorted(((p.name, _dir_bytes(p)) for p in ckpt_dir.iterdir()), key=lambda c: c[0])
    return data


# ------------------------------------------------------------------------------------------------
# what the run did


def _event_kind(event: dict[str, Any]) -> str:
    """The event's name, as its typed record reads it (an unknown one keeps its own)."""
    return parse_event(event).event


def _of_kind(events: list[dict[str, Any]], kind: type) -> list[dict[str, Any]]:
    """The events (as written) whose typed record is a `kind`."""
    return [e for e in events if isinstance(parse_event(e), kind)]


def _finite(values: list[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


@dataclass
class Comparison:
    name: str
    key: str
    unit: str
    predicted: float | None
    measured: float | None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.predicted and self.measured is not None:
            return self.measured / self.predicted
        return None


@dataclass
class StageResult:
    name: str
    planned_steps: int | None
    steps: int
    first_loss: float | None
    final_loss: float | None
    min_loss: float | None
    peak_lr: float | None
    final_lr: float | None
    tokens_per_s: float | None  # median
    spikes: int
    rollbacks: int
    checkpoints: int


@dataclass
class RunAnalysis:
    data: RunData
    comparisons: list[Comparison]
    stages: list[StageResult]
    spikes: list[dict[str, Any]]
    rollbacks: list[dict[str, Any]]
    checkpoint_events: list[dict[str, Any]]
    evals: dict[str, dict[str, float]]  # after stage -> skill -> eval loss
    finished: bool | None
    steps: int
    # after stage -> skill -> greedy exact match (None: the skill's eval rows have no answers)
    exact_match: dict[str, dict[str, float | None]] = field(default_factory=dict)
    exact_match_note: str | None = None  # why exact match was not scored (a pipeline engine)
    epochs: dict[str, dict[str, float]] = field(default_factory=dict)  # stage -> source -> passes over it


def _stage_names(data: RunData) -> list[str]:
    names: list[str] = []
    if data.plan and data.plan.task:
        names = [s.name for s in data.plan.task.stages]
    elif data.summary and isinstance(data.summary.get("stages"), list):
        names = [str(s.get("name")) for s in data.summary["stages"] if isinstance(s, dict) and s.get("name")]
    for m in data.metrics:  # stages the plan does not name (or no plan): in order of appearance
        if m.get("stage") is not None and str(m["stage"]) not in names:
            names.append(str(m["stage"]))
    return names


def _stage_at(step: Any, metrics: list[dict[str, Any]]) -> str | None:
    """The stage that a step belongs to: the stage of the last logged step at or before it."""
    if not isinstance(step, (int, float)):
        return None
    before = [m for m in metrics if m["step"] <= step]
    after = [m for m in metrics if m["step"] > step]
    pick = before[-1] if before else (after[0] if after else None)
    return str(pick["stage"]) if pick and pick.get("stage") is not None else None


def analyse(data: RunData) -> RunAnalysis:
    summary = data.summary or {}
    metrics = sorted(data.metrics, key=lambda m: m["step"])
    comparisons = _comparisons(data, summary, metrics)
    events = data.events
    spikes = _of_kind(events, SpikeEvent)
    rollbacks = _of_kind(events, RollbackEvent)
    checkpoint_events = _of_kind(events, CheckpointEvent)
    _give_rollbacks_a_stage(events, spikes, rollbacks, metrics)  # before the stages count them
    evals = _evals(events, summary)
    exact_match, epochs = _stage_results(events, summary)
    planned = {s.name: s.steps for s in data.plan.stages} if data.plan else {}
    stages = [_stage_result(name, metrics, planned.get(name), spikes, rollbacks, checkpoint_events)
              for name in _stage_names(data)]
    finished = summary.get("finished") if isinstance(summary.get("finished"), bool) else None
    if finished is None and data.plan and data.plan.stages and stages:
        ends = {str(e.get("stage")) for e in _of_kind(events, StageEndEvent)}
        finished = all(s.name in ends for s in data.plan.stages) if ends else None
    steps = int(summary["steps"]) if isinstance(summary.get("steps"), int) else (
        int(metrics[-1]["step"]) if metrics else 0)
    note = summary.get("exact_match_note") or next(
        (e["exact_match_note"] for e in _of_kind(events, EvalEvent) if e.get("exact_match_note")), None)
    return RunAnalysis(data=data, comparisons=comparisons, stages=stages, spikes=spikes, rollbacks=rollbacks,
                       checkpoint_events=checkpoint_events, evals=evals, finished=finished, steps=steps,
                       exact_match=exact_match, exact_match_note=note, epochs=epochs)


def _comparisons(data: RunData, summary: dict[str, Any], metrics: list[dict[str, Any]]) -> list[Comparison]:
    """Peak memory, step time and throughput: summary.json's prediction (else the plan's estimate)
    against summary.json's measurement (else the median of metrics.jsonl)."""
    predicted = summary.get("predicted") if isinstance(summary.get("predicted"), dict) else {}
    measured = summary.get("measured") if isinstance(summary.get("measured"), dict) else {}
    plan_est = data.plan.chosen.estimate if data.plan else None

    def pick(source: dict[str, Any], key: str) -> float | None:
        value = source.get(key)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None

    step_times = _finite([m.get("step_s") for m in metrics])
    tps = _finite([m.get("tokens_per_s") for m in metrics])
    pred_peak = pick(predicted, "peak_bytes") or (float(plan_est.memory.peak) if plan_est else None)
    pred_step = pick(predicted, "step_s") or (plan_est.time.step_s if plan_est else None)
    pred_tps = pick(predicted, "tokens_per_s") or (plan_est.throughput.tokens_per_s if plan_est else None)
    meas_step = pick(measured, "step_s")
    meas_tps = pick(measured, "tokens_per_s")
    from_metrics = "median of " + METRICS_FILE
    return [
        Comparison("peak memory", "peak_bytes", "GiB per device", pred_peak, pick(measured, "peak_bytes"),
                   str(measured.get("peak_source") or "")),
        Comparison("step time", "step_s", "s", pred_step,
                   meas_step if meas_step is not None else (statistics.median(step_times) if step_times else None),
                   SUMMARY_FILE if meas_step is not None else (from_metrics if step_times else "")),
        Comparison("throughput", "tokens_per_s", "tokens/s", pred_tps,
                   meas_tps if meas_tps is not None else (statistics.median(tps) if tps else None),
                   SUMMARY_FILE if meas_tps is not None else (from_metrics if tps else "")),
    ]


def _give_rollbacks_a_stage(events: list[dict[str, Any]], spikes: list[dict[str, Any]],
                            rollbacks: list[dict[str, Any]], metrics: list[dict[str, Any]]) -> None:
    """The trainer's rollback names the checkpoint it returns to, not the stage: it belongs to the
    spike that caused it (the checkpoint may be the previous stage's last one), else to its step.
    Sets the stage on the rollback events in place."""
    last_spike_stage = None
    for e in events:
        if e in spikes:
            last_spike_stage = e.get("stage")
        elif e in rollbacks and e.get("stage") is None:
            e["stage"] = last_spike_stage if last_spike_stage is not None else _stage_at(e.get("step"), metrics)


def _evals(events: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """After stage -> skill -> eval loss: the eval events, else summary.json's per-stage eval."""
    evals: dict[str, dict[str, float]] = {}
    for e in _of_kind(events, EvalEvent):
        if isinstance(e.get("losses"), dict) and e.get("stage") is not None:
            evals[str(e["stage"])] = {str(k): float(v) for k, v in e["losses"].items() if isinstance(v, (int, float))}
    for s in summary.get("stages") or []:
        if isinstance(s, dict) and s.get("name") and isinstance(s.get("eval"), dict) and s["eval"]:
            evals.setdefault(str(s["name"]), {str(k): float(v) for k, v in s["eval"].items()
                                               if isinstance(v, (int, float))})
    return evals


def _stage_result(name: str, metrics: list[dict[str, Any]], planned_steps: int | None, spikes: list[dict[str, Any]],
                  rollbacks: list[dict[str, Any]], checkpoint_events: list[dict[str, Any]]) -> StageResult:
    """One stage's figures from its logged steps, and its share of the spikes, rollbacks and checkpoints."""
    rows = [m for m in metrics if str(m.get("stage")) == name]
    losses = _finite([m.get("loss") for m in rows])
    lrs = _finite([m.get("lr") for m in rows])
    stage_tps = _finite([m.get("tokens_per_s") for m in rows])
    return StageResult(
        name=name, planned_steps=planned_steps, steps=len(rows),
        first_loss=losses[0] if losses else None, final_loss=losses[-1] if losses else None,
        min_loss=min(losses) if losses else None, peak_lr=max(lrs) if lrs else None,
        final_lr=lrs[-1] if lrs else None, tokens_per_s=statistics.median(stage_tps) if stage_tps else None,
        spikes=sum(1 for e in spikes if str(e.get("stage")) == name),
        rollbacks=sum(1 for e in rollbacks if str(e.get("stage")) == name),
        checkpoints=sum(1 for e in checkpoint_events if str(e.get("stage")) == name))


def _stage_results(events: list[dict[str, Any]], summary: dict[str, Any]) -> tuple[dict, dict]:
    """Per stage: exact match per skill (eval events, else summary.json) and epochs per source
    (stage_end events, else summary.json)."""

    def numbers(values: Any, keep_none: bool) -> dict[str, float | None]:
        return {str(k): (float(v) if isinstance(v, (int, float)) else None) for k, v in values.items()
                if isinstance(v, (int, float)) or (keep_none and v is None)}

    exact: dict[str, dict[str, float | None]] = {}
    epochs: dict[str, dict[str, float]] = {}
    for e in events:
        if e.get("stage") is None:
            continue
        kind = _event_kind(e)
        if kind == EvalEvent.event_name() and isinstance(e.get("exact_match"), dict):
            exact[str(e["stage"])] = numbers(e["exact_match"], keep_none=True)
        elif kind == StageEndEvent.event_name() and isinstance(e.get("epochs"), dict):
            epochs[str(e["stage"])] = numbers(e["epochs"], keep_none=False)  # type: ignore[assignment]
    for s in summary.get("stages") or []:
        if isinstance(s, dict) and s.get("name"):
            if isinstance(s.get("exact_match"), dict) and s["exact_match"]:
                exact.setdefault(str(s["name"]), numbers(s["exact_match"], keep_none=True))
            if isinstance(s.get("epochs"), dict) and s["epochs"]:
                epochs.setdefault(str(s["name"]), numbers(s["epochs"], keep_none=False))  # type: ignore[arg-type]
    return exact, epochs


# ------------------------------------------------------------------------------------------------
# the page


def _exact_match_section(doc: Document, a: RunAnalysis) -> None:
    """Greedy exact match per skill after each stage (n/a: the skill's held-out rows have no answers),
    and the passes each stage made over its sources."""
    if a.exact_match:
        skills = list(dict.fromkeys(skill for scores in a.exact_match.values() for skill in scores))
        rows = [[text(f"after {stage}")] + [pct(scores[skill], f"exact:{stage}:{skill}")
                                            if scores.get(skill) is not None else text("n/a") for skill in skills]
                for stage, scores in a.exact_match.items()]
        doc.table(Table(["exact match"] + skills, rows, id="exact-match",
                        caption="greedy answers to each skill's held-out prompts that equal the reference exactly; "
                                "n/a: its held-out rows have no prompt and answer"))
    elif a.exact_match_note:
        doc.p(f"Exact match {a.exact_match_note}.", id="exact-match")
    if a.epochs:
        rows = [[text(stage), text(source, wrap=True), num(passes, f"epochs:{stage}:{source}")]
                for stage, sources in a.epochs.items() for source, passes in sources.items()]
        doc.table(Table(["stage", "source", "epochs"], rows, id="epochs",
                        caption="passes each stage made over each of its sources (every row once per epoch)"))


def _scaled(c: Comparison, value: float | None) -> float | None:
    if value is None:
        return None
    return value / GiB if c.unit.startswith("GiB") else value


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:,.3g} {unit}"
    return f"{n:,.0f}"


def _verdict(a: RunAnalysis) -> str:
    parts = []
    state = {True: "finished", False: "did not finish", None: "has no summary (still running, or it crashed)"}
    planned = sum(s.planned_steps or 0 for s in a.stages)
    parts.append(f"The run {state[a.finished]}: {a.steps:,} optimizer steps"
                 + (f" of {planned:,} planned" if planned else "")
                 + f", {len(a.spikes)} loss spike{'s' if len(a.spikes) != 1 else ''}, "
                 f"{len(a.rollbacks)} rollback{'s' if len(a.rollbacks) != 1 else ''}.")
    for c in a.comparisons:
        if c.ratio is not None:
            parts.append(f"Measured {c.name} is {100 * (c.ratio - 1):+.0f}% against the prediction "
                         f"({format_number(_scaled(c, c.measured) or 0)} vs "
                         f"{format_number(_scaled(c, c.predicted) or 0)}"
                         f" {c.unit}).")
    peak = a.comparisons[0]
    if peak.note and "rss" in peak.note.lower():
        parts.append("Peak memory on CPU is the process's resident set, which also counts Python and libraries: "
                     "it over-reads tensor memory, so a measured peak above the prediction is expected there.")
    return " ".join(parts)


def run_document(a: RunAnalysis) -> Document:
    """The page an engineer checks after a run, one section after another."""
    data = a.data
    raw_model = (data.plan_raw or {}).get("model")
    title_model = (data.plan.model.name if data.plan
                   else (raw_model.get("name", "?") if isinstance(raw_model, dict) else "?"))
    doc = Document(f"Run report: {data.run_dir.name}",
                   f"{title_model}; run dir {data.run_dir}")
    doc.h2("Summary", id="summary-heading")
    doc.callout(_verdict(a), id="verdict")
    if data.warnings:
        doc.bullets([f"warning: {w}" for w in data.warnings], id="warnings")
    _comparison_section(doc, a)
    _verification_section(doc, data)
    _stages_section(doc, a)
    _spikes_section(doc, a)
    _checkpoints_section(doc, a)
    _eval_section(doc, a)
    _exact_match_section(doc, a)
    _story_section(doc, a)
    _plan_section(doc, data)
    return doc


def _comparison_section(doc: Document, a: RunAnalysis) -> None:
    """Predicted against measured peak memory, step time and throughput, and where each measurement came from."""
    doc.h2("Predicted against measured", id="comparison-heading")
    rows = []
    for c in a.comparisons:
        rows.append([text(f"{c.name} ({c.unit})"), num(_scaled(c, c.predicted), f"predicted:{c.key}"),
                     num(_scaled(c, c.measured), f"measured:{c.key}"), num(c.ratio, f"ratio:{c.key}")])
    doc.table(Table(["quantity", "predicted", "measured", "ratio"], rows, id="comparison",
                    caption="predicted: the plan's cost model for the layout that ran; ratio: measured / predicted"))
    sources = [f"{c.name}: {c.note}" for c in a.comparisons if c.note and c.measured is not None]
    if sources:
        doc.p("Measured from " + "; ".join(sources) + ".", id="sources")
    if any(c.predicted is not None or c.measured is not None for c in a.comparisons):
        doc.figure("predicted_measured", charts.predicted_measured_chart(
            [(f"{c.name} ({c.unit})", _scaled(c, c.predicted), _scaled(c, c.measured)) for c in a.comparisons]),
            "Predicted and measured peak memory, step time and throughput.")
    _segments_table(doc, a)


def _segments_table(doc: Document, a: RunAnalysis) -> None:
    """Step time per segment (summary.json `segments`) when more than one layout or launch trained
    the run: each layout's prediction against the steps it trained."""
    segments = []
    for entry in (a.data.summary or {}).get("segments") or []:
        try:
            segments.append(SegmentFigures.model_validate(entry))
        except ValueError:  # another version's entry: the whole-run figures above still hold
            continue
    if len(segments) < 2:
        return
    rows = []
    for i, seg in enumerate(segments):
        predicted, measured = seg.predicted.get("step_s"), seg.measured.get("step_s")
        ratio = measured / predicted if isinstance(measured, (int, float)) and predicted else None
        rows.append([text(f"{seg.first_step}-{seg.last_step if seg.last_step is not None else '-'}"),
                     text(seg.layout, wide=True), text(seg.why + ("" if seg.planned else " (not the plan's)")),
                     num(seg.steps), num(predicted, f"segment:{i}:predicted:step_s"),
                     num(measured, f"segment:{i}:measured:step_s"), num(ratio)])
    doc.table(Table(["steps", "layout", "why", "steps trained", "predicted step (s)", "measured step (s)", "ratio"],
                    rows, id="segments", caption="per segment: one layout in one launch; measured: the median "
                                                 "step after 2 warm-up steps"))


def _stages_section(doc: Document, a: RunAnalysis) -> None:
    """Each stage's figures, and the loss and learning-rate curves over every logged step."""
    doc.h2("Loss and learning rate per stage", id="stages-heading")
    if a.stages:
        rows = []
        for s in a.stages:
            k = f"stage:{s.name}"
            rows.append([text(s.name), num(s.planned_steps, f"{k}:planned_steps"), num(s.steps, f"{k}:steps"),
                         num(s.first_loss, f"{k}:first_loss"), num(s.final_loss, f"{k}:final_loss"),
                         num(s.min_loss, f"{k}:min_loss"), num(s.peak_lr, f"{k}:peak_lr"),
                         num(s.final_lr, f"{k}:final_lr"), num(s.tokens_per_s, f"{k}:tokens_per_s"),
                         num(s.spikes, f"{k}:spikes"), num(s.rollbacks, f"{k}:rollbacks"),
                         num(s.checkpoints, f"{k}:checkpoints")])
        doc.table(Table(["stage", "planned steps", "steps", "first loss", "final loss", "min loss", "peak lr",
                         "final lr", "tokens/s", "spikes", "rollbacks", "checkpoints"], rows, id="stages"))
    metrics = sorted(a.data.metrics, key=lambda m: m["step"])
    _curves(doc, a, metrics)
    if not metrics:
        doc.p("No metrics.jsonl: the run logged no optimizer step.", id="no-metrics")


def _curves(doc: Document, a: RunAnalysis, metrics: list[dict[str, Any]]) -> None:
    """The loss chart (with the rejected spikes and the rollbacks) and the learning-rate chart."""
    with_loss = [m for m in metrics if isinstance(m.get("loss"), (int, float))]
    if with_loss:
        spikes = [(int(e["step"]), float(e["loss"])) for e in a.spikes
                  if isinstance(e.get("step"), (int, float)) and isinstance(e.get("loss"), (int, float))
                  and math.isfinite(e["loss"])]
        rollback_steps = [int(e["step"]) for e in a.rollbacks if isinstance(e.get("step"), (int, float))]
        doc.figure("loss", charts.loss_chart([int(m["step"]) for m in with_loss], [float(m["loss"]) for m in with_loss],
                                             [str(m.get("stage")) for m in with_loss], spikes, rollback_steps),
                   "Training loss per optimizer step by stage; crosses are rejected spikes, dashed lines rollbacks.")
    with_lr = [m for m in metrics if isinstance(m.get("lr"), (int, float))]
    if with_lr:
        doc.figure("lr", charts.lr_chart([int(m["step"]) for m in with_lr], [float(m["lr"]) for m in with_lr],
                                         [str(m.get("stage")) for m in with_lr]),
                   "Learning rate per optimizer step.")


def _spikes_section(doc: Document, a: RunAnalysis) -> None:
    """Every rejected spike and rollback, in the order they happened."""
    doc.h2("Spikes and rollbacks", id="spikes-heading")
    if not (a.spikes or a.rollbacks):
        doc.p("No loss spikes, no rollbacks.", id="spikes")
        return
    rows = []
    for e in (e for e in a.data.events if e in a.spikes or e in a.rollbacks):  # in the order they happened
        kind = _event_kind(e)
        detail = (str(e.get("reason") or "") if kind == SpikeEvent.event_name() else
                  f"to {e.get('to', '?')}" + (f", skipped data {e['skipped']}" if e.get("skipped") else "")
                  + (f", lr x {e['lr_scale']:g}" if isinstance(e.get("lr_scale"), (int, float)) else ""))
        rows.append([text(kind), num(e.get("step")), text(str(e.get("stage") or "-")),
                     num(e.get("loss")) if isinstance(e.get("loss"), (int, float)) else text("-"),
                     num(e.get("grad_norm")) if isinstance(e.get("grad_norm"), (int, float)) else text("-"),
                     text(detail or "-", wide=True)])
    doc.table(Table(["event", "step", "stage", "loss", "grad norm", "detail"], rows, id="spikes"))


def _checkpoints_section(doc: Document, a: RunAnalysis) -> None:
    """The checkpoints the run wrote (events.jsonl) and those still on disk (checkpoints/)."""
    data = a.data
    doc.h2("Checkpoints", id="checkpoints-heading")
    on_disk = dict(data.checkpoints)
    if a.checkpoint_events:
        rows = []
        for e in a.checkpoint_events:
            name = Path(str(e.get("path") or "")).name
            size = on_disk.get(name)
            rows.append([num(e.get("step")), text(str(e.get("stage") or "-")), text(str(e.get("reason") or "-")),
                         text(str(e.get("path") or "-")),
                         num(size / 2**20) if size is not None else text("pruned" if data.checkpoints else "-")])
        doc.table(Table(["step", "stage", "reason", "path", "on disk (MiB)"], rows, id="checkpoints"))
    if data.checkpoints:
        doc.p(f"{len(data.checkpoints)} checkpoint{'s' if len(data.checkpoints) != 1 else ''} on disk in "
              f"checkpoints/: " + ", ".join(f"{n} ({s / 2**20:,.1f} MiB)" for n, s in data.checkpoints) + ".",
              id="checkpoints-on-disk")
    elif not a.checkpoint_events:
        doc.p("No checkpoints recorded.", id="checkpoints")


def _story_section(doc: Document, a: RunAnalysis) -> None:
    """Per skill: learned in its own stage, forgotten by the later ones, healed by the mixed stage
    (reports/skill_story.py), in exact match and eval loss; the exact match after every stage as a chart."""
    order = list(dict.fromkeys([*a.evals, *a.exact_match]))
    stages = [{"name": stage, "eval": a.evals.get(stage) or {}, "exact_match": a.exact_match.get(stage) or {}}
              for stage in order]
    stories = skill_stories(stages)
    if not stories:
        return

    def cell(scores: Scores | None, key: str) -> list[Cell]:
        if scores is None:
            return [text("-"), text("-")]
        return [pct(scores.exact_match, f"{key}:exact") if scores.exact_match is not None else text("n/a"),
                num(scores.loss, f"{key}:loss")]

    rows = []
    for story in stories:
        forgot, healed = story.forgetting(), story.healed()
        rows.append([text(story.skill), *cell(story.own, f"story:{story.skill}:own"),
                     text(story.worst.stage if story.worst else "-"), *cell(story.worst, f"story:{story.skill}:worst"),
                     *cell(story.end, f"story:{story.skill}:end"),
                     *cell(forgot, f"story:{story.skill}:forgetting"), *cell(healed, f"story:{story.skill}:healed")])
    doc.table(Table(["skill", "own stage: exact", "own stage: loss", "worst later stage", "worst: exact",
                     "worst: loss", "end: exact", "end: loss", "forgot: exact", "forgot: loss", "healed: exact",
                     "healed: loss"], rows, id="skill-story",
                    caption="each skill after its own stage, after the later stage where it was worst (before a "
                            "closing mixed stage) and at the end; forgot: exact match lost and loss gained from "
                            "its own stage to the worst; healed: what the closing mixed stage gave back"))
    shares = {(st, sk): v for st, d in a.exact_match.items() for sk, v in d.items() if v is not None}
    if shares:
        skills = list(dict.fromkeys(sk for _, sk in shares))
        doc.figure("exact-match", charts.exact_match_chart(list(a.exact_match), skills, shares),
                   "Exact match of each skill after each stage: learned in its stage, forgotten, healed.")


def _eval_section(doc: Document, a: RunAnalysis) -> None:
    """Eval loss of each skill after each stage, and the skills whose loss rose again (forgetting)."""
    doc.h2("Per-skill evaluation", id="eval-heading")
    if not a.evals:
        doc.p("No evaluation results in events.jsonl or summary.json.", id="eval")
        return
    skills = list(dict.fromkeys(skill for losses in a.evals.values() for skill in losses))
    after = list(a.evals)
    rows = [[text(f"after {stage}")] + [num(a.evals[stage].get(skill), f"eval:{stage}:{skill}")
                                        for skill in skills] for stage in after]
    doc.table(Table(["eval loss"] + skills, rows, id="eval",
                    caption="rows: when the evaluation ran; columns: the skill (stage) whose held-out data "
                            "it used"))
    doc.bullets(_forgetting(a.evals, skills, after), id="forgetting")
    doc.figure("eval", charts.eval_chart(after, skills, {(st, sk): v for st, d in a.evals.items()
                                                       for sk, v in d.items()}),
               "Eval loss of each skill after each stage; a bar that grows in later stages is forgetting.")


def _forgetting(evals: dict[str, dict[str, float]], skills: list[str], after: list[str]) -> list[str]:
    """Skills whose last eval loss is more than 2% above their best one."""
    forgetting = []
    for skill in skills:
        seen = [(stage, evals[stage][skill]) for stage in after if skill in evals[stage]]
        if len(seen) > 1:
            best_stage, best = min(seen, key=lambda x: x[1])
            last_stage, last = seen[-1]
            if last > best * 1.02:
                forgetting.append(f"{skill}: eval loss rose from {format_number(best)} (after {best_stage}) to "
                                  f"{format_number(last)} (after {last_stage}): forgetting")
    return forgetting


def _plan_section(doc: Document, data: RunData) -> None:
    """The plan that ran: model, hardware, layout and stages, or what an unreadable plan.yaml holds."""
    doc.h2("The plan that ran", id="plan-heading")
    plan = data.plan
    if not plan:
        if data.plan_raw:
            doc.p("plan.yaml could not be read as a plan of this version; its layout: "
                  f"`{json.dumps((data.plan_raw.get('chosen') or {}).get('layout', {}))}`", id="plan")
        else:
            doc.p("No plan.yaml in the run dir.", id="plan")
        return
    est = plan.chosen.estimate
    doc.table(Table(["", PLAN_FILE], [
        [text("model"), text(f"{plan.model.name} ({_count(est.model.params)} parameters, "
                             f"{_count(est.model.trainable_params)} trainable)", wrap=True)],
        [text("hardware"), text(f"{plan.nodes} x {plan.gpus_per_node} {plan.hardware.name} "
                                f"({plan.hardware.source})")],
        [text("layout"), text(f"`{plan.chosen.layout.short()}`", wide=True)],
        [text("why"), text(plan.chosen.why, wide=True)],
        [text("task"), text(plan.task.name if plan.task else "-")],
    ], id="plan"))
    if plan.stages:
        rows = [[text(s.name), text(s.method), num(s.devices), num(s.tokens), num(s.steps),
                 num(s.step_s), num(s.checkpoint_every_steps), pct(s.overhead_fraction),
                 text("; ".join(s.flags) or "-", wrap=True)] for s in plan.stages]
        doc.table(Table(["stage", "method", "devices", "tokens", "steps", "step s", "ckpt every", "overhead",
                         "flags"], rows, id="plan-stages"))
    doc.bullets([f"note: {n}" for n in plan.notes])


def _verification_section(doc: Document, data: RunData) -> None:
    """`advisor run` only: the top plans timed before training, and the profile's refit after."""
    if data.verify is None and data.feedback is None:
        return
    doc.h2("Verification and feedback", id="verify-heading")
    trials = (data.verify or {}).get("trials") or []
    if trials:
        chosen = (data.verify or {}).get("chosen_rank")
        rows = [[num(t.get("rank")), text(f"`{t.get('layout', '?')}`" + (" (trained)" if t.get("rank") == chosen else ""),
                                           wide=True),
                 num(t.get("predicted_step_s"), f"verify:{t.get('rank')}:predicted_step_s"),
                 num(t.get("measured_step_s"), f"verify:{t.get('rank')}:measured_step_s"),
                 pct(t.get("step_error")) if isinstance(t.get("step_error"), (int, float)) else text("-"),
                 num(t.get("measured_tokens_per_s")), text(str(t.get("error") or t.get("harness") or "-"))]
                for t in trials]
        doc.table(Table(["planner's rank", "layout", "predicted step s", "measured step s", "error", "tokens/s",
                         "harness"], rows, id="verify",
                        caption=f"each of the top plans timed for {(data.verify or {}).get('steps', '?')} real steps "
                                "before training; error: predicted / measured - 1"))
        if (data.verify or {}).get("reason"):
            doc.p(f"Decision: {data.verify['reason']}.", id="verify-reason")
    fb = data.feedback
    if fb:
        before, after = fb.get("factors_before") or {}, fb.get("factors_after") or {}
        rows = [[text(k), num(before.get(k)), num(after.get(k))] for k in after]
        doc.table(Table(["efficiency factor", "before", "after"], rows, id="feedback",
                        caption=f"refitted over {fb.get('used', '?')} measured steps of this machine "
                                f"({fb.get('added', '?')} from this run); profile {fb.get('profile', '?')}"))
        errors = [(label, fb.get(key)) for label, key in (("this run's steps, predicted before the run",
                                                           "new_error_before"),
                                                          ("all steps, before the refit", "error_before"),
                                                          ("all steps, after the refit", "error_after"))]
        doc.bullets([f"step-time error (RMS relative), {label}: {100 * value:.1f}%" for label, value in errors
                     if isinstance(value, (int, float))], id="feedback-errors")


def run_report(path: str | Path) -> tuple[RunAnalysis, Document]:
    analysis = analyse(read_run_dir(path))
    return analysis, run_document(analysis)
