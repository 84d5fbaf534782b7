"""summary.json: predicted against measured (for the whole run and per segment), per-stage results,
what the run had to change (rollbacks, out-of-memory fallbacks), where its models are."""

from __future__ import annotations

import math
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from specs.plan_file import Plan
from specs.run_dir import (EVENTS_FILE, METRICS_FILE, EvalEvent, SpikeEvent, StageEndEvent, StageStartEvent,
                           events_of, read_events, read_json_lines)
from profiler.tensor_memory import TensorMemory
from trainer.evaluator import Evaluator
from trainer.exact_match import NOT_SCORED_PIPELINE
from trainer.loop_state import LoopState
from trainer.recovery import Recovery
from trainer.run_segments import segment_figures
from trainer.stage_runner import CUTS, StageRunner, padding_report


def finish(runner: StageRunner, evaluator: Evaluator, memory: TensorMemory) -> dict[str, Any]:
    """Write summary.json (rank 0) at the run's end; every rank returns it."""
    ctx, state, recovery = runner.ctx, runner.state, runner.recovery
    files = ctx.files
    results = {"eval": files.logged(EvalEvent, "losses", evaluator.evals),
               "exact_match": files.logged(EvalEvent, "exact_match", evaluator.exact),
               "epochs": files.logged(StageEndEvent, "epochs", runner.epochs),
               "rows": files.logged(StageStartEvent, "rows", runner.rows)}
    summary = _summary(ctx.plan, state, recovery, runner.step_times, results, files.run_dir, memory)
    if files.logged(EvalEvent, "exact_match_note", {}):
        summary["exact_match_note"] = NOT_SCORED_PIPELINE
    summary["layout_used"] = recovery.layout.short()
    summary["oom_fallbacks"] = state.oom_fallbacks
    summary["model_dir"] = files.final_model(ctx.task.stages[-1].name)
    for entry in summary["stages"]:
        stage_model = files.stage_model_dir(entry["name"])
        entry["model_dir"] = str(stage_model.relative_to(files.run_dir)) if stage_model.is_dir() else None
    prepared = runner.prepared
    summary["data"] = {"source": "prepared" if prepared is not None else "raw",
                       "dir": str(prepared) if prepared is not None else None,
                       "padding": {name: padding_report(c) for name, c in state.padding.items()},
                       **{cut: sum(s["rows"].get(cut, 0) for s in summary["stages"]) for cut in CUTS}}
    files.write_summary(summary)
    return summary


def _peak_bytes(memory: TensorMemory) -> tuple[int, str]:
    """The most loaded rank's peak of tensor memory (the quantity the cost model predicts): CUDA's
    allocator counter, or on the CPU the counting allocator of `profiler.tensor_memory`."""
    peak = torch.tensor([memory.peak_since_start()], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item()), memory.source


def _summary(plan: Plan, state: LoopState, recovery: Recovery, step_times: list[float], results: dict[str, dict],
             run_dir: Path, memory: TensorMemory) -> dict[str, Any]:
    """`results`: per stage, its eval losses, exact match per skill and epochs per source."""
    peak, how = _peak_bytes(memory)
    steady = step_times[2:] or step_times
    predicted = plan.chosen.estimate
    metrics = read_json_lines(run_dir / METRICS_FILE).records
    events = read_events(run_dir / EVENTS_FILE)[0]
    stages = []
    for spec in plan.task.stages if plan.task else []:
        losses = [m["loss"] for m in metrics if m["stage"] == spec.name]
        stages.append({"name": spec.name, "steps": len(losses), "final_loss": losses[-1] if losses else None,
                       **{key: per_stage.get(spec.name, {}) for key, per_stage in results.items()}})
    return {
        "predicted": {"peak_bytes": predicted.memory.peak, "step_s": predicted.time.step_s,
                      "tokens_per_s": predicted.throughput.tokens_per_s},
        "measured": {"peak_bytes": peak, "peak_source": how,
                     "step_s": statistics.median(steady) if steady else None,
                     "tokens_per_s": (plan.chosen.layout.tokens_per_step / statistics.median(steady))
                     if steady else None},
        "steps": state.global_step, "rollbacks": recovery.rollbacks, "stages": stages,
        "layout": plan.chosen.layout.short(), "world_size": recovery.ctx.world, "pid": os.getpid(),
        "finished": state.stage >= len(plan.task.stages) if plan.task else True,
        "nan": _non_finite_seen(metrics, events),
        "segments": segment_figures(plan, metrics, events, (peak, how)),
    }


def _non_finite_seen(metrics: list[dict[str, Any]], events: list[Any]) -> bool:
    """Whether any step of the run had a non-finite loss or gradient norm. The guard rolls such a
    step back, so it is in events.jsonl (a spike), not metrics.jsonl; both files span resumes."""
    values = [value for m in metrics for value in (m.get("loss"), m.get("grad_norm"))]
    values += [value for e in events_of(events, SpikeEvent) for value in (e.loss, e.grad_norm)]
    return any(isinstance(value, float) and not math.isfinite(value) for value in values)
