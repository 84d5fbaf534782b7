"""The ways back to a good checkpoint, and what they change.

A resume, a loss spike's rollback and an out-of-memory fallback all restore a checkpoint; this
component chooses it (the newest that verifies, or further back when a spike repeats), restores the
engine and the loop state from it, and owns what the three may change: the one layout in force, its
engine, the spike guard, the rollback budget. A checkpoint records the layout in force when it is
written (`save`), so every resume finds the layout its engine state belongs to.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from specs.core import Layout
from specs.errors import TrainingStopped, UsageError
from specs.plan_file import segment_of
from specs.run_dir import (EVENTS_FILE, METRICS_FILE, CheckpointDamagedEvent, CheckpointEvent, OOMFallbackEvent,
                           ReshardedEvent, ResumeEvent, RollbackEvent, SegmentStartEvent, SpikeEvent, StopEvent,
                           TornLinesEvent, event_record)
from trainer import checkpoint
from trainer.engine_build import build_engine
from trainer.engines import Engine
from trainer.handoff import HANDOFF_DIR, write_full_weights
from trainer.loop_state import LoopState, advance
from trainer.oom import OOMInjector, free_memory, next_layout, relaunch_layout, request_relaunch
from trainer.run_context import RunContext
from trainer.spike import SpikeGuard

if TYPE_CHECKING:  # annotations only: the stage runner uses this module
    from trainer.stage_runner import Stage, Step


class Recovery:
    def __init__(self, ctx: RunContext, state: LoopState):
        self.ctx, self.state = ctx, state
        self.rollbacks = 0  # this run's, over all its resumes (the budget: never restored from a checkpoint)
        self.last_spike: int | None = None  # the step of the last spike, and how many checkpoints the
        self.steps_back = 0  # guard went back past the newest (a spike that repeats goes further back)
        self.inject = OOMInjector()
        self.failed_layouts: list[Layout] = []  # this segment's layouts that ran out of memory
        self.segment_from = 0  # the global step this launch's (or fallback's) layout took over at

    # -- the layout in force and its engine ---------------------------------------------------------

    def open(self, last: Path | None, resume: bool) -> None:
        """The segment, layout and engine this launch starts with: those of the checkpoint `last`
        (or the layout an out-of-memory relaunch switched to), else the plan's first segment's."""
        plan, world = self.ctx.plan, self.ctx.world
        self.segment = segment_of(plan, checkpoint.stage_of(last) if last is not None else 0)
        # a checkpoint that ends the previous segment hands on full weights, not this layout's engine state
        self.handoff = last / HANDOFF_DIR if last is not None and self._crosses_segments(last) else None
        self.layout = self.segment.layout if self.handoff else _saved_layout(last, self.segment.layout)
        if world != self.layout.devices:
            raise UsageError(f"stages {self.segment.first + 1}-{self.segment.end} of the plan run on "
                             f"{self.layout.devices} processes, this launch has {world}")
        if resume:  # the launcher restarted the ranks after an out-of-memory: the layout they switch to
            self.layout, self.failed_layouts = relaunch_layout(self.ctx.files.run_dir, plan, self.layout, world)
            self.rollbacks = checkpoint.broadcast(self.ctx.files.rollbacks_logged())
        self.engine: Engine | None = self._build_engine()
        self.guard = self.fresh_guard()

    def settle(self) -> None:
        """After the start or the resume: the layout in force counts as tried, and the checkpoints
        count the fallbacks it took (the previous segment's are over at a boundary)."""
        self.failed_layouts.append(self.layout)
        if self.handoff is not None:
            self.state.oom_fallbacks = 0
        if self.layout != self.segment.layout:
            self.state.oom_fallbacks = max(self.state.oom_fallbacks, len(self.failed_layouts) - 1)

    def _build_engine(self) -> Engine:
        """The segment's engine; after a boundary, from the full weights the previous segment handed on."""
        ctx = self.ctx
        options = replace(ctx.options, weights=str(self.handoff)) if self.handoff is not None else ctx.options
        return build_engine(ctx.plan.model, self.layout, ctx.plan.hardware.device_type, ctx.plan.engine, options,
                            ctx.dev, ctx.task.adapter)

    def fresh_guard(self) -> SpikeGuard:
        return SpikeGuard.for_task(self.ctx.task.spike_guard, self.ctx.options.spike_warmup_steps)

    def log_segment(self, why: str) -> None:
        """The steps from here on train under `self.layout` (summary.json's `segments` read these)."""
        stages = self.ctx.task.stages
        stage = stages[self.state.stage].name if self.state.stage < len(stages) else None
        self.segment_from = self.state.global_step
        self.ctx.files.events.write(SegmentStartEvent(step=self.state.global_step, stage=stage,
                                                      layout=self.layout.short(), why=why))

    # -- checkpoints ----------------------------------------------------------------------------------

    def save(self, reason: str, handoff: bool = False, weights: dict[str, torch.Tensor] | None = None) -> None:
        """A checkpoint; with `handoff`, also the full weights the next segment starts from (`weights`
        when the stage's artifact has gathered them already)."""
        state, files = self.state, self.ctx.files
        state.spike = self.guard.state_dict()
        state.rollbacks = self.rollbacks
        state.engine_layout = self.layout.model_dump(mode="json")
        state.layout = None if self.layout == self.segment.layout else self.layout.model_dump(mode="json")

        def save_engine(directory: Path) -> None:
            assert self.engine is not None
            self.engine.save(directory)
            if handoff:
                write_full_weights(self.engine, self.ctx.plan.model, directory / HANDOFF_DIR, weights)

        path = checkpoint.save(files.checkpoints, state.global_step, vars(state).copy(), save_engine,
                               self.ctx.options.keep_checkpoints)
        stages = self.ctx.task.stages
        files.events.write(CheckpointEvent(
            step=state.global_step, stage=stages[state.stage].name if state.stage < len(stages) else None,
            path=str(path.relative_to(files.run_dir)), reason=reason))

    def resume_from(self, last: Path) -> None:
        """Restore the checkpoint this launch resumes (torn log lines dropped first), and say so."""
        events = self.ctx.files.events
        torn = events.truncate_after(None)
        if torn:
            events.write(TornLinesEvent(file=EVENTS_FILE, skipped=torn))
        self.restore(last)
        events.write(ResumeEvent(from_=last.name, step=self.state.global_step))
        saved = self.state.engine_layout  # written under another layout (a plan re-made for another device count):
        if self.handoff is None and saved and Layout.model_validate(saved) != self.layout:  # read resharded
            events.write(ReshardedEvent(from_=last.name, saved_layout=Layout.model_validate(saved).short(),
                                        layout=self.layout.short()))

    def restore(self, target: Path, **kept: Any) -> None:
        """Load the checkpoint `target` into the engine, the loop state (but for the fields in
        `kept`) and the spike guard; the logged steps after it will be redone. At a stage start the
        guard starts afresh, as the stage itself does (the checkpoint holds the previous stage's)."""
        files = self.ctx.files
        self.state.take(checkpoint.load(target, self._engine_loader(target)))
        for name, value in kept.items():
            setattr(self.state, name, value)
        self.guard.load_state_dict(self.state.spike)
        if self.state.step_in_stage == 0:
            self.guard = self.fresh_guard()
        torn = files.metrics.truncate_after(self.state.global_step)
        if torn:
            files.events.write(TornLinesEvent(file=METRICS_FILE, skipped=torn))
        files.scalars.truncate_after(self.state.global_step)

    def _engine_loader(self, target: Path) -> Callable[[Path], None]:
        """How `target` restores the engine: its own state, or, where it ends the previous segment,
        the full weights it hands on (the engine is rebuilt from them when a rollback goes there)."""
        if not self._crosses_segments(target):
            if segment_of(self.ctx.plan, checkpoint.stage_of(target)) != self.segment:
                raise UsageError(f"checkpoint {target.name} belongs to stages that run another layout; "
                                 "cannot go back past the start of this layout's stages")
            assert self.engine is not None
            return self.engine.load
        if self.handoff != target / HANDOFF_DIR:
            self.handoff = target / HANDOFF_DIR
            self.engine = self._build_engine()
        return lambda _: None

    def _crosses_segments(self, checkpoint_dir: Path) -> bool:
        """Whether `checkpoint_dir` ends a segment whose layout differs from the next stage's."""
        stage = checkpoint.stage_of(checkpoint_dir)
        return (checkpoint_dir / HANDOFF_DIR).is_dir() and 0 < stage == segment_of(self.ctx.plan, stage).first

    def choose(self, below: int | None, stage: int | None = None) -> Path | None:
        """The newest good checkpoint (the ranks' joint choice; with `below`, the newest good ones before that
        step, stepping back `self.steps_back` of them, within `stage` when given); damaged ones
        passed over are logged."""
        files = self.ctx.files
        good, damaged = checkpoint.good_checkpoints(files.checkpoints, below, wanted=self.steps_back + 1)
        for name, problem in damaged:
            files.events.write(CheckpointDamagedEvent(path=name, problem=problem))
        if stage is not None:
            good = [p for p in good if checkpoint.stage_of(p) == stage] or good[:1]
        if below is None or not good:
            return good[0] if good else None
        return good[min(self.steps_back, len(good) - 1)]

    def _last_checkpoint(self) -> Path:
        target = self.choose(None)
        if target is None:
            raise RuntimeError(f"no checkpoint in {self.ctx.files.checkpoints} verifies: nothing to go back to")
        return target

    # -- the two ways back during training ------------------------------------------------------------

    def fall_back(self, stage: str, error: str) -> None:
        """Out of memory: switch to the plan's next layout that these processes can run, from the
        last checkpoint (several ranks: ask the launcher to restart them all with it)."""
        ctx, state = self.ctx, self.state
        replacement, skipped = next_layout(ctx.plan, self.failed_layouts, ctx.dev.type)
        target = self._last_checkpoint()
        step, failed = state.global_step + 1, self.layout.short()
        fallback = OOMFallbackEvent(step=step, stage=stage, error=error[:300], failed=failed,
                                    replacement=replacement.short() if replacement else None, from_=target.name,
                                    skipped=skipped)
        if replacement is not None and ctx.world > 1:  # the others may be stuck in a collective
            request_relaunch(ctx.files.run_dir, ctx.plan, replacement, self.failed_layouts,
                             event_record(fallback.model_copy(update={"relaunch": True})))
            raise UsageError(f"out of memory at step {step} with {failed}: the launcher restarts the ranks "
                             f"with {replacement.short()}")
        ctx.files.events.write(fallback)
        if replacement is None:
            ctx.files.events.write(StopEvent(reason="out of memory: no fallback left in the plan"))
            raise UsageError(f"out of memory at step {step} with {failed}: no fallback left in the plan; plan "
                             "with a smaller micro-batch, recomputation or more devices")
        self.engine = None  # drop the failed engine's model, gradients and optimizer state
        free_memory()
        self.layout = replacement
        self.failed_layouts.append(replacement)
        self.engine = self._build_engine()
        self.restore(target, skips=state.skips, lr_scale=state.lr_scale, oom_fallbacks=state.oom_fallbacks + 1)
        self.log_segment("oom_fallback")

    def roll_back(self, stage: Stage, step: Step, reason: str) -> None:
        """A loss spike: back to the last checkpoint, skip this step's batch, cool the learning rate
        (until the stage ends). The same spike again (no step passed it since) means that checkpoint
        was taken on the bad path: go back one checkpoint further and skip all data since it."""
        state, files, options = self.state, self.ctx.files, self.ctx.options
        spike_step = state.global_step + 1
        files.events.write(SpikeEvent(step=spike_step, stage=stage.spec.name, loss=step.loss,
                                      grad_norm=step.grad_norm, reason=reason))
        self.rollbacks += 1
        if self.rollbacks > options.max_rollbacks:
            files.events.write(StopEvent(reason=f"more than {options.max_rollbacks} rollbacks"))
            raise TrainingStopped(f"training stopped after {options.max_rollbacks} rollbacks: {reason}; the "
                                  f"checkpoints in {files.checkpoints} hold the last good steps: lower the stage's "
                                  "learning rate (or its batch's noise) and train again")
        repeated = self.last_spike is not None and spike_step <= self.last_spike
        self.steps_back = self.steps_back + 1 if repeated else 0
        self.last_spike = spike_step
        target = self.choose(spike_step, stage.index)
        if target is None:
            raise RuntimeError(f"no checkpoint in {files.checkpoints} verifies: nothing to roll back to")
        discarded = checkpoint.discard_after(files.checkpoints, checkpoint.step_of(target)) if self.steps_back else []
        skips = state.skips
        self.restore(target)
        start = state.positions[stage.index] if self.steps_back else step.position
        window = [stage.index, min(start, step.position),
                  advance(step.position, self.layout.global_batch, stage.index, [])]
        state.skips = skips + [window]
        state.lr_scale *= options.spike_lr_factor
        files.events.write(RollbackEvent(to=target.name, step=state.global_step, skipped=window[1:],
                                         lr_scale=state.lr_scale, steps_back=self.steps_back, discarded=discarded))
        if state.global_step < self.segment_from:  # back past this launch's start: its steps are redone here
            self.log_segment("rollback")


def _saved_layout(path: Path | None, default: Layout) -> Layout:
    """The layout a checkpoint was trained with after an OOM fallback, else `default` (also when the
    plan was re-made for another number of devices: the fallback belonged to the old count)."""
    if path is None:
        return default
    saved = checkpoint.saved_layout_record(path)
    layout = type(default).model_validate(saved) if saved else default
    return layout if layout.devices == default.devices else default
