"""The curricula `advisor curriculum compare` trains, each a TaskSpec derived from the user's task.

Every variant trains on the same total tokens as the task as written (the sum of its stage budgets)
and is scored on the same skills: the stages with eval data. The variants:

* ``one-pot``: no curriculum. Every stage keeps its name, budget and eval data (its end is an
  evaluation point), but all draw the same pooled mixture: each data file weighted by the tokens the
  task as written draws from it (its own stages' share and the replays of it). One WSD schedule over
  the run (warm up once, hold the first stage's learning rate, decay at the end): nothing restarts at a
  boundary, so the boundaries only mark where it is evaluated.
* ``staged``: the hard switch. The stages in order without the closing mixed stage (its tokens go
  to the others in proportion to their budgets), no replay, no ramp.
* ``staged+replay``: the same stages, each after the first ramping in from the previous stage's data
  over its first RAMP_FRACTION of steps (unless it sets `ramp_steps`) and replaying the earlier stages
  (as written; where a stage writes no replay, DEFAULT_REPLAY of its tokens, split evenly over the
  earlier stages).
* ``staged+replay+mixed``: the task as written.
* ``late-mix``: two-phase pretraining. One-pot's pooled mixture during the warm-up and the stable
  phase, then, from the first step of the decay on, a stage (LATE_MIX_STAGE) whose mix upweights the
  later skills (the own data of every stage after the first, by their budgets) and replays
  LATE_MIX_REPLAY of the pooled mixture. The mix changes exactly where the rate starts to decay.

The schedule is the same for all (`fair_schedule`): one warmup-stable-decay (WSD) over the run, at
one peak rate for every stage, with the first stage's warm-up and floor, decaying over the run's last
`wsd_decay_fraction` of steps. So the variants differ only in which data each step draws, never in
the rate it draws it at; `advisor curriculum compare` then tunes that one peak rate per variant.

The closing mixed stage is the last stage when it replays earlier ones and has no eval data of its
own (the source article's shape); a task without one has staged+replay+mixed = the task as written.
"""

from __future__ import annotations

import math

from specs.errors import UsageError
from specs.task import DataSource, SpikeGuardSpec, StageSpec, TaskSpec

VARIANTS = ("one-pot", "staged", "staged+replay", "staged+replay+mixed", "late-mix")
RAMP_FRACTION = 0.2  # of a stage's steps, when it sets no ramp_steps of its own
DEFAULT_REPLAY = 0.2  # of a stage's tokens, spread over the earlier stages, when it writes no replay
PROXY_GLOBAL_BATCH = 16  # sequences per step when the task sets no global_batch
LATE_MIX_STAGE = "late-mix"  # late-mix's decay stage
# late-mix's decay draws this share from the pooled mixture (the replay of two-phase pretraining's
# second phase) and the rest from the later skills' own data
LATE_MIX_REPLAY = 0.3


def stage_token_budgets(task: TaskSpec) -> dict[str, int]:
    """Each stage's tokens; a `steps:` budget counts the task's tokens per step (global batch x
    seq_len: a stage with its own seq_len keeps the tokens per step, see planner/plan.py)."""
    budgets = {}
    for stage in task.stages:
        budgets[stage.name] = task.stage_tokens(stage, tokens_per_step(task))
    return budgets


def scaled(task: TaskSpec, scale: float) -> TaskSpec:
    """Every stage's token budget times `scale`; warm-ups and ramps (steps) with it, or a short stage
    would be all warm-up."""
    if scale == 1:
        return task
    budgets = stage_token_budgets(task)
    stages = [s.model_copy(update={"tokens": max(1, int(budgets[s.name] * scale)), "steps": None,
                                   "warmup_steps": max(1, round(s.warmup_steps * scale)) if s.warmup_steps else 0,
                                   "ramp_steps": round(s.ramp_steps * scale)})
              for s in task.stages]
    return task.model_copy(update={"stages": stages})


def mixed_stage(task: TaskSpec) -> StageSpec | None:
    """The closing mixed stage: the last one, when it replays earlier stages and brings no skill of
    its own to evaluate (no eval_sources)."""
    last = task.stages[-1]
    return last if len(task.stages) > 1 and last.replay and not last.eval_sources else None


def skills(task: TaskSpec) -> list[str]:
    """The stages with eval data: what every variant is scored on (the trainer names evals by stage)."""
    return [s.name for s in task.stages if s.eval_sources and s is not mixed_stage(task)]


