"""Sub-task granularity: steps per curriculum stage, the checkpoint cadence, and splits too fine.

The cadence is Young's interval in whole steps, and a stage's hours are its time to train
(planner/time_to_train.py: training, checkpoints at that cadence, expected failures) plus its
evaluations.
"""

from __future__ import annotations

import math

from specs.plan_file import Plan, StagePlan
from specs.core import Estimate, Layout
from specs.task import StageSpec, TaskSpec
from planner.time_to_train import RESTART_S, checkpoint_write_s, time_to_train, young_interval_s


def restage(plan: Plan, task: TaskSpec, stage: StageSpec, layout: Layout, est: Estimate, nodes: int,
            one_pass_tokens: int | None = None) -> StagePlan:
    """`stage` sized for `layout` under the plan's own assumptions (`Plan.assumptions`) and compute
    rule: the one way every caller (the planner, the trainer's one-stage plans, `advisor run`'s
    verification trials) sizes a stage."""
    a = plan.assumptions
    return plan_stage(task, stage, layout, est, nodes, a.mtbf_hours, a.checkpoint_write_gbs,
                      plan.min_compute_fraction, a.restart_s, one_pass_tokens=one_pass_tokens)


def plan_stage(
    task: TaskSpec, stage: StageSpec, layout: Layout, est: Estimate, nodes: int, mtbf_hours: float,
    checkpoint_write_gbs: float, min_compute_fraction: float, restart_s: float = RESTART_S,
    one_pass_tokens: int | None = None,
) -> StagePlan:
    """`one_pass_tokens`: for a stage budgeted in epochs, the tokens of one pass over its data (its
    own, with its replay share on top), counted from the data; without them the stage is sized at
    run time and planned as one step, with a flag that says so."""
    tokens_per_step = layout.tokens_per_step
    tokens = task.stage_tokens(stage, tokens_per_step)
    sized_at_run_time = stage.epochs is not None and not one_pass_tokens
    if stage.epochs is not None and one_pass_tokens:
        tokens = math.ceil(stage.epochs * one_pass_tokens)
    steps = max(1, math.ceil(tokens / tokens_per_step))
    step_s = est.time.step_s
    write_s = checkpoint_write_s(est, layout, nodes, checkpoint_write_gbs)
    job_mtbf_s = mtbf_hours * 3600 / nodes
    interval_steps = max(1, round(young_interval_s(write_s, job_mtbf_s) / step_s))
    interval_steps = min(interval_steps, steps)  # and one more at the stage end, always
    checkpoints = math.ceil(steps / interval_steps)
    train_s = steps * step_s
    wall = time_to_train(train_s, write_s, nodes, mtbf_hours, restart_s, interval_s=interval_steps * step_s)
    # evaluation runs forward only: about a third of a training step's FLOPs per token
    evals = (1 + (steps // task.eval_every_steps if task.eval_every_steps else 0)) if stage.eval_tokens else 0
    eval_s = evals * stage.eval_tokens / est.throughput.tokens_per_s / 3
    overhead = (checkpoints * write_s + eval_s) / train_s
    flags = []
    if sized_at_run_time:
        flags.append(f"sized at run time: {stage.epochs:g} epochs over data that could not be read when "
                     "planning; the trainer counts its rows at the stage start (planned here as one step)")
    if overhead > 1 - min_compute_fraction and not sized_at_run_time:
        flags.append(f"split too fine: checkpoints and evaluation add {100 * overhead:.0f}% to this stage "
                     f"(more than the {100 * (1 - min_compute_fraction):.0f}% the compute rule allows); "
                     "merge it with a neighbour or give it more tokens")
    if steps < 10 and not sized_at_run_time:
        flags.append(f"only {steps} optimizer steps: the learning-rate warm-up alone may take them")
    return StagePlan(
        name=stage.name, method=layout.method, devices=layout.devices, layout=layout, tokens=tokens, steps=steps,
        step_s=step_s, hours=(wall.wall_s + eval_s) / 3600,
        checkpoint_every_steps=interval_steps, checkpoint_write_s=write_s, overhead_fraction=overhead, flags=flags,
    )
