"""summary.json's `segments`: the plan's prediction against the measured steps, per stretch of steps
that one layout trained in one launch.

A run's steps may be trained under several layouts: a plan whose stages run different layouts (one
launch each), an out-of-memory fallback to the plan's next layout, a resume after a re-plan. The
whole-run figures of summary.json (`predicted`, `measured`) compare the plan's chosen layout with
the last launch's steps; a refit (`advisor run`'s feedback) must pair each layout's prediction with
the steps that layout trained, which is what a segment holds. Segments are read back from the run
dir (events.jsonl's `segment_start` events, metrics.jsonl's steps), so they span every launch.
"""

from __future__ import annotations

import statistics
from typing import Any

from specs.plan_file import Plan, segment_of
from specs.run_dir import SegmentFigures, SegmentStartEvent, events_of

WARMUP_STEPS = 2  # a segment's first steps build the engine's caches: not its steady step time


def _kept_starts(starts: list[SegmentStartEvent]) -> list[SegmentStartEvent]:
    """The segments whose steps the run kept: a segment that starts at or before an earlier one's start
    (a fallback or resume from an older checkpoint) redoes that one's steps, which are gone from the
    metrics."""
    kept: list[SegmentStartEvent] = []
    for start in starts:
        while kept and kept[-1].step >= start.step:
            kept.pop()
        kept.append(start)
    return kept


def _predicted(plan: Plan, layout: str) -> dict[str, float | None]:
    """The plan's figures for `layout` (its short form): a planned candidate's estimate, else the step
    time of the stages planned on it, else nothing."""
    for planned in [plan.chosen, *plan.alternatives]:
        if planned.layout.short() == layout:
            est = planned.estimate
            return {"step_s": est.time.step_s, "tokens_per_s": est.throughput.tokens_per_s,
                    "peak_bytes": est.memory.peak}
    staged = next((s for s in plan.stages if s.layout.short() == layout), None)
    return {"step_s": staged.step_s if staged else None, "tokens_per_s": None, "peak_bytes": None}


def _measured(plan: Plan, layout: str, step_times: list[float]) -> dict[str, Any]:
    steady = step_times[WARMUP_STEPS:] or step_times
    step_s = statistics.median(steady) if steady else None
    tokens = next((p.layout.tokens_per_step for p in [plan.chosen, *plan.alternatives, *plan.stages]
                   if p.layout.short() == layout), None)
    return {"step_s": step_s, "tokens_per_s": tokens / step_s if tokens and step_s else None,
            "peak_bytes": None, "peak_source": None}


def _stage_index(plan: Plan, name: str | None) -> int:
    names = [s.name for s in plan.task.stages] if plan.task else []
    return names.index(name) if name in names else len(names)


def segment_figures(plan: Plan, metrics: list[dict[str, Any]], events: list[Any],
                    peak: tuple[int, str] | None = None) -> list[dict[str, Any]]:
    """summary.json's `segments`, in order; `peak` (bytes, how measured) is this launch's, the last
    segment's (an earlier launch's peak was not recorded)."""
    starts = _kept_starts(events_of(events, SegmentStartEvent))
    figures = []
    for index, start in enumerate(starts):
        end = starts[index + 1].step if index + 1 < len(starts) else None
        steps = [m for m in metrics if isinstance(m.get("step"), int) and m["step"] > start.step
                 and (end is None or m["step"] <= end)]
        measured = _measured(plan, start.layout, [float(m["step_s"]) for m in steps if "step_s" in m])
        if peak is not None and end is None:
            measured["peak_bytes"], measured["peak_source"] = peak
        planned = segment_of(plan, _stage_index(plan, start.stage)).layout.short() == start.layout
        figures.append(SegmentFigures(
            first_step=start.step + 1, last_step=steps[-1]["step"] if steps else None, steps=len(steps),
            stages=list(dict.fromkeys(str(m.get("stage")) for m in steps)), layout=start.layout, why=start.why,
            planned=planned, predicted=_predicted(plan, start.layout), measured=measured).model_dump())
    return figures
