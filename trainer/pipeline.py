"""`advisor run`: profile -> plan -> train -> report in one go.

With no options it runs the embedded demo: it generates the bundled curriculum (language,
arithmetic reasoning, instructions, then a mixed stage) into the run directory, profiles this
machine (or reuses a profile of it younger than a week), plans `demo-tiny` on it, trains, and
writes the run report. Verification trials of the top plans and the feedback of measurements into
the profile are the `run` issue's next steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from advisor.errors import UsageError
from advisor.specs import HardwareSpec

PROFILE_MAX_AGE_S = 7 * 86400


@dataclass
class RunOptions:
    model: str | None = None
    task: str | None = None
    hardware: str | None = None
    out: Path = Path("runs/demo")
    max_steps_per_stage: int | None = None
    seed: int = 0


def _cached_profile_path() -> Path:
    import os

    from profiler.profile_spec import this_host

    host = this_host()
    root = Path(os.environ.get("ADVISOR_CACHE", Path.home() / ".cache" / "advisor"))
    return root / "profiles" / f"{host.hostname}.json"


def _hardware(opts: RunOptions, model, say) -> tuple[HardwareSpec, str]:
    """The hardware to plan on: the one named, a fresh profile of this machine, or a new one."""
    from presets import load_hardware

    if opts.hardware:
        return load_hardware(opts.hardware), opts.hardware
    path = _cached_profile_path()
    if path.is_file() and time.time() - path.stat().st_mtime < PROFILE_MAX_AGE_S:
        try:
            hardware = load_hardware(str(path))
            say(f"reusing the profile of this machine from {path}")
            return hardware, str(path)
        except UsageError:
            pass  # stale or from another machine: profile again
    from profiler.run_profile import ProfileOptions, run_profile

    say("profiling this machine (--quick)")
    path.parent.mkdir(parents=True, exist_ok=True)
    profile = run_profile(ProfileOptions(out=path, quick=True, model=model))
    if profile is None:
        raise UsageError("profiling did not return a profile")
    return load_hardware(str(path)), str(path)


def run_pipeline(opts: RunOptions, say=print) -> dict[str, Any]:
    from advisor.task import load_task
    from planner.plan import PlanOptions, make_plan
    from presets import load_model
    from trainer.launch import run as run_training
    from trainer.loop import TrainOptions

    started = time.perf_counter()
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    task_ref = opts.task
    if task_ref is None:  # the embedded demo: its data is generated, never downloaded
        from trainer.data.demo_corpus import generate_demo_corpus

        say(f"generating the demo curriculum into {out}/data")
        task_ref = str(generate_demo_corpus(out)["task.yaml"])
    task = load_task(task_ref)
    model = load_model(opts.model or task.model or "demo-tiny")
    hardware, basis = _hardware(opts, model, say)

    # A CPU's "devices" are its cores: a tiny model gains nothing from gloo ranks on two of them,
    # so CPU runs plan one process; GPUs plan every local device.
    gpus = 1 if hardware.device_type == "cpu" else hardware.devices_per_node
    say(f"planning {model.name} on {gpus} x {hardware.name}")
    plan = make_plan(PlanOptions(model=model, hardware=hardware, gpus_per_node=gpus, task=task,
                                 method="auto", min_compute_fraction=0.8))
    plan_path = out / "plan.yaml"
    plan.write(plan_path)
    say(f"plan: {plan.chosen.layout.short()}")

    options = TrainOptions(seed=opts.seed, max_steps_per_stage=opts.max_steps_per_stage)
    summary = run_training(plan, plan_path, out, False, options, False, None, 0, "127.0.0.1", 29513, [])
    from reports.run_report import run_report

    _, document = run_report(out)
    report = document.write(out / "report", "run")[0]
    return {"run_dir": str(out), "plan": plan.chosen.layout.short(), "hardware_basis": basis,
            "summary": summary, "report": str(report) if report else None,
            "seconds": time.perf_counter() - started}
