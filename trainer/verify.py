"""Verify a plan before training on it: run each of its top K layouts for a few real steps, measure
them, and pick the fastest measured (the source article: "run small stress tests to find the batch
size and split that suit your own hardware").

Both ways of timing a candidate run `advisor train`'s own engines and step code:

* `fork` (CPU): the trainer's timed steps (trainer/timed_steps.py) fork the layout's ranks from
  this process and step the plan's model on random tokens: about a second of start-up per trial.
* `loop` (GPUs, which forked children cannot use): the real training loop (`trainer.launch.run`)
  on the task's first stage, capped at a few steps, in RUN_DIR/verify/<rank>/ (its checkpoints
  are removed afterwards). Its summary also gives the measured peak memory.

Every candidate shares the plan's global batch, so the fastest step is the highest tokens/s.
`verify.json` in the run dir records predicted against measured per candidate.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from specs.plan_file import Plan, PlannedLayout
from specs.core import HardwareSpec, Layout
from specs.run_dir import (CHECKPOINTS_DIR, DATA_CACHE_DIR, METRICS_FILE, PLAN_FILE, SUMMARY_FILE, VERIFY_DIR,
                           VERIFY_FILE, VerifyEvent, read_json_lines)
from planner.granularity import restage
from profiler.ranks import free_port
from trainer.launch import cpu_threads, run as run_training
from trainer.options import TrainOptions
from trainer.timed_steps import time_layout

# Switch away from the planner's choice only for a measured gain above this: a trial of a few
# steps on a shared machine is noisy, and the cost model's ranking is the tie-breaker.
MIN_GAIN = 0.03
# A trial's start-up, roughly (forking ranks; or torchrun, imports and DeepSpeed's set-up): the
# progress display's prior for the time a trial takes besides its steps.
STARTUP_S = {"fork": 3.0, "loop": 20.0}
# Steps of a CPU trial by default (2 warm up). A CPU step of the demo's layouts varies by +-15% from
# step to step on 2 shared cores (220-370 ms measured): two timed steps put one layout 10.6% ahead of
# another that trained as fast, and the run trained it. Eight timed steps show that spread, which
# then sets the noise margin (`choose`); a forked trial's step is a fraction of a second.
CPU_TRIAL_STEPS = 10
# A trial that would first pay a one-time set-up (a cold build of a native op) is run only where the
# set-up is at most this share of the plan's predicted training time: the demo's 3-minute run lost
# 40 s to building DeepSpeed's CPU op for two ZeRO candidates predicted 5% slower than its choice,
# while for an hour's training the same build is 1% of the run.
SETUP_SHARE = 0.1


class Trial(VerifyEvent):
    """One candidate: what the cost model said and what a few real steps measured (the fields are
    `VerifyEvent`'s; rank 1 is the planner's choice). Mutable: `verify` fills it in as the trial runs."""

    def model_post_init(self, context: Any) -> None:
        # a trial is written whole, its unfilled fields included (verify.json, events.jsonl), where
        # `event_record` leaves out the fields an event was not given
        self.__pydantic_fields_set__.update(type(self).model_fields)

    @property
    def spread(self) -> float:
        """Relative spread of the timed steps (after the warm-up): (max - min) / median."""
        timed = sorted(self.steps_s[2:])
        return (timed[-1] - timed[0]) / timed[len(timed) // 2] if len(timed) > 1 and timed[0] > 0 else 0.0

    @property
    def step_error(self) -> float | None:
        """predicted / measured - 1."""
        return self.predicted_step_s / self.measured_step_s - 1 if self.measured_step_s else None

    def record(self) -> dict[str, Any]:
        """The trial as verify.json and `advisor run --json` list it: its fields, then its step error."""
        return {**self.model_dump(exclude={"event"}), "step_error": self.step_error}


@dataclass
class Verification:
    trials: list[Trial]
    chosen_rank: int  # the rank of the layout to train (1 when no trial beat the planner's choice)
    seconds: float
    steps: int
    reason: str


def training_threads(devices: int, hardware: HardwareSpec) -> int:
    """CPU threads per rank that training will use (trainer/launch.py `cpu_threads`); 0 on GPUs."""
    if hardware.device_type != "cpu":
        return 0
    return cpu_threads(hardware, devices)


def trial_harness(layout: Layout, device_type: str, steps: int | None = None) -> tuple[str, int]:
    """How `layout` is timed and its step count (both leave their first 2 steps out): forked ranks on
    CPU; on GPUs the training loop under its launcher. `steps` None: the harness's default."""
    if device_type == "cpu":
        return "fork", steps or CPU_TRIAL_STEPS
    return "loop", max(steps or 4, 4)


