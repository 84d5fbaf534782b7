"""`advisor run`: profile -> plan -> verify -> train -> feed back -> report, in one go.

With no options it runs the embedded demo: it generates the bundled curriculum (language,
arithmetic reasoning, instructions, then a mixed stage) into the run directory, profiles this
machine (or reuses a profile of it younger than a week), plans `demo-tiny` on it, measures the
top plans for a few steps (trainer/verify.py) and trains the fastest measured, then feeds the
measured steps back into the profile (profiler/feedback.py) and writes the run report.

Files it adds to the run dir: `verify.json` (predicted against measured per candidate) and
`feedback.json` (the refit: factors and step-time error before and after); `events.jsonl` gets
one `verify` event per candidate and one `feedback` event after training.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from advisor.errors import UsageError
from advisor.plan import Plan
from advisor.specs import HardwareSpec, ModelSpec
from planner.search import SearchSpace

PROFILE_MAX_AGE_S = 7 * 86400
DEFAULT_VERIFY = 3  # candidates measured before training (0: train the planner's choice untested)
DEFAULT_VERIFY_STEPS = 4  # per candidate; the first 2 warm up and are left out
# What `run` lets the planner choose: everything the trainer's engines run (no sequence
# parallelism, no interleaved pipeline); `trainable_plan` then drops the combinations an engine
# refuses for this model (LoRA or offload with tp/pp, tp not dividing the heads, ...).
TRAINER_SPACE = SearchSpace(max_vpp=1, sequence_parallel=(False,))


def trainable_plan(plan: Plan, say=print) -> Plan:
    """The plan without the layouts this trainer cannot run on its model; the first runnable one
    becomes the choice (stages re-sized for it)."""
    from trainer.parallelize import unsupported_reason
    from trainer.verify import candidate_plan

    candidates = [plan.chosen, *plan.alternatives]
    reasons = [unsupported_reason(p.layout, plan.model.hf_config) for p in candidates]
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
    verify_steps: int = DEFAULT_VERIFY_STEPS
    feedback: bool = True


def _cached_profile_path() -> Path:
    from profiler.profile_spec import this_host

    host = this_host()
    root = Path(os.environ.get("ADVISOR_CACHE", Path.home() / ".cache" / "advisor"))
    return root / "profiles" / f"{host.hostname}.json"


def _fresh_profile(path: Path) -> bool:
    """A profile of this machine younger than a week (by its `created` stamp: feedback rewrites
    the file, so its modification time says nothing about the measurements' age)."""
    from profiler.profile_spec import fingerprint_mismatch, load_profile

    if not path.is_file():
        return False
    try:
        profile = load_profile(path)
    except UsageError:
        return False  # corrupt, or another version: profile again
    age = (dt.datetime.now(dt.timezone.utc) - profile.created.astimezone(dt.timezone.utc)).total_seconds()
    return age < PROFILE_MAX_AGE_S and fingerprint_mismatch(profile) is None


def _hardware(opts: RunOptions, model: ModelSpec, say: Callable[[str], None]) -> tuple[HardwareSpec, str, Path | None]:
    """The hardware to plan on, what it came from, and the profile file that feedback updates
    (None for a preset): the one named, a fresh profile of this machine, or a new one."""
    from presets import load_hardware
    from profiler.profile_spec import looks_like_profile

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
    from profiler.run_profile import ProfileOptions, run_profile

    say("profiling this machine (--quick)")
    path.parent.mkdir(parents=True, exist_ok=True)
    profile = run_profile(ProfileOptions(out=path, quick=True, model=model))
    if profile is None:
        raise UsageError("profiling did not return a profile")
    return load_hardware(str(path)), str(path), path


def _append_events(run_dir: Path, records: list[dict[str, Any]]) -> None:
    with open(run_dir / "events.jsonl", "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_pipeline(opts: RunOptions, say: Callable[[str], None] = print,
                 show_verification: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """Profile, plan, verify the top plans, train the fastest measured, feed back, report."""
    from advisor.task import load_task
    from planner.plan import PlanOptions, make_plan
    from presets import load_model
    from trainer.launch import run as run_training
    from trainer.loop import TrainOptions
    from trainer.verify import apply, training_threads, verify, write_verification

    if opts.verify < 0 or opts.verify_steps < 3:
        raise UsageError("--verify takes 0 or more candidates and --verify-steps at least 3 (2 warm up)")
    started = time.perf_counter()
    timings: dict[str, float] = {}
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    task_ref = opts.task
    if task_ref is None:  # the embedded demo: its data is generated, never downloaded
        from trainer.data.demo_corpus import generate_demo_corpus

        say(f"generating the demo curriculum into {out}/data")
        task_ref = str(generate_demo_corpus(out)["task.yaml"])
    task = load_task(task_ref)
    model = load_model(opts.model or task.model or "demo-tiny")
    mark = time.perf_counter()
    hardware, basis, profile_path = _hardware(opts, model, say)
    timings["profile_s"] = time.perf_counter() - mark

    # Every device of the node, as the profile measured them (on CPU a device is a share of the
    # cores: the profile's per-device figures hold only at that thread count).
    gpus = hardware.devices_per_node
    say(f"planning {model.name} on {gpus} x {hardware.name}")
    mark = time.perf_counter()
    plan = make_plan(PlanOptions(model=model, hardware=hardware, gpus_per_node=gpus, task=task, method="auto",
                                 min_compute_fraction=0.8, top_k=max(5, opts.verify),
                                 space=TRAINER_SPACE))
    plan = trainable_plan(plan, say)
    timings["plan_s"] = time.perf_counter() - mark
    say(f"plan: {plan.chosen.layout.short()}")

    verification = None
    if opts.verify > 0:
        mark = time.perf_counter()
        verification = verify(plan, opts.verify, out, steps=opts.verify_steps, say=say)
        timings["verify_s"] = time.perf_counter() - mark
        write_verification(out, verification)
        if show_verification:
            show_verification(verification)
        plan = apply(plan, verification)
        say(f"verify: {verification.reason}; training {plan.chosen.layout.short()}")
    plan_path = out / "plan.yaml"
    plan.write(plan_path)

    mark = time.perf_counter()
    options = TrainOptions(seed=opts.seed, max_steps_per_stage=opts.max_steps_per_stage)
    extra = ["--seed", str(opts.seed)] + (["--max-steps-per-stage", str(opts.max_steps_per_stage)]
                                          if opts.max_steps_per_stage else [])
    from profiler.ranks import free_port

    summary = run_training(plan, plan_path, out, False, options, False, None, 0, "127.0.0.1", free_port(), extra)
    if summary is None and (out / "summary.json").is_file():  # several processes: rank 0 wrote it
        summary = json.loads((out / "summary.json").read_text())
    timings["train_s"] = time.perf_counter() - mark

    events = [{"event": "verify", **asdict(t)} for t in (verification.trials if verification else [])]
    round_ = None
    if opts.feedback and profile_path is not None:
        new = _observations(plan, verification, summary, out, training_threads(plan.chosen.layout.devices,
                                                                                hardware.device_type))
        if new:
            from profiler.feedback import feed_back

            round_ = feed_back(profile_path, new, str(out), say)
            if round_ is not None:
                _write_json(out / "feedback.json", {"profile": str(profile_path), **round_.model_dump(mode="json")})
                events.append({"event": "feedback", "profile": str(profile_path),
                               "error_before": round_.error_before, "error_after": round_.error_after,
                               "factors_after": round_.factors_after})
    elif opts.feedback:
        say(f"feedback: --hardware {opts.hardware} is a preset, not a profile: nothing to update")
    _append_events(out, events)

    from reports.run_report import run_report

    _, document = run_report(out)
    report = document.write(out / "report", "run")[0]
    return {"run_dir": str(out), "plan": plan.chosen.layout.short(), "hardware_basis": basis,
            "verification": _verification_json(verification), "feedback": round_.model_dump(mode="json")
            if round_ else None, "summary": summary, "report": str(report) if report else None,
            "timings": timings, "seconds": time.perf_counter() - started}


def _observations(plan, verification, summary: dict[str, Any] | None, out: Path, threads: int) -> list:
    """The measured steps of this run: each finished trial, and the training run itself."""
    from profiler.feedback import observation

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
    measured = (summary or {}).get("measured") or {}
    if measured.get("step_s"):
        est = plan.chosen.estimate
        new.append(observation("run", plan.model, plan.chosen.layout, measured["step_s"], est.time.step_s,
                               threads=threads, peak_bytes=measured.get("peak_bytes"),
                               predicted_peak_bytes=int(est.memory.peak), peak_source=measured.get("peak_source"),
                               steps=int((summary or {}).get("steps") or 0), run_dir=str(out)))
    return new


def _verification_json(verification) -> dict[str, Any] | None:
    if verification is None:
        return None
    return {"chosen_rank": verification.chosen_rank, "reason": verification.reason,
            "seconds": verification.seconds,
            "trials": [{**asdict(t), "step_error": t.step_error} for t in verification.trials]}
