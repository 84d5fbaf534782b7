"""The staged curriculum loop: reads top to bottom, like nanoGPT's train.py.

For each stage of the task: re-warm the learning rate, train its planned steps on its mixture
(with replay of earlier stages), guard every step against loss spikes (roll back to the last good
checkpoint and skip the offending batch), checkpoint on the planned cadence and always at the
stage end, evaluate every skill seen so far. Everything a run leaves follows the run-dir contract:
plan.yaml, metrics.jsonl, events.jsonl, checkpoints/, summary.json, and run.json (which run this is:
trainer/run_identity.py); and the model to ship, at every stage end stages/<stage>/model/ and at the
end model/ (trainer/handoff.py `write_model`). A resume after a re-plan for another number of devices
reads the checkpoint resharded (the engines' `load`: DCP, DeepSpeed's universal checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from specs.errors import TrainingStopped, UsageError
from specs.engine_traits import traits
from specs.capabilities import EngineChoice
from specs.plan_file import Plan, StagePlan, load_plan, segment_of
from specs.core import Layout, ModelSpec
from specs.task import AdapterSpec, StageSpec, check_stage_name
from specs.run_dir import (CHECKPOINT_STATE_FILE, CHECKPOINTS_DIR, DATA_CACHE_DIR, EVENTS_FILE, METRICS_FILE, PLAN_FILE,
                           STAGES_DIR, SUMMARY_FILE, TENSORBOARD_DIR, CheckpointDamagedEvent, CheckpointEvent,
                           DataEvent, DataPaddingEvent, EvalEvent, JsonLines, LengthChangedEvent, ModelEvent,
                           MovedAsideEvent, OOMFallbackEvent, ReshardedEvent, ResumeEvent, RollbackEvent,
                           SegmentStartEvent, SpikeEvent, StageEndEvent, StageStartEvent, StopEvent, TornLinesEvent,
                           event_record, events_of, read_events, read_json_lines)
from planner.export import model_deepspeed_config
from profiler.hardware_bench import TORCH_DTYPES
from profiler.tensor_memory import TensorMemory
from trainer import checkpoint
from trainer.batch import MicroBatch, as_micro_batch
from trainer.corpus import ByteTokenizer, load_rows, stage_sources, tokenizer_for
from trainer.engines import Engine, device, make_engine, select_backend
from trainer.exact_match import NOT_SCORED_PIPELINE, stage_exact_match
from trainer.handoff import ARTIFACT_DIR, HANDOFF_DIR, copy_model, write_full_weights, write_model
from trainer.oom import OOMInjector, free_memory, is_oom, next_layout, relaunch_layout, request_relaunch
from trainer.model import build_model, check_weights
from trainer.options import TrainOptions
from trainer.prepared import bucket_stream, prepared_dir
from trainer.run_segments import segment_figures
from trainer.run_identity import claim, read_run, restarted, saved_digests, update_length
from trainer.run_reuse import run_fingerprint
from trainer.scalars import ScalarLog
from trainer.schedule import first_changed_rate, scheduled_lr
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
    engine_layout: dict[str, Any] | None = None  # the layout whose engine wrote the checkpoint (None: before this key)
    stage_steps: list[int] = field(default_factory=list)  # each started stage's steps, as the run sized it


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


def _saved_layout(path: Path | None, default: Layout) -> Layout:
    """The layout a checkpoint was trained with after an OOM fallback, else `default` (also when the
    plan was re-made for another number of devices: the fallback belonged to the old count)."""
    if path is None:
        return default
    saved = json.loads((path / CHECKPOINT_STATE_FILE).read_text()).get("layout")
    layout = type(default).model_validate(saved) if saved else default
    return layout if layout.devices == default.devices else default


def _replanned(path: Path, plan: Plan) -> bool:
    """Whether the run dir's plan.yaml is missing or lays its stages out otherwise than `plan` (a plan
    re-made for another number of devices, resumed)."""
    try:
        return load_plan(path).stage_layouts() != plan.stage_layouts()
    except (OSError, ValueError, UsageError):
        return True


def _checkpoint_step(path: Path) -> int:
    return int(path.name[len(checkpoint.PREFIX):])


def _checkpoint_stage(path: Path) -> int:
    """The stage a checkpoint resumes into (a stage-end checkpoint: the next stage, at its start)."""
    return int(json.loads((path / CHECKPOINT_STATE_FILE).read_text())["stage"])


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


CUTS = ("truncated", "dropped")  # what reading a stage's examples cost them (trainer/stream.py pack_examples)


def _rows_cut(stream: Any, stage: str) -> dict[str, int]:
    """The stage's own examples cut to the sequence length and dropped with nothing left to train
    (replayed stages' are theirs); none counted on prepared data (`advisor data prepare` reports its own)."""
    own = [s for s in getattr(stream, "sources", []) if s.name.startswith(f"{stage}:")]
    return {cut: sum(getattr(s, cut) for s in own) for cut in CUTS}


def _epoch_steps(stream: Any, epochs: float, stage: str, per_step: int) -> int:
    """Optimizer steps of an epochs budget: the positions after which the stage's own sources made
    `epochs` passes (trainer/stream.py), in whole steps of `per_step` sequences."""
    return max(1, math.ceil(stream.positions_for(epochs, stage) / per_step))


def _start(position: int, stage: int, skips: list[list[int]]) -> int:
    for s, start, end in skips:
        if s == stage and start <= position < end:
            return end
    return position


def build_engine(model: ModelSpec, layout: Layout, device_type: str, engine: EngineChoice, options: TrainOptions,
                 dev: torch.device, adapter: AdapterSpec | None = None) -> Engine:
    """The engine `advisor train` runs `layout` with: the trainer's model, on `dev`, under the engine the
    capability declaration names, DeepSpeed configured as the plan's export. The timed steps
    (trainer/timed_steps.py: calibration, verification trials, benches) build theirs here too."""
    # on meta: the engine fills its shards
    built = build_model(model, layout, options.seed, options.weights, adapter, options.trust_remote_code)
    ds_config = None
    if traits(select_backend(layout, engine)).deepspeed:
        ds_config = model_deepspeed_config(model, device_type, layout)
    return make_engine(built, layout, ds_config, options.clip, engine)


def optimizer_step(engine: Engine, micro_batches: Iterable[MicroBatch], lr: float) -> tuple[list[float | None], float]:
    """One optimizer step of `engine`: forward and backward of each micro-batch, then the update at
    `lr`; the micro-batches' losses and the gradient norm. `advisor train` and the timed steps both
    step through here."""
    losses = [engine.micro_step(batch) for batch in micro_batches]
    return losses, engine.optimizer_step(lr)


def _evaluate(model: torch.nn.Module, sources: list[Source], count: int, mbs: int,
              dev: torch.device) -> dict[str, float]:
    """Mean token loss per eval source (first `count` sequences, in order), no gradients.

    In micro-batches of the layout's `mbs`: without gradients a micro-batch holds less than a
    training micro-step does, so the stage-end evaluation is never what runs out of memory. The
    model returns each micro-batch's mean over its trained tokens; weighted by their counts, the
    micro-batches' means give the mean over all trained tokens."""
    results = {}
    model.eval()
    with torch.no_grad():
        for source in sources:
            total, tokens = 0.0, 0
            for start in range(0, min(count, len(source.sequences)), mbs):
                rows = source.rows(np.arange(start, min(start + mbs, count, len(source.sequences))))
                batch = MicroBatch.from_arrays(rows.ids, rows.labels, rows.positions).to(dev)
                trained = batch.trained_tokens()
                if trained:
                    total += float(model(**batch.model_inputs()).loss) * trained
                    tokens += trained
                del batch
            results[source.name] = total / tokens if tokens else float("nan")
    model.train()
    return results


def train(plan: Plan, run_dir: Path, resume: bool, options: TrainOptions) -> dict[str, Any]:
    """Run the plan's curriculum in `run_dir` (resuming from its last checkpoint when `resume`).

    Every rank runs this; rank 0 writes the run dir's files. A restart by torchrun or Slurm resumes. A
    step is redone, not counted, after an out-of-memory fallback or a spike rollback: both restore
    the last checkpoint first."""
    run = _Run(plan, run_dir, options)
    run.restore_or_start(resume or restarted())
    with run.progress, run.scalars:
        while run.state.stage < run.segment.end:
            stage = run.start_stage()
            while run.state.stage == stage.index and run.state.step_in_stage < stage.steps:
                step = run.take_step(stage)
                if step is None:  # out of memory: fell back to the plan's next layout
                    continue
                reason = run.guard.check(step.loss, step.grad_norm)
                if reason is not None:
                    run.roll_back(stage, step, reason)
                    continue
                run.record(stage, step)
                if run.checkpoint_due(stage):
                    run.save("interval")
            if run.state.stage != stage.index:  # rolled back into the previous stage (no good checkpoint in this one)
                continue
            run.evaluate(stage)
            run.end_stage(stage)
    if run.state.stage < len(run.task.stages):  # the next stage runs another layout: the launcher goes on
        return {"finished": False, "segment_end": run.state.stage}
    return run.finish()


@dataclass
class _Stage:
    """The stage being trained: its spec, its plan, the steps it runs, its data and progress bar."""

    index: int
    spec: StageSpec
    planned: StagePlan
    steps: int
    stream: Any  # StageStream, or BucketStream for prepared data
    bar: Any


@dataclass
class _Step:
    """One optimizer step, taken but not yet judged by the spike guard."""

    started: float  # time.perf_counter() at its start
    position: int  # data position of its first sequence
    lr: float
    loss: float  # averaged over the ranks
    grad_norm: float
    usage: list[float]  # prepared data: real tokens, token slots, slots without buckets (this replica)


class _Run:
    """Everything one training run holds besides `LoopState`: its files, layout, engine and guard."""

    def __init__(self, plan: Plan, run_dir: Path, options: TrainOptions):
        if plan.task is None or not plan.stages:
            raise UsageError("the plan has no task stages: plan with --task task.yaml")
        self.rank, self.world = _rank_world()
        self.plan, self.run_dir, self.options, self.task = plan, run_dir, options, plan.task
        self.main = self.rank == 0
        run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_root = run_dir / CHECKPOINTS_DIR
        self.metrics = JsonLines(run_dir / METRICS_FILE, self.main)
        self.events = JsonLines(run_dir / EVENTS_FILE, self.main)
        self.scalars = ScalarLog(run_dir / TENSORBOARD_DIR, self.main)  # opens lazily, after any purge is set
        # before the run dir is claimed: a refusal leaves no run
        check_weights(plan.model, options.weights, options.trust_remote_code)
        self.vocab = int(plan.model.hf_config.get("vocab_size", 0))
        self.tokenizer = tokenizer_for(self.task, plan.model.name, self.vocab, options.weights, options.template,
                                       options.trust_remote_code)
        self.cache = run_dir / DATA_CACHE_DIR
        self.dev = device()
        self.memory = TensorMemory(self.dev)  # before the model is built: it counts what is allocated from now on
        self.step_times: list[float] = []
        self.evals: dict[str, dict[str, float]] = {}
        self.exact: dict[str, dict[str, float | None]] = {}  # stage -> skill -> greedy exact match (None: no answers)
        self.epochs: dict[str, dict[str, float]] = {}  # stage -> source -> passes made over it
        self.rows: dict[str, dict[str, int]] = {}  # stage -> its own examples truncated and dropped
        self.rollbacks = 0  # this run's, over all its resumes (the budget: never restored from a checkpoint)
        self.last_spike: int | None = None  # the step of the last spike, and how many checkpoints the
        self.steps_back = 0  # guard went back past the newest (a spike that repeats goes further back)

    # -- set-up: layout, engine, and where the run stands ------------------------------------------

    def restore_or_start(self, resume: bool) -> None:
        """Resume from the last good checkpoint (with the layout it, or an OOM relaunch, switched to),
        else start fresh in a directory that holds no other run, and save the rollback target of step 1."""
        self._claim(resume)
        last = self._choose(None) if resume else None
        self.segment = segment_of(self.plan, _checkpoint_stage(last) if last is not None else 0)
        # a checkpoint that ends the previous segment hands on full weights, not this layout's engine state
        self.handoff = last / HANDOFF_DIR if last is not None and self._crosses_segments(last) else None
        self.layout = self.segment.layout if self.handoff else _saved_layout(last, self.segment.layout)
        if self.world != self.layout.devices:
            raise UsageError(f"stages {self.segment.first + 1}-{self.segment.end} of the plan run on "
                             f"{self.layout.devices} processes, this launch has {self.world}")
        self.failed_layouts: list[Layout] = []
        if resume:  # the launcher restarted the ranks after an out-of-memory: the layout they switch to
            self.layout, self.failed_layouts = relaunch_layout(self.run_dir, self.plan, self.layout, self.world)
            self.rollbacks = checkpoint.broadcast(self._rollbacks_logged())
        self.prepared = prepared_dir(self.task, self.options.data, self.layout.seq, self.vocab)
        self.inject = OOMInjector()
        self.engine = self._build_engine()
        self.guard = self._fresh_guard()
        self.state = LoopState(positions=[0] * len(self.task.stages))
        if resume and last is None and self.main:
            self.events.write(ResumeEvent(from_=None, note="no checkpoint yet: starting fresh"))
        if last is not None:
            torn = self.events.truncate_after(None)
            if torn:
                self.events.write(TornLinesEvent(file=EVENTS_FILE, skipped=torn))
            self._restore(last)
            self.events.write(ResumeEvent(from_=last.name, step=self.state.global_step))
            self._log_resharding(last)
        if self.prepared is not None:
            self.events.write(DataEvent(source="prepared", dir=str(self.prepared)))
        if last is None:
            self.save("start")  # the rollback target before the first step
        self.per_step = self.layout.global_batch
        if last is not None and self.saved_length not in (None, self.length):
            self._change_length(self.saved_length)
        self.progress = _progress(self.options.show_progress and self.main)
        self.failed_layouts.append(self.layout)
        if self.handoff is not None:
            self.state.layout, self.state.oom_fallbacks = None, 0  # the previous segment's fallback is over
        if self.layout != self.segment.layout:  # checkpoints remember the fallback for later resumes
            self.state.layout = self.layout.model_dump(mode="json")
            self.state.oom_fallbacks = max(self.state.oom_fallbacks, len(self.failed_layouts) - 1)
        else:  # the plan's layout runs (a fallback of another device count, before a re-plan, is over)
            self.state.layout = None
        self._log_segment("resume" if last is not None else "start")

    def _change_length(self, saved: dict[str, Any]) -> None:
        """A resume with another run length (--steps, --epochs, --max-steps-per-stage, a task's stage
        budgets): allowed where every step already trained keeps its learning rate, so the run goes on
        as if the new length had been asked for from the start; then a finished run's last stage is
        reopened when it grew. Refused otherwise, in one line."""
        n, stage, done = len(self.task.stages), self.state.stage, self.state.step_in_stage
        trained = self.state.stage_steps[:stage + (1 if done else 0)]  # the stages started before the checkpoint
        if len(trained) < min(stage + (1 if done else 0), n):
            raise UsageError("--resume: this run's checkpoint does not record its stages' lengths (written by an "
                             "older trainer), so its length cannot change; resume with the length it was started with")
        new = [self._stage_steps(i) for i in range(len(trained))]
        reopen = stage == n and new[-1] > trained[-1]
        if reopen:
            stage, done = n - 1, trained[-1]
        problem = self._length_problem(trained, new, stage, done, saved)
        if problem is not None:
            raise UsageError(f"--resume with another length: {problem}; train into another --out, or resume with "
                             "the length the run was started with")
        if reopen:  # the last stage goes on: its spike statistics with it
            self.state.stage, self.state.step_in_stage = stage, done
            self.guard.load_state_dict(self.state.spike)
        self.events.write(LengthChangedEvent(step=self.state.global_step, stage_steps=new, was=trained))
        if self.main:
            update_length(self.run_dir, self.length)

    def _length_problem(self, trained: list[int], new: list[int], stage: int, done: int,
                        saved: dict[str, Any]) -> str | None:
        """Why the new stage lengths `new` cannot continue a run that trained `trained` steps of its
        stages (now at step `done` of `stage`); None when they can."""
        names = [s.name for s in self.task.stages]
        for i in range(min(stage, len(new))):
            if new[i] != trained[i]:
                return f"stage '{names[i]}' ran {trained[i]} steps, the new length gives it {new[i]}"
        if stage < len(new) and done > new[stage]:
            return f"stage '{names[stage]}' has trained {done} steps, the new length gives it {new[stage]}"
        steps_done = [*trained[:stage], done][:len(new)]
        old_steps = [*trained, *new[len(trained):]]
        changed = first_changed_rate(self.task, steps_done, (old_steps, self._wsd_steps(saved)),
                                     (new, self._wsd_steps(self.length)))
        if changed is not None:
            step, had, now = changed
            return (f"step {step}, already trained, had learning rate {had:.6g} and would have {now:.6g} (the "
                    f"'{self.task.lr_schedule}' schedule depends on the run's length; `lr_schedule: constant` does "
                    "not)")
        return None

    def _log_resharding(self, last: Path) -> None:
        """A resume whose engine state was written under another layout (a plan re-made for another
        number of devices): the engine read it resharded (trainer/engines: DCP, or the other format)."""
        saved = self.state.engine_layout
        if self.handoff is None and saved and Layout.model_validate(saved) != self.layout:
            self.events.write(ReshardedEvent(from_=last.name, saved_layout=Layout.model_validate(saved).short(),
                                             layout=self.layout.short()))

    def _claim(self, resume: bool) -> None:
        """Rank 0 makes the run dir this run's (run_identity.claim) and every rank takes its answer:
        a refusal is raised on all of them, the same line."""
        refusal, saved_length = None, None
        if self.main:
            try:
                digests = saved_digests(self.run_dir)
                current = run_fingerprint(self.plan, self.options, self.tokenizer, digests)
                self.length = current["length"]
                saved_length = (read_run(self.run_dir) or {}).get("fingerprint", {}).get("length") if resume else None
                moved = claim(self.run_dir, current, resume, self.options.overwrite, digests)
            except (UsageError, OSError) as exc:  # the other ranks wait for the answer: give them one
                refusal = str(exc)
            else:
                if moved is not None:
                    self.events.write(MovedAsideEvent(to=str(moved)))
                if not resume or _replanned(self.run_dir / PLAN_FILE, self.plan):
                    self.plan.write(self.run_dir / PLAN_FILE)  # the plan that runs now (a re-plan too)
        refusal, self.saved_length, self.length = checkpoint.broadcast((refusal, saved_length,
                                                                         getattr(self, "length", None)))
        if refusal is not None:
            raise UsageError(refusal)

    def _rollbacks_logged(self) -> int:
        return len(events_of(read_events(self.events.path)[0], RollbackEvent)) if self.main else 0

    def _crosses_segments(self, checkpoint_dir: Path) -> bool:
        """Whether `checkpoint_dir` ends a segment whose layout differs from the next stage's."""
        stage = _checkpoint_stage(checkpoint_dir)
        return (checkpoint_dir / HANDOFF_DIR).is_dir() and 0 < stage == segment_of(self.plan, stage).first

    def _build_engine(self) -> Engine:
        """The segment's engine; after a boundary, from the full weights the previous segment handed on."""
        options = replace(self.options, weights=str(self.handoff)) if self.handoff is not None else self.options
        return build_engine(self.plan.model, self.layout, self.plan.hardware.device_type, self.plan.engine,
                            options, self.dev, self.task.adapter)

    def _fresh_guard(self) -> SpikeGuard:
        return SpikeGuard.for_task(self.task.spike_guard, self.options.spike_warmup_steps)

    def _make_stream(self, index: int) -> Any:
        ramp = self.task.stages[index].ramp_steps
        if self.prepared is not None:  # length-bucketed micro-batches of the current layout's token budget
            if ramp:
                raise UsageError(f"stage '{self.task.stages[index].name}': ramp_steps is not run on prepared "
                                 "(bucketed) data yet; set ramp_steps: 0 or train on the raw sources")
            return bucket_stream(self.prepared, self.task, index, self.layout.seq, self.layout.mbs, self.options.seed)
        return StageStream(stage_sources(self.task, index, self.tokenizer, self.layout.seq, self.cache),
                           self.options.seed, index, ramp_sequences=ramp * self.layout.global_batch)

    # -- checkpoints -------------------------------------------------------------------------------

    def save(self, reason: str, handoff: bool = False, weights: dict[str, torch.Tensor] | None = None) -> None:
        """A checkpoint; with `handoff`, also the full weights the next segment starts from (`weights`
        when the stage's artifact has gathered them already)."""
        self.state.spike = self.guard.state_dict()
        self.state.engine_layout = self.layout.model_dump(mode="json")

        def save_engine(directory: Path) -> None:
            self.engine.save(directory)
            if handoff:
                write_full_weights(self.engine, self.plan.model, directory / HANDOFF_DIR, weights)

        path = checkpoint.save(self.ckpt_root, self.state.global_step, vars(self.state).copy(), save_engine,
                               self.options.keep_checkpoints)
        stages = self.task.stages
        self.events.write(CheckpointEvent(
            step=self.state.global_step, stage=stages[self.state.stage].name if self.state.stage < len(stages) else None,
            path=str(path.relative_to(self.run_dir)), reason=reason))

    def _restore(self, target: Path, **kept: Any) -> None:
        """Load the checkpoint `target` into the engine, the loop state (but for the fields in
        `kept`) and the spike guard; the logged steps after it will be redone. At a stage start the
        guard starts afresh, as the stage itself does (the checkpoint holds the previous stage's)."""
        self.state = LoopState(**checkpoint.load(target, self._engine_loader(target)))
        for name, value in kept.items():
            setattr(self.state, name, value)
        self.state.rollbacks = self.rollbacks
        self.guard.load_state_dict(self.state.spike)
        if self.state.step_in_stage == 0:
            self.guard = self._fresh_guard()
        torn = self.metrics.truncate_after(self.state.global_step)
        if torn:
            self.events.write(TornLinesEvent(file=METRICS_FILE, skipped=torn))
        self.scalars.truncate_after(self.state.global_step)

    def _engine_loader(self, target: Path) -> Any:
        """How `target` restores the engine: its own state, or, where it ends the previous segment,
        the full weights it hands on (the engine is rebuilt from them when a rollback goes there)."""
        if not self._crosses_segments(target):
            if segment_of(self.plan, _checkpoint_stage(target)) != self.segment:
                raise UsageError(f"checkpoint {target.name} belongs to stages that run another layout; "
                                 "cannot go back past the start of this layout's stages")
            return self.engine.load
        if self.handoff != target / HANDOFF_DIR:
            self.handoff = target / HANDOFF_DIR
            self.engine = self._build_engine()
        return lambda _: None

    def _choose(self, below: int | None, stage: int | None = None) -> Path | None:
        """The newest good checkpoint (the ranks' joint choice; with `below`, the newest good ones before that
        step, stepping back `self.steps_back` of them, within `stage` when given); damaged ones
        passed over are logged."""
        good, damaged = checkpoint.good_checkpoints(self.ckpt_root, below, wanted=self.steps_back + 1)
        for name, problem in damaged:
            self.events.write(CheckpointDamagedEvent(path=name, problem=problem))
        if stage is not None:
            good = [p for p in good if _checkpoint_stage(p) == stage] or good[:1]
        if below is None or not good:
            return good[0] if good else None
        return good[min(self.steps_back, len(good) - 1)]

    def _last_checkpoint(self) -> Path:
        target = self._choose(None)
        if target is None:
            raise RuntimeError(f"no checkpoint in {self.ckpt_root} verifies: nothing to go back to")
        return target

    # -- a stage -----------------------------------------------------------------------------------

    def start_stage(self) -> _Stage:
        index = self.state.stage
        spec, planned = self.task.stages[index], self.plan.stages[index]
        stream = self._make_stream(index)
        epochs = self.options.epochs or spec.epochs
        steps = self._stage_steps(index, stream)
        sized = self.state.stage_steps[:index]
        self.state.stage_steps = sized + [0] * (index - len(sized)) + [steps]
        bar = self.progress.add_task(spec.name, total=steps * self.per_step * self.layout.seq, loss=float("nan"),
                                     tps=0.0)
        stage = _Stage(index, spec, planned, steps, stream, bar)
        self._show_progress(stage)
        if self.state.step_in_stage == 0:
            # a new data distribution moves the loss legitimately: the guard learns it afresh
            self.guard = self._fresh_guard()
            self.rows[spec.name] = _rows_cut(stream, spec.name)
            self.events.write(StageStartEvent(stage=spec.name, step=self.state.global_step, steps=steps, epochs=epochs,
                                              lr=spec.lr * self.state.lr_scale,
                                              warmup_steps=spec.warmup_for(steps),  # as the schedule runs it
                                              rows=self.rows[spec.name]))
        return stage

    def _stage_steps(self, index: int, stream: Any = None) -> int:
        """The steps stage `index` runs: its planned steps, or its epochs over its data (read from
        `stream`, made here when not given), capped by --max-steps-per-stage."""
        spec, planned = self.task.stages[index], self.plan.stages[index]
        epochs = self.options.epochs or spec.epochs
        if epochs is None:
            budget = planned.steps
        else:
            budget = _epoch_steps(stream or self._make_stream(index), epochs, spec.name, self.per_step)
        return min(budget, self.options.max_steps_per_stage or budget)

    def checkpoint_due(self, stage: _Stage) -> bool:
        """On the planned cadence, but not at the stage end (that checkpoint follows the eval)."""
        done = self.state.step_in_stage
        return done % stage.planned.checkpoint_every_steps == 0 and done < stage.steps

    def _show_progress(self, stage: _Stage) -> None:
        self.progress.update(stage.bar, completed=self.state.step_in_stage * self.per_step * self.layout.seq)

    def evaluate(self, stage: _Stage) -> None:
        """Eval loss of every skill seen so far, at the stage end, and the greedy exact match of
        their held-out answers: forgetting shows here."""
        name = stage.spec.name
        self.evals[name] = _evaluate_stages(self.engine.model, self.task, stage.index, self.tokenizer,
                                            self.layout, self.cache, self.options, self.dev)
        record = EvalEvent(stage=name, step=self.state.global_step, losses=self.evals[name])
        exact = stage_exact_match(self.engine.model, self.task, stage.index, self.tokenizer, self.layout.mbs,
                                  self.options.exact_match_prompts, self.dev)
        if exact is None:
            record.exact_match_note = NOT_SCORED_PIPELINE
        else:
            self.exact[name] = record.exact_match = exact
        self.events.write(record)
        self.scalars.evals(self.state.global_step, self.evals[name])

    def end_stage(self, stage: _Stage) -> None:
        """Log the stage's padding, the passes it made over each source, and its end; move the
        curriculum on, and checkpoint."""
        name = stage.spec.name
        if name in self.state.padding:
            self.events.write(DataPaddingEvent(stage=name, **_padding_report(self.state.padding[name])))
        skipped = [(start, end) for s, start, end in self.state.skips if s == stage.index]
        self.epochs[name] = stage.stream.epochs(self.state.positions[stage.index], skipped)
        self.events.write(StageEndEvent(stage=name, step=self.state.global_step, epochs=self.epochs[name]))
        weights = self.write_model(stage)
        self.state.stage += 1
        self.state.step_in_stage = 0
        self.state.lr_scale = 1.0  # a spike's cooling belongs to its stage
        handoff = self.state.stage == self.segment.end < len(self.task.stages)
        if not handoff:
            weights = None  # freed before the engine saves
        self.save("stage_end", handoff=handoff, weights=weights)

    def write_model(self, stage: _Stage) -> dict[str, torch.Tensor] | None:
        """The stage's artifact, RUN/stages/<stage>/model/ (collective; trainer/handoff.py `write_model`):
        an HF model folder, or for LoRA/QLoRA an adapter folder. The full weights when it gathered them."""
        directory = _stage_model_dir(self.run_dir, stage.spec.name)
        tokenizer = None if isinstance(self.tokenizer, ByteTokenizer) else self.tokenizer.path
        weights = write_model(self.engine, directory, TORCH_DTYPES[self.layout.dtype], tokenizer, self.options.weights,
                              merge=self.options.merge, chat_template=self.tokenizer.builtin_jinja,
                              trusted=self.options.trust_remote_code)
        self.events.write(ModelEvent(stage=stage.spec.name, step=self.state.global_step,
                                     path=str(directory.relative_to(self.run_dir)),
                                     kind="adapter" if self.layout.method in ("lora", "qlora") else "full"))
        return weights

    # -- a step ------------------------------------------------------------------------------------

    def _learning_rate(self, stage: _Stage) -> float:
        """The task's schedule at this step (trainer/schedule.py)."""
        return scheduled_lr(self.task, stage.index, self.state.step_in_stage, stage.steps, self._wsd_steps(self.length),
                            self.state.lr_scale)

    def _wsd_steps(self, length: dict[str, Any]) -> list[int]:
        """The stages' steps WSD counts, from a fingerprint's `length`: the planned ones, capped."""
        cap = length.get("max_steps_per_stage")
        return [min(steps, cap or steps) for steps in length["steps"]]

    def take_step(self, stage: _Stage) -> _Step | None:
        """Accumulate the step's micro-batches and take the optimizer step; None when that ran out
        of memory and the run fell back to the plan's next layout (the step is then redone)."""
        started = time.perf_counter()
        position = _start(self.state.positions[stage.index], stage.index, self.state.skips)
        lr = self._learning_rate(stage)
        usage = [0, 0, 0]  # prepared data: real tokens, token slots, slots without buckets
        try:
            losses, grad_norm = optimizer_step(self.engine, self._micro_batches(stage, position, usage), lr)
        except Exception as exc:
            if not is_oom(exc):
                raise
            error = str(exc)
        else:
            step_losses = [x for x in losses if x is not None]  # a pipeline returns None until the gas-th
            loss_sum, *usage = _sum_across_ranks([float(np.mean(step_losses)), *usage])
            usage = [u * self.layout.dp / self.world for u in usage]  # the world/dp ranks of a replica read alike
            return _Step(started, position, lr, loss_sum / self.world, grad_norm, usage)
        self.fall_back(stage, error)  # out of the except block: the failed step's tensors are freed
        return None

    def _micro_batches(self, stage: _Stage, position: int, usage: list[int]) -> Iterator[MicroBatch]:
        """This rank's micro-batches of the step at data `position`, counting into `usage` what they
        hold (prepared data)."""
        layout = self.layout
        data_rank = getattr(self.engine, "data_rank", self.rank)  # TP/PP ranks of one replica read the same data
        batches = []
        for micro in range(layout.gas):
            batch = as_micro_batch(stage.stream.global_batch(position, layout.dp, layout.mbs, layout.gas, data_rank,
                                                             micro))
            if self.prepared is not None:
                micro_usage = stage.stream.usage(position, layout.dp, layout.mbs, data_rank, micro)
                usage[:] = [a + b for a, b in zip(usage, micro_usage)]
            self.inject.check(self.state.global_step + 1, micro, batch.input_ids.numpy())
            batches.append(batch)
        # Every trained token of the step weighs the same, however the step is split: micro-batches
        # hold different numbers of trained tokens (answers, padding, packed documents' first tokens).
        local = float(sum(b.trained_tokens() for b in batches))
        step_tokens = _sum_across_ranks([local])[0] * layout.dp / self.world  # a replica's ranks read alike
        for batch in batches:
            batch.num_items = step_tokens / (layout.dp * layout.gas) if step_tokens > 0 else None
            yield batch.to(self.dev)

    def record(self, stage: _Stage, step: _Step) -> None:
        """Count a good step: advance the data, log its metrics."""
        state = self.state
        state.positions[stage.index] = _advance(step.position, self.per_step, stage.index, state.skips)
        state.step_in_stage += 1
        state.global_step += 1
        elapsed = time.perf_counter() - step.started
        self.step_times.append(elapsed)
        if self.prepared is not None:  # real tokens: padding is not throughput
            counts = state.padding.setdefault(stage.spec.name, [0, 0, 0])
            state.padding[stage.spec.name] = [a + int(b) for a, b in zip(counts, step.usage)]
        tokens = step.usage[0] if self.prepared is not None else self.per_step * self.layout.seq
        record = {"step": state.global_step, "stage": stage.spec.name, "loss": step.loss, "lr": step.lr,
                  "grad_norm": step.grad_norm, "tokens_per_s": tokens / elapsed, "step_s": elapsed}
        self.metrics.write(record)
        self.scalars.metrics(record)
        self.progress.update(stage.bar, advance=self.per_step * self.layout.seq, loss=step.loss,
                             tps=record["tokens_per_s"])

    # -- the two ways back to the last checkpoint ----------------------------------------------------

    def fall_back(self, stage: _Stage, error: str) -> None:
        """Out of memory: switch to the plan's next layout that these processes can run, from the
        last checkpoint (several ranks: ask the launcher to restart them all with it)."""
        replacement, skipped = next_layout(self.plan, self.failed_layouts, self.dev.type)
        target = self._last_checkpoint()
        step, failed = self.state.global_step + 1, self.layout.short()
        fallback = OOMFallbackEvent(step=step, stage=stage.spec.name, error=error[:300], failed=failed,
                                    replacement=replacement.short() if replacement else None, from_=target.name,
                                    skipped=skipped)
        if replacement is not None and self.world > 1:  # the others may be stuck in a collective
            request_relaunch(self.run_dir, self.plan, replacement, self.failed_layouts,
                             event_record(fallback.model_copy(update={"relaunch": True})))
            raise UsageError(f"out of memory at step {step} with {failed}: the launcher restarts the ranks "
                             f"with {replacement.short()}")
        self.events.write(fallback)
        if replacement is None:
            self.events.write(StopEvent(reason="out of memory: no fallback left in the plan"))
            raise UsageError(f"out of memory at step {step} with {failed}: no fallback left in the plan; plan "
                             "with a smaller micro-batch, recomputation or more devices")
        state = self.state
        self.engine = None  # drop the failed engine's model, gradients and optimizer state
        free_memory()
        self.layout = replacement
        self.failed_layouts.append(replacement)
        self.engine = self._build_engine()
        self._restore(target, skips=state.skips, lr_scale=state.lr_scale, oom_fallbacks=state.oom_fallbacks + 1,
                      layout=replacement.model_dump(mode="json"))
        stage.stream = self._make_stream(stage.index)
        self._show_progress(stage)
        self._log_segment("oom_fallback")

    def _log_segment(self, why: str) -> None:
        """The steps from here on train under `self.layout` (summary.json's `segments` read these)."""
        stages = self.task.stages
        stage = stages[self.state.stage].name if self.state.stage < len(stages) else None
        self.segment_from = self.state.global_step
        self.events.write(SegmentStartEvent(step=self.state.global_step, stage=stage, layout=self.layout.short(),
                                            why=why))

    def roll_back(self, stage: _Stage, step: _Step, reason: str) -> None:
        """A loss spike: back to the last checkpoint, skip this step's batch, cool the learning rate
        (until the stage ends). The same spike again (no step passed it since) means that checkpoint
        was taken on the bad path: go back one checkpoint further and skip all data since it."""
        spike_step = self.state.global_step + 1
        self.events.write(SpikeEvent(step=spike_step, stage=stage.spec.name, loss=step.loss, grad_norm=step.grad_norm,
                                     reason=reason))
        self.rollbacks += 1
        if self.rollbacks > self.options.max_rollbacks:
            self.events.write(StopEvent(reason=f"more than {self.options.max_rollbacks} rollbacks"))
            raise TrainingStopped(f"training stopped after {self.options.max_rollbacks} rollbacks: {reason}; the "
                                  f"checkpoints in {self.ckpt_root} hold the last good steps: lower the stage's "
                                  "learning rate (or its batch's noise) and train again")
        repeated = self.last_spike is not None and spike_step <= self.last_spike
        self.steps_back = self.steps_back + 1 if repeated else 0
        self.last_spike = spike_step
        target = self._choose(spike_step, stage.index)
        if target is None:
            raise RuntimeError(f"no checkpoint in {self.ckpt_root} verifies: nothing to roll back to")
        discarded = checkpoint.discard_after(self.ckpt_root, _checkpoint_step(target)) if self.steps_back else []
        skips = self.state.skips
        self._restore(target)
        start = self.state.positions[stage.index] if self.steps_back else step.position
        window = [stage.index, min(start, step.position), _advance(step.position, self.per_step, stage.index, [])]
        self.state.skips = skips + [window]
        self.state.lr_scale *= self.options.spike_lr_factor
        self.events.write(RollbackEvent(to=target.name, step=self.state.global_step, skipped=window[1:],
                                        lr_scale=self.state.lr_scale, steps_back=self.steps_back, discarded=discarded))
        if self.state.global_step < self.segment_from:  # back past this launch's start: its steps are redone here
            self._log_segment("rollback")
        self._show_progress(stage)

    # -- the end -----------------------------------------------------------------------------------

    def _logged(self, kind: type, key: str, here: dict[str, Any]) -> dict[str, Any]:
        """Per stage, `key` of the `kind` events of this process (`here`) and of earlier launches
        (segments, resumes) from the log."""
        events = events_of(read_events(self.events.path)[0], kind) if self.main else []
        logged = {e.stage: getattr(e, key) for e in events if getattr(e, key) is not None}
        return {**logged, **here}

    def _final_model(self) -> str | None:
        """RUN/model/: the last stage's artifact (rank 0 links it there); its path in the run dir."""
        last = _stage_model_dir(self.run_dir, self.task.stages[-1].name)
        if self.main and last.is_dir():
            copy_model(last, self.run_dir / ARTIFACT_DIR)
        return ARTIFACT_DIR if (self.run_dir / ARTIFACT_DIR).is_dir() else None

    def finish(self) -> dict[str, Any]:
        """summary.json: predicted against measured, per-stage results, what the run had to change."""
        results = {"eval": self._logged(EvalEvent, "losses", self.evals),
                   "exact_match": self._logged(EvalEvent, "exact_match", self.exact),
                   "epochs": self._logged(StageEndEvent, "epochs", self.epochs),
                   "rows": self._logged(StageStartEvent, "rows", self.rows)}
        summary = _summary(self.plan, self.state, self.step_times, results, self.run_dir, self.memory)
        if self._logged(EvalEvent, "exact_match_note", {}):
            summary["exact_match_note"] = NOT_SCORED_PIPELINE
        summary["layout_used"] = self.layout.short()
        summary["oom_fallbacks"] = self.state.oom_fallbacks
        summary["model_dir"] = self._final_model()
        for entry in summary["stages"]:
            stage_model = _stage_model_dir(self.run_dir, entry["name"])
            entry["model_dir"] = str(stage_model.relative_to(self.run_dir)) if stage_model.is_dir() else None
        prepared = self.prepared
        summary["data"] = {"source": "prepared" if prepared is not None else "raw",
                           "dir": str(prepared) if prepared is not None else None,
                           "padding": {name: _padding_report(c) for name, c in self.state.padding.items()},
                           **{cut: sum(s["rows"].get(cut, 0) for s in summary["stages"]) for cut in CUTS}}
        if self.main:
            tmp = self.run_dir / f"{SUMMARY_FILE}.tmp"
            tmp.write_text(json.dumps(summary, indent=2))
            tmp.replace(self.run_dir / SUMMARY_FILE)
        return summary


def _stage_model_dir(run_dir: Path, stage: str) -> Path:
    """RUN/stages/<stage>/model/. The name was checked when the task was read; checked again here, where
    it becomes a path, so that no way around the loaders writes outside the run dir."""
    return run_dir / STAGES_DIR / check_stage_name(stage) / ARTIFACT_DIR


def _evaluate_stages(model, task, upto: int, tokenizer, layout: Layout, cache: Path, options: TrainOptions,
                     dev: torch.device) -> dict[str, float]:
    """Eval loss per stage (skill) with eval data, for stages 0..upto, in micro-batches of the layout's."""
    sources = []
    for stage in task.stages[: upto + 1]:
        for src in stage.eval_sources:
            rows = load_rows(src, task, tokenizer, layout.seq, cache)
            if len(rows):
                sources.append(Source.of(stage.name, rows, 1.0))
    module = getattr(model, "module", model)
    return _evaluate(module, sources, options.eval_sequences, layout.mbs, dev)


def _peak_bytes(memory: TensorMemory) -> tuple[int, str]:
    """The most loaded rank's peak of tensor memory (the quantity the cost model predicts): CUDA's
    allocator counter, or on the CPU the counting allocator of `profiler.tensor_memory`."""
    peak = torch.tensor([memory.peak_since_start()], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item()), memory.source


def _summary(plan: Plan, state: LoopState, step_times: list[float], results: dict[str, dict], run_dir: Path,
             memory: TensorMemory) -> dict[str, Any]:
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
        "steps": state.global_step, "rollbacks": state.rollbacks, "stages": stages,
        "layout": plan.chosen.layout.short(), "world_size": _rank_world()[1], "pid": os.getpid(),
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


def _progress(enabled: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description:>12}"), BarColumn(), TextColumn("loss {task.fields[loss]:.3f}"),
                    TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeRemainingColumn(), disable=not enabled,
                    transient=False, refresh_per_second=2)  # redraws hold the GIL: few are enough
