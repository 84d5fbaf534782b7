"""A resume with another run length (--steps, --epochs, --max-steps-per-stage, a task's stage
budgets): allowed where every step already trained keeps its learning rate, so the run goes on as if
the new length had been asked for from the start; then a finished run's last stage is reopened when
it grew. Refused otherwise, in one line."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specs.errors import UsageError
from specs.run_dir import LengthChangedEvent
from trainer.run_identity import update_length
from trainer.schedule import first_changed_rate

if TYPE_CHECKING:  # annotations only: the runner imports this module
    from trainer.stage_runner import StageRunner


def wsd_steps(length: dict[str, Any]) -> list[int]:
    """The stages' steps WSD counts, from a fingerprint's `length`: the planned ones, capped."""
    cap = length.get("max_steps_per_stage")
    return [min(steps, cap or steps) for steps in length["steps"]]


def change_length(runner: StageRunner, saved: dict[str, Any]) -> None:
    """Go on with `runner.length` where the checkpoint was trained under the length `saved`, or refuse."""
    ctx, state = runner.ctx, runner.state
    n, stage, done = len(ctx.task.stages), state.stage, state.step_in_stage
    trained = state.stage_steps[:stage + (1 if done else 0)]  # the stages started before the checkpoint
    if len(trained) < min(stage + (1 if done else 0), n):
        raise UsageError("--resume: this run's checkpoint does not record its stages' lengths (written by an "
                         "older trainer), so its length cannot change; resume with the length it was started with")
    new = [runner.stage_steps(i) for i in range(len(trained))]
    reopen = stage == n and new[-1] > trained[-1]
    if reopen:
        stage, done = n - 1, trained[-1]
    problem = _length_problem(runner, trained, new, stage, done, saved)
    if problem is not None:
        raise UsageError(f"--resume with another length: {problem}; train into another --out, or resume with "
                         "the length the run was started with")
    if reopen:  # the last stage goes on: its spike statistics with it
        state.stage, state.step_in_stage = stage, done
        runner.recovery.guard.load_state_dict(state.spike)
    ctx.files.events.write(LengthChangedEvent(step=state.global_step, stage_steps=new, was=trained))
    if ctx.main:
        update_length(ctx.files.run_dir, runner.length)


def _length_problem(runner: StageRunner, trained: list[int], new: list[int], stage: int, done: int,
                    saved: dict[str, Any]) -> str | None:
    """Why the new stage lengths `new` cannot continue a run that trained `trained` steps of its
    stages (now at step `done` of `stage`); None when they can."""
    task = runner.ctx.task
    names = [s.name for s in task.stages]
    for i in range(min(stage, len(new))):
        if new[i] != trained[i]:
            return f"stage '{names[i]}' ran {trained[i]} steps, the new length gives it {new[i]}"
    if stage < len(new) and done > new[stage]:
        return f"stage '{names[stage]}' has trained {done} steps, the new length gives it {new[stage]}"
    steps_done = [*trained[:stage], done][:len(new)]
    old_steps = [*trained, *new[len(trained):]]
    changed = first_changed_rate(task, steps_done, (old_steps, wsd_steps(saved)), (new, wsd_steps(runner.length)))
    if changed is not None:
        step, had, now = changed
        return (f"step {step}, already trained, had learning rate {had:.6g} and would have {now:.6g} (the "
                f"'{task.lr_schedule}' schedule depends on the run's length; `lr_schedule: constant` does not)")
    return None