def pooled_mixture(task: TaskSpec) -> list[DataSource]:
    """Every data file of the task, weighted by the share of the run's tokens drawn from it."""
    budgets = stage_token_budgets(task)
    by_name = {s.name: s for s in task.stages}
    drawn: dict[str, tuple[DataSource, float]] = {}
    for stage in task.stages:
        draws = [(stage, 1.0 - sum(stage.replay.values()))] + [(by_name[n], share) for n, share in stage.replay.items()]
        for owner, share in draws:
            total_weight = sum(src.weight for src in owner.sources) or 1.0
            for src in owner.sources:
                key = f"{src.path}|{src.text_field}|{src.domain}"
                _, tokens = drawn.get(key, (src, 0.0))
                drawn[key] = (src, tokens + share * src.weight / total_weight * budgets[stage.name])
    total = sum(tokens for _, tokens in drawn.values())
    return [src.model_copy(update={"weight": tokens / total}) for src, tokens in drawn.values() if tokens > 0]


def _renamed(task: TaskSpec, variant: str, stages: list[StageSpec], **update) -> TaskSpec:
    # another name: the demo's generated data is stamped for the task preset of that name alone
    return task.model_copy(update={"name": f"{task.name}-{variant}", "stages": stages, **update})


def one_pot(task: TaskSpec) -> TaskSpec:
    budgets = stage_token_budgets(task)
    pool = pooled_mixture(task)
    lr = task.stages[0].lr
    stages = [s.model_copy(update={"sources": pool, "replay": {}, "ramp_steps": 0, "lr": lr, "tokens": budgets[s.name],
                                   "steps": None, "method": task.stages[0].method})
              for s in task.stages]
    return _renamed(task, "one-pot", stages, lr_schedule="wsd")


def tokens_per_step(task: TaskSpec) -> int:
    return (task.global_batch or PROXY_GLOBAL_BATCH) * task.seq_len


def whole_steps(budgets: dict[str, int], total_steps: int) -> dict[str, int]:
    """`total_steps` shared over the stages in proportion to their budgets, at least one each, by
    largest remainder: the variants' totals are equal to the step, not only to rounding."""
    total = sum(budgets.values())
    exact = {name: total_steps * tokens / total for name, tokens in budgets.items()}
    steps = {name: max(1, math.floor(x)) for name, x in exact.items()}
    for name in sorted(exact, key=lambda n: exact[n] - math.floor(exact[n]), reverse=True):
        if sum(steps.values()) >= total_steps:
            break
        steps[name] += 1
    return steps


def task_steps(task: TaskSpec) -> int:
    """The optimizer steps the task as written trains (the planner rounds each stage up to a step)."""
    step = tokens_per_step(task)
    return sum(math.ceil(tokens / step) for tokens in stage_token_budgets(task).values())


def _without_mixed(task: TaskSpec) -> list[StageSpec]:
    """The stages before the mixed one, its steps shared out in proportion to their budgets."""
    budgets = stage_token_budgets(task)
    mixed = mixed_stage(task)
    kept = [s for s in task.stages if s is not mixed]
    steps = whole_steps({s.name: budgets[s.name] for s in kept}, task_steps(task))
    step = tokens_per_step(task)
    return [s.model_copy(update={"tokens": steps[s.name] * step, "steps": None}) for s in kept]


def hard_switch(task: TaskSpec) -> TaskSpec:
    stages = [s.model_copy(update={"replay": {}, "ramp_steps": 0}) for s in _without_mixed(task)]
    return _renamed(task, "staged", stages)


def with_replay(task: TaskSpec) -> TaskSpec:
    stages = _without_mixed(task)
    out = [stages[0]]
    for i, stage in enumerate(stages[1:], start=1):
        replay = stage.replay or {earlier.name: DEFAULT_REPLAY / i for earlier in stages[:i]}
        steps = math.ceil((stage.tokens or 0) / tokens_per_step(task))
        ramp = stage.ramp_steps or max(1, round(RAMP_FRACTION * steps))
        out.append(stage.model_copy(update={"replay": replay, "ramp_steps": ramp}))
    return _renamed(task, "staged+replay", out)


def decay_steps(task: TaskSpec, run_steps: int) -> int:
    """The steps a WSD run of `run_steps` decays over, as the trainer counts them (trainer/schedule.py
    rounds the fraction; trainer.schedule.wsd_lr keeps at least one and leaves the warm-up whole)."""
    warmup = min(task.stages[0].warmup_steps, max(run_steps - 1, 0))
    return max(1, min(round(task.wsd_decay_fraction * run_steps), run_steps - warmup))


