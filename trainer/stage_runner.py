"""Training the stages: each stage's length and data, its steps (taken, then recorded once the spike
guard passed them), and its end (padding, passes over the data, the stage's artifact, the checkpoint).
Keeps what the summary reports of the stages this launch ran: step times, passes, rows cut."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from specs.errors import UsageError
from specs.plan_file import StagePlan
from specs.run_dir import DataPaddingEvent, ModelEvent, StageEndEvent, StageStartEvent
from specs.task import StageSpec
from profiler.hardware_bench import TORCH_DTYPES
from trainer.batch import MicroBatch, as_micro_batch
from trainer.corpus import ByteTokenizer, stage_sources
from trainer.engine_build import optimizer_step
from trainer.handoff import write_model
from trainer.loop_state import LoopState, advance, first_position
from trainer.oom import is_oom
from trainer.prepared import bucket_stream
from trainer.recovery import Recovery
from trainer.run_context import RunContext, sum_across_ranks
from trainer.run_length import wsd_steps
from trainer.schedule import scheduled_lr
from trainer.stream import StageStream

CUTS = ("truncated", "dropped")  # what reading a stage's examples cost them (trainer/stream.py pack_examples)


@dataclass
class Stage:
    """The stage being trained: its spec, its plan, the steps it runs, its data and progress bar."""

    index: int
    spec: StageSpec
    planned: StagePlan
    steps: int
    stream: Any  # StageStream, or BucketStream for prepared data
    bar: Any


@dataclass
class Step:
    """One optimizer step, taken but not yet judged by the spike guard."""

    started: float  # time.perf_counter() at its start
    position: int  # data position of its first sequence
    lr: float
    loss: float  # averaged over the ranks
    grad_norm: float
    usage: list[float]  # prepared data: real tokens, token slots, slots without buckets (this replica)


class StageRunner:
    def __init__(self, ctx: RunContext, state: LoopState, recovery: Recovery, prepared: Path | None,
                 length: dict[str, Any], progress: Any):
        self.ctx, self.state, self.recovery = ctx, state, recovery
        self.prepared, self.length, self.progress = prepared, length, progress
        self.step_times: list[float] = []
        self.epochs: dict[str, dict[str, float]] = {}  # stage -> source -> passes made over it
        self.rows: dict[str, dict[str, int]] = {}  # stage -> its own examples truncated and dropped

    @property
    def per_step(self) -> int:
        """Sequences an optimizer step reads (every fallback layout keeps the plan's global batch)."""
        return self.recovery.layout.global_batch

    # -- a stage ----------------------------------------------------------------------------------

    def start_stage(self) -> Stage:
        state, task = self.state, self.ctx.task
        index = state.stage
        spec, planned = task.stages[index], self.ctx.plan.stages[index]
        stream = self.make_stream(index)
        steps = self.stage_steps(index, stream)
        sized = state.stage_steps[:index]
        state.stage_steps = sized + [0] * (index - len(sized)) + [steps]
        bar = self.progress.add_task(spec.name, total=steps * self.per_step * self.recovery.layout.seq,
                                     loss=float("nan"), tps=0.0)
        stage = Stage(index, spec, planned, steps, stream, bar)
        self.show_progress(stage)
        if state.step_in_stage == 0:
            # a new data distribution moves the loss legitimately: the guard learns it afresh
            self.recovery.guard = self.recovery.fresh_guard()
            self.rows[spec.name] = _rows_cut(stream, spec.name)
            self.ctx.files.events.write(StageStartEvent(
                stage=spec.name, step=state.global_step, steps=steps, epochs=self.ctx.options.epochs or spec.epochs,
                lr=spec.lr * state.lr_scale, warmup_steps=spec.warmup_for(steps),  # as the schedule runs it
                rows=self.rows[spec.name]))
        return stage

    def stage_steps(self, index: int, stream: Any = None) -> int:
        """The steps stage `index` runs: its planned steps, or its epochs over its data (read from
        `stream`, made here when not given), capped by --max-steps-per-stage."""
        options = self.ctx.options
        spec, planned = self.ctx.task.stages[index], self.ctx.plan.stages[index]
        epochs = options.epochs or spec.epochs
        if epochs is None:
            budget = planned.steps
        else:  # the positions after which the stage's own sources made `epochs` passes, in whole steps
            positions = (stream or self.make_stream(index)).positions_for(epochs, spec.name)
            budget = max(1, math.ceil(positions / self.per_step))
        return min(budget, options.max_steps_per_stage or budget)

    def make_stream(self, index: int) -> Any:
        task, layout, seed = self.ctx.task, self.recovery.layout, self.ctx.options.seed
        ramp = task.stages[index].ramp_steps
        if self.prepared is not None:  # length-bucketed micro-batches of the current layout's token budget
            if ramp:
                raise UsageError(f"stage '{task.stages[index].name}': ramp_steps is not run on prepared "
                                 "(bucketed) data yet; set ramp_steps: 0 or train on the raw sources")
            return bucket_stream(self.prepared, task, index, layout.seq, layout.mbs, seed)
        return StageStream(stage_sources(task, index, self.ctx.tokenizer, layout.seq, self.ctx.files.cache),
                           seed, index, ramp_sequences=ramp * layout.global_batch)

    def show_progress(self, stage: Stage) -> None:
        self.progress.update(stage.bar, completed=self.state.step_in_stage * self.per_step * self.recovery.layout.seq)

    def checkpoint_due(self, stage: Stage) -> bool:
        """On the planned cadence, but not at the stage end (that checkpoint follows the eval)."""
        done = self.state.step_in_stage
        return done % stage.planned.checkpoint_every_steps == 0 and done < stage.steps

    def end_stage(self, stage: Stage) -> None:
        """Log the stage's padding, the passes it made over each source, and its end; move the
        curriculum on, and checkpoint."""
        state, events, name = self.state, self.ctx.files.events, stage.spec.name
        if name in state.padding:
            events.write(DataPaddingEvent(stage=name, **padding_report(state.padding[name])))
        skipped = [(start, end) for s, start, end in state.skips if s == stage.index]
        self.epochs[name] = stage.stream.epochs(state.positions[stage.index], skipped)
        events.write(StageEndEvent(stage=name, step=state.global_step, epochs=self.epochs[name]))
        weights = self._write_model(stage)
        state.stage += 1
        state.step_in_stage = 0
        state.lr_scale = 1.0  # a spike's cooling belongs to its stage
        handoff = state.stage == self.recovery.segment.end < len(self.ctx.task.stages)
        if not handoff:
            weights = None  # freed before the engine saves
        self.recovery.save("stage_end", handoff=handoff, weights=weights)

    def _write_model(self, stage: Stage) -> dict[str, torch.Tensor] | None:
        """The stage's artifact, RUN/stages/<stage>/model/ (collective; trainer/handoff.py `write_model`):
        an HF model folder, or for LoRA/QLoRA an adapter folder. The full weights when it gathered them."""
        ctx, layout = self.ctx, self.recovery.layout
        directory = ctx.files.stage_model_dir(stage.spec.name)
        tokenizer = None if isinstance(ctx.tokenizer, ByteTokenizer) else ctx.tokenizer.path
        weights = write_model(self.recovery.engine, directory, TORCH_DTYPES[layout.dtype], tokenizer,
                              ctx.options.weights, merge=ctx.options.merge, chat_template=ctx.tokenizer.builtin_jinja,
                              trusted=ctx.options.trust_remote_code)
        ctx.files.events.write(ModelEvent(stage=stage.spec.name, step=self.state.global_step,
                                          path=str(directory.relative_to(ctx.files.run_dir)),
                                          kind="adapter" if layout.method in ("lora", "qlora") else "full"))
        return weights

    # -- a step -----------------------------------------------------------------------------------

    def take_step(self, stage: Stage) -> Step | None:
        """Accumulate the step's micro-batches and take the optimizer step; None when that ran out
        of memory and the run fell back to the plan's next layout (the step is then redone)."""
        state, world = self.state, self.ctx.world
        started = time.perf_counter()
        position = first_position(state.positions[stage.index], stage.index, state.skips)
        lr = scheduled_lr(self.ctx.task, stage.index, state.step_in_stage, stage.steps, wsd_steps(self.length),
                          state.lr_scale)
        usage = [0, 0, 0]  # prepared data: real tokens, token slots, slots without buckets
        try:
            losses, grad_norm = optimizer_step(self.recovery.engine, self._micro_batches(stage, position, usage), lr)
        except Exception as exc:
            if not is_oom(exc):
                raise
            error = str(exc)
        else:
            step_losses = [x for x in losses if x is not None]  # a pipeline returns None until the gas-th
            loss_sum, *usage = sum_across_ranks([float(np.mean(step_losses)), *usage])
            usage = [u * self.recovery.layout.dp / world for u in usage]  # the world/dp ranks of a replica read alike
            return Step(started, position, lr, loss_sum / world, grad_norm, usage)
        # out of the except block: the failed step's tensors are freed
        self.recovery.fall_back(stage.spec.name, error)
        stage.stream = self.make_stream(stage.index)
        self.show_progress(stage)
        return None

    def _micro_batches(self, stage: Stage, position: int, usage: list[int]) -> Iterator[MicroBatch]:
        """This rank's micro-batches of the step at data `position`, counting into `usage` what they
        hold (prepared data)."""
        layout, engine = self.recovery.layout, self.recovery.engine
        data_rank = getattr(engine, "data_rank", self.ctx.rank)  # TP/PP ranks of one replica read the same data
        batches = []
        for micro in range(layout.gas):
            batch = as_micro_batch(stage.stream.global_batch(position, layout.dp, layout.mbs, layout.gas, data_rank,
                                                             micro))
            if self.prepared is not None:
                micro_usage = stage.stream.usage(position, layout.dp, layout.mbs, data_rank, micro)
                usage[:] = [a + b for a, b in zip(usage, micro_usage)]
            self.recovery.inject.check(self.state.global_step + 1, micro, batch.input_ids.numpy())
            batches.append(batch)
        # Every trained token of the step weighs the same, however the step is split: micro-batches
        # hold different numbers of trained tokens (answers, padding, packed documents' first tokens).
        local = float(sum(b.trained_tokens() for b in batches))
        step_tokens = sum_across_ranks([local])[0] * layout.dp / self.ctx.world  # a replica's ranks read alike
        for batch in batches:
            batch.num_items = step_tokens / (layout.dp * layout.gas) if step_tokens > 0 else None
            yield batch.to(self.ctx.dev)

    def record(self, stage: Stage, step: Step) -> None:
        """Count a good step: advance the data, log its metrics."""
        state, files, seq = self.state, self.ctx.files, self.recovery.layout.seq
        state.positions[stage.index] = advance(step.position, self.per_step, stage.index, state.skips)
        state.step_in_stage += 1
        state.global_step += 1
        elapsed = time.perf_counter() - step.started
        self.step_times.append(elapsed)
        if self.prepared is not None:  # real tokens: padding is not throughput
            counts = state.padding.setdefault(stage.spec.name, [0, 0, 0])
            state.padding[stage.spec.name] = [a + int(b) for a, b in zip(counts, step.usage)]
        tokens = step.usage[0] if self.prepared is not None else self.per_step * seq
        record = {"step": state.global_step, "stage": stage.spec.name, "loss": step.loss, "lr": step.lr,
                  "grad_norm": step.grad_norm, "tokens_per_s": tokens / elapsed, "step_s": elapsed}
        files.metrics.write(record)
        files.scalars.metrics(record)
        self.progress.update(stage.bar, advance=self.per_step * seq, loss=step.loss, tps=record["tokens_per_s"])


def _rows_cut(stream: Any, stage: str) -> dict[str, int]:
    """The stage's own examples cut to the sequence length and dropped with nothing left to train
    (replayed stages' are theirs); none counted on prepared data (`advisor data prepare` reports its own)."""
    own = [s for s in getattr(stream, "sources", []) if s.name.startswith(f"{stage}:")]
    return {cut: sum(getattr(s, cut) for s in own) for cut in CUTS}


def padding_report(counts: list[int]) -> dict[str, Any]:
    tokens, slots, unbucketed = counts
    return {"tokens": tokens, "slots": slots, "padding_fraction": 1 - tokens / slots if slots else 0.0,
            "slots_unbucketed": unbucketed,
            "padding_fraction_unbucketed": 1 - tokens / unbucketed if unbucketed else 0.0,
            "slots_saved": unbucketed - slots}


def progress_bars(enabled: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description:>12}"), BarColumn(), TextColumn("loss {task.fields[loss]:.3f}"),
                    TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeRemainingColumn(), disable=not enabled,
                    transient=False, refresh_per_second=2)  # redraws hold the GIL: few are enough