def _no_watch(trial: Trial, metrics: Path | None) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def candidate_plan(plan: Plan, planned: PlannedLayout, first_stage_only: bool = False) -> Plan:
    """The plan with `planned` as its chosen layout; its stages re-sized for that layout."""
    old = plan.chosen.layout
    others = [p for p in [plan.chosen, *plan.alternatives] if p.layout != planned.layout]
    stages = []
    for spec, stage in zip(plan.task.stages if plan.task else [], plan.stages):
        if stage.layout == old:
            nodes = max(1, -(-planned.layout.devices // plan.gpus_per_node))
            one_pass = round(stage.tokens / spec.epochs) if spec.epochs else None  # 0: sized at run time
            stage = restage(plan, plan.task, spec, planned.layout, planned.estimate, nodes, one_pass_tokens=one_pass)
        stages.append(stage)
    update: dict[str, Any] = {"chosen": planned, "alternatives": others, "stages": stages}
    if first_stage_only and plan.task is not None:
        update["task"] = plan.task.model_copy(update={"stages": plan.task.stages[:1]})
        update["stages"] = stages[:1]
    return plan.model_copy(update=update)


def _fork_trial(plan: Plan, planned: PlannedLayout, steps: int, warmup: int, threads: int) -> dict[str, Any]:
    timed = time_layout(plan.model, planned.layout, steps=steps, warmup=warmup, threads=threads, engine=plan.engine)
    return {"step_s": timed.step_s, "steps_s": timed.steps_s, "peak_bytes": timed.peak_bytes,
            "peak_source": timed.peak_source}


def _loop_trial(plan: Plan, planned: PlannedLayout, steps: int, directory: Path, run_dir: Path,
                trusted: bool = False) -> dict[str, Any]:
    trial = candidate_plan(plan, planned, first_stage_only=True)
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (run_dir / DATA_CACHE_DIR).mkdir(parents=True, exist_ok=True)
    (directory / DATA_CACHE_DIR).symlink_to((run_dir / DATA_CACHE_DIR).resolve())  # tokenise once for all trials
    plan_path = directory / PLAN_FILE
    trial.write(plan_path)
    options = TrainOptions(max_steps_per_stage=steps, show_progress=False, eval_sequences=1, exact_match_prompts=0,
                           trust_remote_code=trusted)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run_training(trial, directory, False, options, None, 0, "127.0.0.1", free_port())
    summary = json.loads((directory / SUMMARY_FILE).read_text())
    shutil.rmtree(directory / CHECKPOINTS_DIR, ignore_errors=True)
    steps_s = [m["step_s"] for m in read_json_lines(directory / METRICS_FILE).records]
    measured = summary["measured"]
    return {"step_s": measured["step_s"], "steps_s": steps_s, "peak_bytes": measured.get("peak_bytes"),
            "peak_source": measured.get("peak_source")}


def predicted_training_s(plan: Plan) -> float:
    """The plan's predicted training time (its stages' hours); infinite for a plan without stages."""
    return sum(stage.hours for stage in plan.stages) * 3600 if plan.stages else math.inf


def trial_candidates(plan: Plan, k: int, setup_s: Callable[[Layout], float]) -> tuple[list[PlannedLayout],
                                                                                        list[PlannedLayout]]:
    """The layouts to verify: the planner's choice, then its alternatives in rank order up to `k` in
    all, passing over one whose trial would first pay a one-time set-up (`setup_s`: seconds, 0 for
    none) above SETUP_SHARE of the predicted training time. A set-up the choice or an earlier
    candidate pays is paid: the later ones sharing it cost nothing more. Returns (kept, passed over)."""
    budget = SETUP_SHARE * predicted_training_s(plan)
    paid = setup_s(plan.chosen.layout) > 0  # the choice trains through it: paid whatever the trials
    kept, passed = [plan.chosen], []
    for planned in plan.alternatives:
        if len(kept) >= k:
            break
        cost = 0.0 if paid else setup_s(planned.layout)
        if cost > budget:
            passed.append(planned)
            continue
        paid = paid or cost > 0
        kept.append(planned)
    return kept, passed


def verify(plan: Plan, k: int, run_dir: Path, steps: int | None = None, warmup: int = 2,
           say: Callable[[str], None] = print,
           watch: Callable[[Trial, Path | None], contextlib.AbstractContextManager] = _no_watch,
           trusted: bool = False, candidates: list[PlannedLayout] | None = None) -> Verification:
    """Measure the plan's top `k` layouts (or `candidates`, the choice first) for `steps` steps each and
    pick the fastest measured; each trial runs inside `watch(trial, its metrics.jsonl or None)` (the
    CLI's progress display). `trusted`: --trust-remote-code, passed to the trials' workers."""
    started = time.perf_counter()
    device_type = plan.hardware.device_type
    candidates = candidates or [plan.chosen, *plan.alternatives][:k]
    trials = []
    for rank, planned in enumerate(candidates, 1):
        est, layout = planned.estimate, planned.layout
        trial = Trial(rank=rank, layout=layout.short(), predicted_step_s=est.time.step_s,
                      predicted_tokens_per_s=est.throughput.tokens_per_s, predicted_peak_bytes=int(est.memory.peak),
                      threads=training_threads(layout.devices, plan.hardware))
        trial.harness, trial.steps = trial_harness(layout, device_type, steps)
        forked = trial.harness == "fork"
        say(f"verify {rank}/{len(candidates)}: {layout.short()} ({trial.steps} steps, {trial.harness})")
        began = time.perf_counter()
        directory = run_dir / VERIFY_DIR / str(rank)
        try:
            with watch(trial, None if forked else directory / METRICS_FILE):
                if forked:
                    measured = _fork_trial(plan, planned, trial.steps, warmup, trial.threads)
                else:
                    measured = _loop_trial(plan, planned, trial.steps, directory, run_dir, trusted)
        except Exception as exc:  # an OOM or a back-end failure rules the candidate out, not the run
            trial.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
            say(f"verify {rank}: failed ({trial.error})")
        else:
            trial.measured_step_s = measured["step_s"]
            trial.steps_s = list(measured["steps_s"])
            trial.peak_bytes = measured.get("peak_bytes")
            trial.peak_source = measured.get("peak_source")
            if trial.measured_step_s:
                trial.measured_tokens_per_s = layout.tokens_per_step / trial.measured_step_s
        trial.seconds = time.perf_counter() - began
        trials.append(trial)
    chosen, reason = choose(trials)
    return Verification(trials=trials, chosen_rank=chosen, seconds=time.perf_counter() - started,
                        steps=max(t.steps for t in trials), reason=reason)


def choose(trials: list[Trial]) -> tuple[int, str]:
    """The rank to train: the fastest measured, unless it beats the planner's choice by less than
    the noise (MIN_GAIN, or the larger relative spread of the two trials' timed steps); the
    planner's choice when nothing measured."""
    measured = [t for t in trials if t.measured_tokens_per_s]
    if not measured:
        return 1, "no trial finished: the planner's choice stands"
    best = max(measured, key=lambda t: t.measured_tokens_per_s or 0.0)
    first = next((t for t in measured if t.rank == 1), None)
    if first is None:
        return best.rank, f"the planner's choice failed its trial; #{best.rank} measured fastest"
    if best.rank == 1:
        return 1, "the planner's choice measured fastest"
    gain = best.measured_tokens_per_s / first.measured_tokens_per_s - 1  # type: ignore[operator]
    margin = max(MIN_GAIN, best.spread, first.spread)
    if gain < margin:
        return 1, (f"#{best.rank} measured {100 * gain:.1f}% faster, within the {100 * margin:.0f}% noise "
                   "margin of the trials: the planner's choice stands")
    return best.rank, f"#{best.rank} measured {100 * gain:.1f}% faster than the planner's choice"


def apply(plan: Plan, verification: Verification) -> Plan:
    """The plan to train: the chosen candidate first, with a note of what the trials measured."""
    if verification.chosen_rank == 1:
        chosen = plan
    else:
        trained = next(t.layout for t in verification.trials if t.rank == verification.chosen_rank)
        chosen = candidate_plan(plan, next(p for p in plan.alternatives if p.layout.short() == trained))
    note = (f"verified {len(verification.trials)} layouts for {verification.steps} steps each in "
            f"{verification.seconds:.0f} s: {verification.reason}")
    return chosen.model_copy(update={"notes": [*plan.notes, note]})


def write_verification(run_dir: Path, verification: Verification) -> Path:
    """RUN_DIR/verify.json: every candidate's predicted and measured figures and the decision."""
    record = {"chosen_rank": verification.chosen_rank, "reason": verification.reason,
              "seconds": verification.seconds, "steps": verification.steps,
              "trials": [t.record() for t in verification.trials]}
    path = run_dir / VERIFY_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)
    return path