def later_sources(task: TaskSpec) -> list[DataSource]:
    """The own data of every stage after the first, each file weighted by the tokens its stage draws
    from it as written (the stage's budget less its replay share)."""
    budgets = stage_token_budgets(task)
    drawn: dict[str, tuple[DataSource, float]] = {}
    for stage in task.stages[1:]:
        own = (1.0 - sum(stage.replay.values())) * budgets[stage.name]
        total_weight = sum(src.weight for src in stage.sources) or 1.0
        for src in stage.sources:
            key = f"{src.path}|{src.text_field}|{src.domain}"
            _, tokens = drawn.get(key, (src, 0.0))
            drawn[key] = (src, tokens + own * src.weight / total_weight)
    total = sum(tokens for _, tokens in drawn.values()) or 1.0
    return [src.model_copy(update={"weight": tokens / total}) for src, tokens in drawn.values() if tokens > 0]


def late_mix(task: TaskSpec) -> TaskSpec:
    """One-pot's stages over the run's stable part, then LATE_MIX_STAGE over exactly its decay steps."""
    pot = one_pot(task)
    run_steps = task_steps(task)
    decay = decay_steps(task, run_steps)
    step = tokens_per_step(task)
    steps = whole_steps({s.name: s.tokens or 0 for s in pot.stages}, run_steps - decay)
    head = [s.model_copy(update={"tokens": steps[s.name] * step}) for s in pot.stages]
    names = {s.name.casefold() for s in head}
    name = next(n for n in (LATE_MIX_STAGE, *(f"{LATE_MIX_STAGE}-{i}" for i in range(2, 99)))
                if n.casefold() not in names)
    tail = head[-1].model_copy(update={"name": name, "sources": later_sources(task), "tokens": decay * step,
                                       "replay": {head[-1].name: LATE_MIX_REPLAY}, "eval_sources": [],
                                       "eval_tokens": 0, "ramp_steps": 0, "difficulty": None,
                                       "split_by": "none", "time_windows": {}})
    return _renamed(task, "late-mix", [*head, tail], lr_schedule="wsd")


# The comparison's spike guard: non-finite steps only. A loss or gradient-norm margin tuned for the
# task as written reads a mixed batch's loss (which moves with the skills it happens to hold) as a
# spike, rolls back, halves the rate and skips data: one variant would then train another schedule
# on other data, or stop, and the comparison would measure the guard instead of the order.
COMPARISON_GUARD = SpikeGuardSpec(loss_sigmas=None, loss_ratio=None, grad_norm_sigmas=None, grad_norm_ratio=None)


def fair_schedule(task: TaskSpec, peak_lr: float) -> TaskSpec:
    """`task` under the comparison's one schedule: WSD over the run, every stage at `peak_lr`, the first
    stage's warm-up and floor for all (WSD warms up once and decays once), the one `COMPARISON_GUARD`."""
    first = task.stages[0]
    stages = [s.model_copy(update={"lr": peak_lr, "warmup_steps": first.warmup_steps,
                                   "min_lr_ratio": first.min_lr_ratio}) for s in task.stages]
    return task.model_copy(update={"stages": stages, "lr_schedule": "wsd", "spike_guard": COMPARISON_GUARD})


def variant_tasks(task: TaskSpec, names: list[str] | tuple[str, ...] = VARIANTS,
                  peak_lr: float | None = None) -> dict[str, TaskSpec]:
    """The named variants of `task`, at the task's total tokens, each under `fair_schedule` at
    `peak_lr` (default: the task's first stage's rate)."""
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise UsageError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if len(task.stages) < 2:
        raise UsageError(f"task {task.name} has one stage: there is no curriculum to compare")
    if not skills(task):
        raise UsageError(f"task {task.name}: no stage has eval_sources, so there is nothing to score the variants on")
    if task.global_batch is None:  # the planner's default is ~2M tokens a step: far too many for a proxy
        task = task.model_copy(update={"global_batch": PROXY_GLOBAL_BATCH})
    build = {"one-pot": lambda: one_pot(task), "staged": lambda: hard_switch(task),
             "staged+replay": lambda: with_replay(task),
             "staged+replay+mixed": lambda: _renamed(task, "staged+replay+mixed", list(task.stages)),
             "late-mix": lambda: late_mix(task)}
    peak = task.stages[0].lr if peak_lr is None else peak_lr
    return {name: fair_schedule(build[name](), peak) for name in names}
