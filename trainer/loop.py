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

from pathlib import Path
from typing import Any

from specs.errors import UsageError
from specs.plan_file import Plan
from specs.run_dir import DataEvent, ResumeEvent
from profiler.tensor_memory import TensorMemory
from trainer.engines import device
from trainer.evaluator import Evaluator
from trainer.loop_state import LoopState
from trainer.model import check_weights
from trainer.options import TrainOptions
from trainer.prepared import prepared_dir
from trainer.recovery import Recovery
from trainer.run_context import RunContext, rank_world
from trainer.run_files import RunFiles
from trainer.run_identity import restarted
from trainer.run_length import change_length
from trainer.run_reuse import run_tokenizer, vocab_size
from trainer.run_summary import finish
from trainer.stage_runner import StageRunner, progress_bars

__all__ = ["LoopState", "TrainOptions", "train"]


def train(plan: Plan, run_dir: Path, resume: bool, options: TrainOptions) -> dict[str, Any]:
    """Run the plan's curriculum in `run_dir` (resuming from its last checkpoint when `resume`).

    Every rank runs this; rank 0 writes the run dir's files. A restart by torchrun or Slurm resumes. A
    step is redone, not counted, after an out-of-memory fallback or a spike rollback: both restore
    the last checkpoint first."""
    run = Run(plan, run_dir, options)
    run.restore_or_start(resume or restarted())
    state, recovery, stages = run.state, run.recovery, run.stages
    with stages.progress, run.ctx.files.scalars:
        while state.stage < recovery.segment.end:
            stage = stages.start_stage()
            while state.stage == stage.index and state.step_in_stage < stage.steps:
                step = stages.take_step(stage)
                if step is None:  # out of memory: fell back to the plan's next layout
                    continue
                reason = recovery.guard.check(step.loss, step.grad_norm)
                if reason is not None:
                    recovery.roll_back(stage, step, reason)
                    stages.show_progress(stage)
                    continue
                stages.record(stage, step)
                if stages.checkpoint_due(stage):
                    recovery.save("interval")
            if state.stage != stage.index:  # rolled back into the previous stage (no good checkpoint in this one)
                continue
            run.evaluator.evaluate(stage.index, recovery.engine, recovery.layout, state.global_step)
            stages.end_stage(stage)
    if state.stage < len(run.ctx.task.stages):  # the next stage runs another layout: the launcher goes on
        return {"finished": False, "segment_end": state.stage}
    return finish(stages, run.evaluator, run.memory)


class Run:
    """One training run's components, each with its own state, and the loop state they share: the
    run dir's files (in the context), the recovery (checkpoints, rollbacks, fallbacks: it owns the
    layout in force and its engine), the stage runner, the evaluator; the summary is written from them."""

    def __init__(self, plan: Plan, run_dir: Path, options: TrainOptions):
        if plan.task is None or not plan.stages:
            raise UsageError("the plan has no task stages: plan with --task task.yaml")
        rank, world = rank_world()
        files = RunFiles(run_dir, rank == 0)
        # before the run dir is claimed: a refusal leaves no run
        check_weights(plan.model, options.weights, options.trust_remote_code)
        self.ctx = RunContext(plan, options, files, device(), rank, world, run_tokenizer(plan, options),
                              vocab_size(plan))
        self.memory = TensorMemory(self.ctx.dev)  # before the model is built: it counts what is allocated from now on
        self.state = LoopState(positions=[0] * len(plan.task.stages))
        self.recovery = Recovery(self.ctx, self.state)
        self.evaluator = Evaluator(self.ctx)

    def restore_or_start(self, resume: bool) -> None:
        """Resume from the last good checkpoint (with the layout it, or an OOM relaunch, switched to),
        else start fresh in a directory that holds no other run, and save the rollback target of step 1."""
        ctx, recovery, events = self.ctx, self.recovery, self.ctx.files.events
        saved_length, length = ctx.files.claim(ctx.plan, ctx.options, ctx.tokenizer, resume)
        last = recovery.choose(None) if resume else None
        recovery.open(last, resume)
        prepared = prepared_dir(ctx.task, ctx.options.data, recovery.layout.seq, ctx.vocab)
        progress = progress_bars(ctx.options.show_progress and ctx.main)
        self.stages = StageRunner(ctx, self.state, recovery, prepared, length, progress)
        if resume and last is None and ctx.main:
            events.write(ResumeEvent(from_=None, note="no checkpoint yet: starting fresh"))
        if last is not None:
            recovery.resume_from(last)
        if prepared is not None:
            events.write(DataEvent(source="prepared", dir=str(prepared)))
        if last is None:
            recovery.save("start")  # the rollback target before the first step
        if last is not None and saved_length not in (None, length):
            change_length(self.stages, saved_length)
        recovery.settle()
        recovery.log_segment("resume" if last is not None else "start")
