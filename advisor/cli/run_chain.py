"""The `advisor run` chain: profile -> plan -> verify -> train -> feed back -> report, in one go.

The CLI's composition of every package (this is why it lives here, above reports): with no options
it runs the embedded demo: it generates the bundled curriculum (language, arithmetic reasoning,
instructions, then a mixed stage) into the cache on first use, profiles this machine (or reuses a profile
of it younger than a week), plans `demo-tiny` on it, measures the top plans for a few steps
(trainer/verify.py) and trains the fastest measured, then feeds the measured steps back into the
profile (profiler/feedback.py) and writes the run report.

Before training it checks that the cost model can price the plan on this machine at all: the
chosen plan's measured trial step against its prediction after the refit to the trials, within
planner/feedback.py's MAX_PRICE_MISS either way (`can_price`). A plan it cannot price is not trained (`--force` trains
it anyway): the run dir then holds `verify.json` and no more, and the profile is left as it was.

Files it adds to the run dir: `verify.json` (predicted against measured per candidate) and
`feedback.json` (the refit: factors and step-time error before and after); `events.jsonl` gets
one `verify` event per candidate and one `feedback` event after training.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from rich.console import Console

from advisor.cli.common import MIN_COMPUTE_FRACTION, stage_tokens
from advisor.cli.compose import profile_this_machine
from advisor.cli.progress import RunProgress, training_estimate_s
from advisor.cli.render import format_seconds
from specs.capabilities import config_shape, runnable_problem
from specs.errors import UsageError
from specs.plan_file import Plan
from specs.core import HardwareSpec, ModelSpec
from specs.task import TaskSpec
from specs.run_dir import (EVENTS_FILE, FEEDBACK_FILE, METRICS_FILE, PLAN_FILE, REPORT_DIR, FeedbackEvent, JsonLines,
                           VerifyEvent, matching_segment)
from planner.plan import PlanOptions, make_plan
from planner.search import SearchSpace
from presets import cache_dir, load_hardware, load_model, load_task
from planner.feedback import (MAX_PRICE_MISS, can_price, feed_back, observation, predict_step, price_miss,
                               refitted_hardware)
from specs.profile import FeedbackRound, fingerprint_mismatch, load_profile, looks_like_profile
from profiler.inventory import this_host
from profiler.ranks import free_port
from profiler.run_profile import ProfileOptions
from reports.run_report import run_report
from trainer.data.demo_corpus import ensure_generated_data
from trainer.launch import run as run_training
from trainer.native_ops import COLD_BUILD_S, cold_build_s, use_persistent_extensions_dir
from trainer.options import TrainOptions
from trainer.prepare import prepare_run
from trainer.run_identity import RUN_CHAIN_IN_THE_WAY, move_aside, move_in_the_way_aside, retire_old_runs
from trainer.verify import (SETUP_SHARE, STARTUP_S, Trial, Verification, apply, candidate_plan, predicted_training_s,
                            trial_candidates, trial_harness, training_threads, verify, write_verification)

DEMO_TASK = "demo"  # the task preset `advisor run` trains when no --task is given
PROFILE_MAX_AGE_S = 7 * 86400
DEFAULT_VERIFY = 3  # candidates measured before training (0: train the planner's choice untested)
DEFAULT_VERIFY_STEPS = None  # per candidate, the harness's default (trainer/verify.py: 10 on CPU, 4 on GPUs)
# What `run` lets the planner choose: what the trainer's engines run (specs/capabilities.py);
# `trainable_plan` re-checks a plan the user handed in.
TRAINER_SPACE = SearchSpace()


def trainable_plan(plan: Plan, say=print) -> Plan:
    """The plan without the layouts this trainer cannot run on its model; the first runnable one
    becomes the choice (stages re-sized for it)."""
    candidates = [plan.chosen, *plan.alternatives]
    shape = config_shape(plan.model.hf_config)
    reasons = [runnable_problem(p.layout, shape, plan.hardware.device_type, plan.engine) for p in candidates]
    runnable = [p for p, reason in zip(candidates, reasons) if reason is None]
    if not runnable:
        raise UsageError("the trainer runs none of the planned layouts: " + "; ".join(sorted(set(filter(None, reasons)))))
    if reasons[0] is not None:
        say(f"the planner's choice {plan.chosen.layout.short()} is not runnable here ({reasons[0]}); "
            f"taking {runnable[0].layout.short()}")
        plan = candidate_plan(plan, runnable[0])
    return plan.model_copy(update={"alternatives": [p for p in runnable if p.layout != plan.chosen.layout]})


@dataclass
class RunOptions:
    model: str | None = None
    task: str | None = None
    hardware: str | None = None
    out: Path = Path("runs/demo")
    max_steps_per_stage: int | None = None
    seed: int = 0
    verify: int = DEFAULT_VERIFY
    verify_steps: int | None = DEFAULT_VERIFY_STEPS
    feedback: bool = True
    force: bool = False  # train a plan the cost model cannot price (see `_pricing`)
    keep_runs: int = 3  # previous runs kept in the run dir; older ones move into its trash/
    trust_remote_code: bool = False  # the --model folder's own Python code (auto_map) may run


def _cached_profile_path() -> Path:
    return cache_dir() / "profiles" / f"{this_host().hostname}.json"


def _fresh_profile(path: Path) -> bool:
    """A profile of this machine younger than a week (by its `created` stamp: feedback rewrites
    the file, so its modification time says nothing about the measurements' age)."""
    if not path.is_file():
        return False
    try:
        profile = load_profile(path)
    except UsageError:
        return False  # corrupt, or another version: profile again
    age = (dt.datetime.now(dt.timezone.utc) - profile.created.astimezone(dt.timezone.utc)).total_seconds()
    return age < PROFILE_MAX_AGE_S and fingerprint_mismatch(profile) is None


def _hardware(opts: RunOptions, model: ModelSpec, say: Callable[[str], None],
              progress: RunProgress) -> tuple[HardwareSpec, str, Path | None]:
    """The hardware to plan on, what it came from, and the profile file that feedback updates
    (None for a preset): the one named, a fresh profile of this machine, or a new one."""
    if opts.hardware:
        hardware = load_hardware(opts.hardware)
        path = Path(opts.hardware)
        is_profile = False
        if path.is_file() and path.suffix == ".json":
            try:
                is_profile = looks_like_profile(json.loads(path.read_text()))
            except ValueError:
                pass
        return hardware, opts.hardware, path if is_profile else None
    path = _cached_profile_path()
    if _fresh_profile(path):
        say(f"reusing the profile of this machine from {path}")
        return load_hardware(str(path)), str(path), path
    say("profiling this machine (--quick)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with progress.profiling() as bar:
        profile = profile_this_machine(ProfileOptions(out=path, quick=True, model=model), bar)
    if profile is None:
        raise UsageError("profiling did not return a profile")
    return load_hardware(str(path)), str(path), path


def _append_events(run_dir: Path, records: list[VerifyEvent | FeedbackEvent]) -> None:
    JsonLines(run_dir / EVENTS_FILE).write_all(records)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_chain(opts: RunOptions, say: Callable[[str], None] = print,
              show_verification: Callable[[Any], None] | None = None,
              progress: RunProgress | None = None) -> dict[str, Any]:
    """Profile, plan, verify the top plans, train the fastest measured, feed back, report; `progress`
    shows all of it as one display."""
    progress = progress or RunProgress(Console(), enabled=False, title="")
    use_persistent_extensions_dir()  # before any rank starts: they all inherit it
    if opts.verify < 0 or (opts.verify_steps is not None and opts.verify_steps < 3):
        raise UsageError("--verify takes 0 or more candidates and --verify-steps at least 3 (2 warm up)")
    started = time.perf_counter()
    timings: dict[str, float] = {}
    out = opts.out
    # every input is read and planned before the run dir is touched: a typo moves nothing aside
    task = load_task(_task_ref(opts, say))
    model = load_model(opts.model or task.model or "demo-tiny", opts.trust_remote_code)
    with _timed(timings, "profile_s"):
        hardware, basis, profile_path = _hardware(opts, model, say, progress)
    with _timed(timings, "plan_s"):
        plan = _plan(model, hardware, task, opts, say)
    say(f"plan: {plan.chosen.layout.short()}")
    _make_room(out, say, opts.keep_runs)
    candidates = _verification_candidates(plan, max(1, opts.verify), say)
    # the trainer's run-time preparation, once for the trials and the training; the run dir is claimed
    # above under the chain's own rules (its trials write there first)
    prepare_run(plan, out, resumed=False, overwrite=True, claim=False, layouts=[p.layout for p in candidates],
                say=say)
    progress.expect(_estimate_s(plan, candidates if opts.verify else [], opts))
    verification = pricing = None
    if opts.verify > 0:
        with _timed(timings, "verify_s"):
            verification = verify(plan, opts.verify, out, steps=opts.verify_steps, say=say,
                                  watch=lambda trial, metrics: _trial_part(progress, trial, metrics),
                                  trusted=opts.trust_remote_code, candidates=candidates)
            plan = _take_verified(plan, verification, out, show_verification)
            pricing = _pricing(plan, verification, profile_path, out)
        if pricing is not None and not pricing["priced"]:
            if not opts.force:  # nothing more is written: no plan.yaml, no training, no feedback, no report
                return {"run_dir": str(out), "plan": plan.chosen.layout.short(), "hardware_basis": basis,
                        "verification": _verification_json(verification), "pricing": pricing,
                        "refused": _unpriceable_line(pricing), "feedback": None, "summary": None, "report": None,
                        "timings": timings, "seconds": time.perf_counter() - started}
            say(f"--force: training although the plan cannot be priced here: {_miss_text(pricing)}")
        say(f"verify: {verification.reason}; training {plan.chosen.layout.short()}")
    plan_path = out / PLAN_FILE
    plan.write(plan_path)
    with _timed(timings, "train_s"), progress.training(plan, opts.max_steps_per_stage, out / METRICS_FILE):
        summary = _train(plan, opts)
    events: list[VerifyEvent | FeedbackEvent] = list(verification.trials if verification else [])
    round_ = None
    if opts.feedback and profile_path is not None:
        threads = training_threads(plan.chosen.layout.devices, plan.hardware)
        round_ = _feed_back(profile_path, _observations(plan, verification, summary, out, threads), out, say, events)
    elif opts.feedback:
        say(f"feedback: --hardware {opts.hardware} is a preset, not a profile: nothing to update")
    _append_events(out, events)
    _, document = run_report(out)
    report = document.write(out / REPORT_DIR, "run")[0]
    return {"run_dir": str(out), "plan": plan.chosen.layout.short(), "hardware_basis": basis,
            "verification": _verification_json(verification), "pricing": pricing, "refused": None,
            "feedback": round_.model_dump(mode="json") if round_ else None, "summary": summary,
            "report": str(report) if report else None, "timings": timings, "seconds": time.perf_counter() - started}


def _make_room(out: Path, say: Callable[[str], None], keep_runs: int) -> None:
    """A used run dir: the previous run moves aside (`previous-<time>/`; beyond the newest `keep_runs`
    of those, the older move into its trash/), and what training would write over without a run (a
    model/ put there by hand) under a dated name; nothing is deleted."""
    out.mkdir(parents=True, exist_ok=True)
    moved = move_aside(out)
    if moved is not None:
        say(f"moved the previous run in {out} aside to {moved}")
    retired = retire_old_runs(out, keep_runs)
    if retired:
        say(f"moved {len(retired)} older run{'s' if len(retired) > 1 else ''} into {retired[0].parent} "
            f"(--keep-runs {keep_runs} keeps the newest); delete that folder to free its space")
    for aside in move_in_the_way_aside(out, RUN_CHAIN_IN_THE_WAY):
        say(f"moved {aside.name.split('.old-')[0]} in {out}, which holds no run, aside to {aside}")


def _pricing(plan: Plan, verification: Verification, profile_path: Path | None, out: Path) -> dict[str, Any] | None:
    """The chosen plan's measured trial step against its prediction after the refit to this run's
    trials (planner/feedback.py; nothing written: the profile is refitted after training), and whether
    the cost model prices it (`can_price`). On a profile the refit is held by the profile's history; on a
    preset it has the trials alone, so it refuses only misses that no factor within the fit's bounds
    explains. None when the chosen plan's trial measured nothing."""
    trial = next((t for t in verification.trials if t.rank == verification.chosen_rank), None)
    if trial is None or not trial.measured_step_s:
        return None
    new = _observations(plan, verification, None, out, threads=0)
    chosen = next((o for o in new if o.layout.short() == trial.layout), None)
    if chosen is None:
        return None
    predicted = predict_step(chosen, refitted_hardware(profile_path, plan.hardware, new))
    measured = trial.measured_step_s
    return {"layout": trial.layout, "measured_step_s": measured, "predicted_step_s": predicted,
            "predicted_before_refit_s": trial.predicted_step_s, "miss": price_miss(measured, predicted),
            "max_miss": MAX_PRICE_MISS, "priced": can_price(measured, predicted)}


def _miss_text(pricing: dict[str, Any]) -> str:
    return (f"{pricing['layout']} measured {format_seconds(pricing['measured_step_s'])} a step, predicted "
            f"{format_seconds(pricing['predicted_step_s'])} after the refit to the trials "
            f"({format_seconds(pricing['predicted_before_refit_s'])} before it; {pricing['miss']:.3g}x off, "
            f"over the {pricing['max_miss']:g}x limit)")


def _unpriceable_line(pricing: dict[str, Any]) -> str:
    """The one line `advisor run` stops with when the cost model cannot price its plan."""
    return (f"cannot price the plan on this machine: {_miss_text(pricing)}; not training. Profile this machine "
            "fully (`advisor profile`, without --quick) and rerun with --hardware profile.json, or rerun with "
            "--force to train anyway")


def _verification_candidates(plan: Plan, k: int, say: Callable[[str], None]) -> list:
    """The plan's top `k` layouts to verify, less those whose trial would first build a native op for
    longer than it could pay back (trainer/verify.py `trial_candidates`), said in one line."""
    candidates, passed = trial_candidates(plan, k, lambda layout: cold_build_s(layout, plan.engine))
    if passed:
        shown = ", ".join(p.layout.short() for p in passed)
        say(f"verify: passing over {shown}: its trial would first build DeepSpeed's CPU communication op "
            f"(about {COLD_BUILD_S:.0f} s), over {SETUP_SHARE:.0%} of the predicted training "
            f"({predicted_training_s(plan):.0f} s)")
    return candidates


def _estimate_s(plan: Plan, trials: list, opts: RunOptions) -> float:
    """The verification trials' and the training's estimated seconds."""
    device_type = plan.hardware.device_type
    seconds = 0.0
    for planned in trials:
        harness, steps = trial_harness(planned.layout, device_type, opts.verify_steps)
        seconds += STARTUP_S[harness] + steps * planned.estimate.time.step_s
    return seconds + training_estimate_s(plan, opts.max_steps_per_stage)


def _trial_part(progress: RunProgress, trial: Trial, metrics: Path | None) -> contextlib.AbstractContextManager:
    return progress.part(f"verify #{trial.rank}", trial.steps, trial.predicted_step_s, STARTUP_S[trial.harness],
                         metrics)


@contextlib.contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Record the seconds the block took under `key` (not when it fails: the run stops then)."""
    mark = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - mark


def _task_ref(opts: RunOptions, say: Callable[[str], None]) -> str:
    """The task to train: the one named, else the embedded demo. A preset's generated data is written
    on first use into the cache (never downloaded), as `advisor train` does for a plan of it."""
    ref = opts.task or DEMO_TASK
    folder = ensure_generated_data(load_task(ref))
    if folder:
        say(f"generated the {ref} curriculum into {folder}/data")
    return ref


def _plan(model: ModelSpec, hardware: HardwareSpec, task: TaskSpec, opts: RunOptions,
          say: Callable[[str], None]) -> Plan:
    """The planner's ranking over what this trainer runs, on every device of the node as the profile
    measured them (on CPU a device is a share of the cores: the profile's per-device figures hold
    only at that thread count)."""
    gpus = hardware.devices_per_node
    say(f"planning {model.name} on {gpus} x {hardware.name}")
    plan = make_plan(PlanOptions(model=model, hardware=hardware, gpus_per_node=gpus, task=task,
                                 stage_tokens=stage_tokens(task, model), method="auto",
                                 min_compute_fraction=MIN_COMPUTE_FRACTION, top_k=max(5, opts.verify),
                                 space=TRAINER_SPACE))
    return trainable_plan(plan, say)


def _take_verified(plan: Plan, verification: Verification, out: Path,
                   show_verification: Callable[[Any], None] | None) -> Plan:
    """Record and show the trials, and make the fastest measured the plan to train."""
    write_verification(out, verification)
    if show_verification:
        show_verification(verification)
    return apply(plan, verification)


def _train(plan: Plan, opts: RunOptions) -> dict[str, Any] | None:
    """Train the plan in the run dir; the summary (rank 0's, when several processes trained)."""
    out = opts.out
    # the loop draws no bars of its own: the CLI's display follows metrics.jsonl (advisor/cli/progress.py)
    options = TrainOptions(seed=opts.seed, max_steps_per_stage=opts.max_steps_per_stage, show_progress=False,
                           trust_remote_code=opts.trust_remote_code)
    return run_training(plan, out, False, options, None, 0, "127.0.0.1", free_port())


def _feed_back(profile_path: Path, new: list, out: Path, say: Callable[[str], None],
               events: list[VerifyEvent | FeedbackEvent]) -> FeedbackRound | None:
    """Refit the profile to this run's measured steps; write feedback.json and add a `feedback` event."""
    if not new:
        return None
    round_ = feed_back(profile_path, new, str(out), say)
    if round_ is not None:
        _write_json(out / FEEDBACK_FILE, {"profile": str(profile_path), **round_.model_dump(mode="json")})
        events.append(FeedbackEvent(profile=str(profile_path), error_before=round_.error_before,
                                    error_after=round_.error_after, factors_after=round_.factors_after))
    return round_


def _observations(plan, verification, summary: dict[str, Any] | None, out: Path, threads: int) -> list:
    """The measured steps of this run: each finished trial, and the training run itself."""
    new = []
    candidates = [plan.chosen, *plan.alternatives]
    by_layout = {p.layout.short(): p for p in candidates}
    for trial in verification.trials if verification else []:
        planned = by_layout.get(trial.layout)
        if planned is None or not trial.measured_step_s:
            continue
        new.append(observation("verify", plan.model, planned.layout, trial.measured_step_s, trial.predicted_step_s,
                               threads=trial.threads, peak_bytes=trial.peak_bytes,
                               predicted_peak_bytes=trial.predicted_peak_bytes, peak_source=trial.peak_source,
                               steps=trial.steps, run_dir=str(out)))
    # the training run: the steps its plan's layout trained (an out-of-memory fallback's are another
    # layout's, and the whole-run figures pair the plan's estimate with the last launch's steps)
    segment = matching_segment(summary or {}, plan.chosen.layout.short())
    if segment is not None:
        est = plan.chosen.estimate
        new.append(observation("run", plan.model, plan.chosen.layout, segment.measured["step_s"],
                               segment.predicted.get("step_s") or est.time.step_s, threads=threads,
                               peak_bytes=segment.measured.get("peak_bytes"), predicted_peak_bytes=int(est.memory.peak),
                               peak_source=segment.measured.get("peak_source"), steps=segment.steps, run_dir=str(out)))
    return new


def _verification_json(verification) -> dict[str, Any] | None:
    if verification is None:
        return None
    return {"chosen_rank": verification.chosen_rank, "reason": verification.reason,
            "seconds": verification.seconds,
            "trials": [t.record() for t in verification.trials]}
