"""The staged curriculum loop: reads top to bottom, like nanoGPT's train.py.

For each stage of the task: re-warm the learning rate, train its planned steps on its mixture
(with replay of earlier stages), guard every step against loss spikes (roll back to the last good
checkpoint and skip the offending batch), checkpoint on the planned cadence and always at the
stage end, evaluate every skill seen so far. Everything a run leaves follows the run-dir contract:
plan.yaml, metrics.jsonl, events.jsonl, checkpoints/, summary.json.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from advisor.errors import UsageError
from advisor.plan import Plan
from trainer import checkpoint
from trainer.corpus import load_source, stage_sources, tokenizer_for
from trainer.engine import build_model, device, make_engine, select_backend
from trainer.oom import (RELAUNCH, OOMInjector, free_memory, is_oom, next_layout, relaunch_layout,
                         request_relaunch)
from trainer.options import TrainOptions
from trainer.prepared import bucket_stream, mask_padding, prepared_dir
from trainer.scalars import ScalarLog
from trainer.schedule import stage_lr
from trainer.spike import SpikeGuard
from trainer.stream import Source, StageStream


@dataclass
class LoopState:
    """What a resume needs besides the engine: where the curriculum and its data stand."""

    stage: int = 0
    step_in_stage: int = 0
    global_step: int = 0
    positions: list[int] = field(default_factory=list)
    skips: list[list[int]] = field(default_factory=list)  # [stage, start, end) data windows skipped
    lr_scale: float = 1.0
    rollbacks: int = 0
    spike: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] | None = None  # the layout an OOM fallback switched to (None: the plan's)
    oom_fallbacks: int = 0
    padding: dict[str, list[int]] = field(default_factory=dict)  # stage -> [tokens, slots, slots unbucketed]


class JsonLines:
    """Append-only JSON lines, flushed per record (rank 0 writes)."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop metrics a crashed run logged after its last checkpoint (they are redone)."""
        if not self.enabled or not self.path.is_file():
            return
        keep = [line for line in self.path.read_text().splitlines() if json.loads(line).get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(self.path)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sum_across_ranks(values: list[float]) -> list[float]:
    """One all-reduce for all of a step's numbers (a collective per number would cost latency)."""
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def _build_engine(plan: Plan, layout: Any, options: TrainOptions, dev: torch.device, prepared: Path | None):
    model = build_model(plan.model, layout, options.seed, options.weights).to(dev)
    if prepared is not None:
        mask_padding(model)  # bucketed micro-batches mark padding -1
    ds_config = None
    if select_backend(layout, plan.engine) == "deepspeed":
        from planner.export import deepspeed_config

        ds_config = deepspeed_config(plan, layout)
    return make_engine(model, layout, ds_config, options.clip, plan.engine)


def _saved_layout(path: Path | None, default: Any) -> Any:
    """The layout a checkpoint was trained with after an OOM fallback, else `default`."""
    if path is None:
        return default
    saved = json.loads((path / "trainer.json").read_text()).get("layout")
    return type(default).model_validate(saved) if saved else default


def _padding_report(counts: list[int]) -> dict[str, Any]:
    tokens, slots, unbucketed = counts
    return {"tokens": tokens, "slots": slots, "padding_fraction": 1 - tokens / slots if slots else 0.0,
            "slots_unbucketed": unbucketed,
            "padding_fraction_unbucketed": 1 - tokens / unbucketed if unbucketed else 0.0,
            "slots_saved": unbucketed - slots}


def _advance(position: int, count: int, stage: int, skips: list[list[int]]) -> int:
    """The data position after consuming `count` sequences, jumping over skipped windows."""
    position += count
    for s, start, end in skips:
        if s == stage and start <= position < end:
            position = end
    return position


def _start(position: int, stage: int, skips: list[list[int]]) -> int:
    for s, start, end in skips:
        if s == stage and start <= position < end:
            return end
    return position


def _evaluate(model: torch.nn.Module, sources: list[Source], count: int, dev: torch.device) -> dict[str, float]:
    """Mean token loss per eval source (first `count` sequences, in order), no gradients."""
    results = {}
    model.eval()
    with torch.no_grad():
        for source in sources:
            batch = torch.from_numpy(source.sequences[:count]).to(dev)
            results[source.name] = float(model(input_ids=batch, labels=batch).loss)
    model.train()
    return results


def train(plan: Plan, run_dir: Path, resume: bool, options: TrainOptions) -> dict[str, Any]:
    if plan.task is None or not plan.stages:
        raise UsageError("the plan has no task stages: plan with --task task.yaml")
    rank, world = _rank_world()
    layout = plan.chosen.layout
    if world != layout.devices:
        raise UsageError(f"the plan needs {layout.devices} processes, this launch has {world}")
    main = rank == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_root = run_dir / "checkpoints"
    metrics = JsonLines(run_dir / "metrics.jsonl", main)
    events = JsonLines(run_dir / "events.jsonl", main)
    if main and not (run_dir / "plan.yaml").is_file():
        plan.write(run_dir / "plan.yaml")
    task = plan.task
    tokenizer = tokenizer_for(task, plan.model.name, int(plan.model.hf_config.get("vocab_size", 0)))
    cache = run_dir / "data_cache"
    dev = device()

    # -- model, engine, and where we stand -------------------------------------------------
    last = checkpoint.latest(ckpt_root) if resume else None
    layout = _saved_layout(last, layout)
    failed_layouts: list[Any] = []
    if resume:  # the launcher restarted the ranks after an out-of-memory: the layout they switch to
        layout, failed_layouts = relaunch_layout(run_dir, layout, world)
    vocab = int(plan.model.hf_config.get("vocab_size", 0))
    prepared = prepared_dir(task, options.data, layout.seq, vocab)
    inject = OOMInjector()
    engine = _build_engine(plan, layout, options, dev, prepared)
    guard = SpikeGuard(warmup_steps=options.spike_warmup_steps)
    state = LoopState(positions=[0] * len(task.stages))
    if resume and last is None and main:
        events.write({"event": "resume", "from": None, "note": "no checkpoint yet: starting fresh"})
    if last is not None:
        state = LoopState(**checkpoint.load(last, engine.load))
        guard.load_state_dict(state.spike)
        metrics.truncate_after(state.global_step)
        events.write({"event": "resume", "from": last.name, "step": state.global_step})
    elif main and not resume:
        for stale in ("metrics.jsonl", "events.jsonl", RELAUNCH):
            (run_dir / stale).unlink(missing_ok=True)
        for old in (run_dir / "tensorboard").glob("events.out.tfevents.*"):
            old.unlink()
    scalars = ScalarLog(run_dir / "tensorboard", main, purge_after=state.global_step if last else None)
    if prepared is not None:
        events.write({"event": "data", "source": "prepared", "dir": str(prepared)})

    def save(reason: str) -> None:
        state.spike = guard.state_dict()
        path = checkpoint.save(ckpt_root, state.global_step, vars(state).copy(), engine.save,
                               options.keep_checkpoints)
        events.write({"event": "checkpoint", "step": state.global_step, "stage": task.stages[state.stage].name
                      if state.stage < len(task.stages) else None, "path": str(path.relative_to(run_dir)),
                      "reason": reason})

    if last is None:
        save("start")  # the rollback target before the first step
    step_times: list[float] = []
    evals: dict[str, dict[str, float]] = {}
    dp, mbs, gas = layout.dp, layout.mbs, layout.gas
    per_step = dp * mbs * gas
    progress = _progress(options.show_progress and main)
    failed_layouts.append(layout)
    if layout != plan.chosen.layout:  # checkpoints remember the fallback for later resumes
        state.layout = layout.model_dump(mode="json")
        state.oom_fallbacks = max(state.oom_fallbacks, len(failed_layouts) - 1)

    def make_stream(index: int):
        if prepared is not None:  # length-bucketed micro-batches of the current layout's token budget
            return bucket_stream(prepared, task, index, layout.seq, layout.mbs, options.seed)
        return StageStream(stage_sources(task, index, tokenizer, layout.seq, cache), options.seed, index)

    # -- the curriculum ----------------------------------------------------------------------
    with progress, scalars:
        while state.stage < len(task.stages):
            index = state.stage
            stage = task.stages[index]
            planned = plan.stages[index]
            steps = min(planned.steps, options.max_steps_per_stage or planned.steps)
            stream = make_stream(index)
            bar = progress.add_task(stage.name, total=steps * per_step * layout.seq, loss=float("nan"), tps=0.0)
            progress.update(bar, completed=state.step_in_stage * per_step * layout.seq)
            if state.step_in_stage == 0:
                # a new data distribution moves the loss legitimately: the guard learns it afresh
                guard = SpikeGuard(warmup_steps=options.spike_warmup_steps)
                events.write({"event": "stage_start", "stage": stage.name, "step": state.global_step,
                              "steps": steps, "lr": stage.lr * state.lr_scale, "warmup_steps": stage.warmup_steps})
            while state.step_in_stage < steps:
                started = time.perf_counter()
                position = _start(state.positions[index], index, state.skips)
                lr = stage_lr(state.step_in_stage, steps, stage.lr * state.lr_scale, stage.warmup_steps,
                              stage.min_lr_ratio)
                losses = []
                usage = [0, 0, 0]  # prepared data: real tokens, token slots, slots without buckets
                data_rank = getattr(engine, "data_rank", rank)  # TP/PP ranks of one replica read the same data
                try:
                    for micro in range(gas):
                        batch = stream.global_batch(position, dp, mbs, gas, data_rank, micro)
                        if prepared is not None:
                            usage = [a + b for a, b in zip(usage, stream.usage(position, dp, mbs, data_rank, micro))]
                        inject.check(state.global_step + 1, micro, batch)
                        losses.append(engine.micro_step(torch.from_numpy(batch).to(dev)))
                    grad_norm = engine.optimizer_step(lr)
                except Exception as exc:  # out of memory: the plan's next layout, from the last checkpoint
                    if not is_oom(exc):
                        raise
                    replacement, skipped = next_layout(plan, failed_layouts)
                    target = checkpoint.latest(ckpt_root)
                    assert target is not None
                    fallback = {"event": "oom_fallback", "step": state.global_step + 1, "stage": stage.name,
                                "error": str(exc)[:300], "failed": layout.short(),
                                "replacement": replacement.short() if replacement else None,
                                "from": target.name, "skipped": skipped}
                    if replacement is not None and world > 1:  # the others may be stuck in a collective
                        request_relaunch(run_dir, replacement, failed_layouts, {**fallback, "relaunch": True})
                        raise UsageError(f"out of memory at step {state.global_step + 1} with {layout.short()}: the "
                                         f"launcher restarts the ranks with {replacement.short()}") from None
                    events.write(fallback)
                    if replacement is None:
                        events.write({"event": "stop", "reason": "out of memory: no fallback left in the plan"})
                        raise UsageError(f"out of memory at step {state.global_step + 1} with {layout.short()}: "
                                         "no fallback left in the plan; plan with a smaller micro-batch, "
                                         "recomputation or more devices") from None
                    carried = (state.skips, state.rollbacks, state.lr_scale, state.oom_fallbacks + 1)
                    engine = None  # drop the failed engine's model, gradients and optimizer state
                    free_memory()
                    layout = replacement
                    failed_layouts.append(layout)
                    engine = _build_engine(plan, layout, options, dev, prepared)
                    state = LoopState(**checkpoint.load(target, engine.load))
                    state.skips, state.rollbacks, state.lr_scale, state.oom_fallbacks = carried
                    state.layout = layout.model_dump(mode="json")
                    guard.load_state_dict(state.spike)
                    if state.step_in_stage == 0:
                        guard = SpikeGuard(warmup_steps=options.spike_warmup_steps)
                    metrics.truncate_after(state.global_step)
                    scalars.truncate_after(state.global_step)
                    dp, mbs, gas = layout.dp, layout.mbs, layout.gas
                    stream = make_stream(index)
                    progress.update(bar, completed=state.step_in_stage * per_step * layout.seq)
                    continue
                step_losses = [x for x in losses if x is not None]  # a pipeline returns None until the gas-th
                loss_sum, *usage = _sum_across_ranks([float(np.mean(step_losses)), *usage])
                loss = loss_sum / world
                usage = [u * dp / world for u in usage]  # the world/dp ranks of a replica read the same data
                reason = guard.check(loss, grad_norm)
                if reason is not None:  # roll back, skip this batch, cool the learning rate
                    window = [index, position, _advance(position, per_step, index, [])]
                    events.write({"event": "spike", "step": state.global_step + 1, "stage": stage.name,
                                  "loss": loss, "grad_norm": grad_norm, "reason": reason})
                    rollbacks, skips = state.rollbacks + 1, state.skips + [window]
                    if rollbacks > options.max_rollbacks:
                        events.write({"event": "stop", "reason": f"more than {options.max_rollbacks} rollbacks"})
                        raise RuntimeError(f"training stopped after {options.max_rollbacks} rollbacks: {reason}")
                    target = checkpoint.latest(ckpt_root)
                    assert target is not None
                    state = LoopState(**checkpoint.load(target, engine.load))
                    guard.load_state_dict(state.spike)
                    state.rollbacks, state.skips = rollbacks, skips
                    state.lr_scale *= options.spike_lr_factor
                    metrics.truncate_after(state.global_step)
                    scalars.truncate_after(state.global_step)
                    events.write({"event": "rollback", "to": target.name, "step": state.global_step,
                                  "skipped": window[1:], "lr_scale": state.lr_scale})
                    progress.update(bar, completed=state.step_in_stage * per_step * layout.seq)
                    continue
                state.positions[index] = _advance(position, per_step, index, state.skips)
                state.step_in_stage += 1
                state.global_step += 1
                elapsed = time.perf_counter() - started
                step_times.append(elapsed)
                if prepared is not None:  # real tokens: padding is not throughput
                    counts = state.padding.setdefault(stage.name, [0, 0, 0])
                    state.padding[stage.name] = [a + int(b) for a, b in zip(counts, usage)]
                tokens_per_s = (usage[0] if prepared is not None else per_step * layout.seq) / elapsed
                record = {"step": state.global_step, "stage": stage.name, "loss": loss, "lr": lr,
                          "grad_norm": grad_norm, "tokens_per_s": tokens_per_s, "step_s": elapsed}
                metrics.write(record)
                scalars.metrics(record)
                progress.update(bar, advance=per_step * layout.seq, loss=loss, tps=tokens_per_s)
                if state.step_in_stage % planned.checkpoint_every_steps == 0 and state.step_in_stage < steps:
                    save("interval")

            # stage end: evaluate every skill seen so far (forgetting shows here), then checkpoint
            evals[stage.name] = _evaluate_stages(engine.model, task, index, tokenizer, layout.seq, cache, options,
                                                 dev)
            events.write({"event": "eval", "stage": stage.name, "step": state.global_step, "losses": evals[stage.name]})
            scalars.evals(state.global_step, evals[stage.name])
            if stage.name in state.padding:
                events.write({"event": "data_padding", "stage": stage.name,
                              **_padding_report(state.padding[stage.name])})
            events.write({"event": "stage_end", "stage": stage.name, "step": state.global_step})
            state.stage += 1
            state.step_in_stage = 0
            save("stage_end")

    summary = _summary(plan, state, step_times, evals, run_dir)
    summary["layout_used"] = layout.short()
    summary["oom_fallbacks"] = state.oom_fallbacks
    summary["data"] = {"source": "prepared" if prepared is not None else "raw",
                       "dir": str(prepared) if prepared is not None else None,
                       "padding": {name: _padding_report(c) for name, c in state.padding.items()}}
    if main:
        tmp = run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        tmp.replace(run_dir / "summary.json")
    return summary


def _evaluate_stages(model, task, upto: int, tokenizer, seq: int, cache: Path, options: TrainOptions,
                     dev: torch.device) -> dict[str, float]:
    """Eval loss per stage (skill) with eval data, for stages 0..upto."""
    sources = []
    for stage in task.stages[: upto + 1]:
        for src in stage.eval_sources:
            sequences = load_source(src, task, tokenizer, seq, cache)
            if len(sequences):
                sources.append(Source(stage.name, sequences, 1.0))
    module = getattr(model, "module", model)
    return _evaluate(module, sources, options.eval_sequences, dev)


def _peak_bytes() -> tuple[int, str]:
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
    # ru_maxrss is the process's resident high-water mark in KiB: it includes the Python and
    # library footprint, so on CPU it over-reads tensor memory (see shared/NOTES-cpu-stack.md)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss (RSS, over-reads tensors)"


def _summary(plan: Plan, state: LoopState, step_times: list[float], evals: dict, run_dir: Path) -> dict[str, Any]:
    peak, how = _peak_bytes()
    steady = step_times[2:] or step_times
    predicted = plan.chosen.estimate
    stages = []
    for spec in plan.task.stages if plan.task else []:
        losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["stage"] == spec.name] if (run_dir / "metrics.jsonl").is_file() else []
        stages.append({"name": spec.name, "steps": len(losses), "final_loss": losses[-1] if losses else None,
                       "eval": evals.get(spec.name, {})})
    return {
        "predicted": {"peak_bytes": predicted.memory.peak, "step_s": predicted.time.step_s,
                      "tokens_per_s": predicted.throughput.tokens_per_s},
        "measured": {"peak_bytes": peak, "peak_source": how,
                     "step_s": statistics.median(steady) if steady else None,
                     "tokens_per_s": (plan.chosen.layout.tokens_per_step / statistics.median(steady))
                     if steady else None},
        "steps": state.global_step, "rollbacks": state.rollbacks, "stages": stages,
        "layout": plan.chosen.layout.short(), "world_size": _rank_world()[1], "pid": os.getpid(),
        "finished": state.stage >= len(plan.task.stages) if plan.task else True,
        "nan": any(math.isnan(x) for x in step_times),
    }


def _progress(enabled: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description:>12}"), BarColumn(), TextColumn("loss {task.fields[loss]:.3f}"),
                    TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeRemainingColumn(), disable=not enabled,
                    transient=False, refresh_per_second=2)  # redraws hold the GIL: few are enough
