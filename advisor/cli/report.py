"""`advisor report`: capacity (before training: hardware x GPU count x method) and run (after it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specs.capabilities import cost_engine, prices_ours
from advisor.cli.common import (PRICED_ENGINE_HELP, TRUST_REMOTE_CODE, check_out_folder, console, err_console,
                                exit_on_error, stage_tokens)
from advisor.cli.render import render_capacity
from specs.core import check_number
from specs.run_dir import REPORT_DIR
from presets import load_task
from planner.plan import parse_duration
from presets import load_hardware, load_model

report_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode="rich",
    help="Reports as one self-contained HTML page, a Markdown twin and PNG charts: capacity (before) and run (after).")


@report_app.command("capacity")
def report_capacity(
    model: str = typer.Option(..., "--model", "-m", help="model preset, HF config.json, or model folder"),
    tokens: Optional[float] = typer.Option(None, "--tokens", help="tokens to train, e.g. 2e10 (or --task)"),
    task: Optional[str] = typer.Option(None, "--task", help="task preset or task YAML: its stages' tokens"),
    hardware: str = typer.Option("h100-80g,a100-80g,rtx4090-24g", "--hardware", "-H",
                                 help="comma-separated hardware presets or profile.json files"),
    gpus: str = typer.Option("8,64,512", "--gpus", help="comma-separated GPU counts (whole nodes above one node)"),
    method: str = typer.Option("full,lora", "--method", help="comma-separated full, lora, qlora; the first is preferred"),
    price: Optional[str] = typer.Option(
        None, "--price-per-gpu-hour", help="dollars: 2.5 for all, or h100-80g=2.5,a100-80g=1.6,rtx4090-24g=0.4"),
    deadline: Optional[str] = typer.Option(None, "--deadline", help="wall-clock limit, e.g. 14d or 36h"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="tokens per sequence (default: task's or 2048)"),
    global_batch: Optional[int] = typer.Option(
        None, "--global-batch", min=1, help="sequences per step, the same for every option (default ~2M tokens)"),
    mtbf_hours: Optional[float] = typer.Option(None, "--mtbf-hours", help="mean time between failures of one node "
                                               "(default: the planner's 2000)"),
    restart_minutes: float = typer.Option(10.0, "--restart-minutes", help="time to restart after a failure (assumed)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="planner processes (default: CPU cores)"),
    engine: str = typer.Option("ours", "--engine", help=PRICED_ENGINE_HELP + "; ours also plans the recommended "
                               "job for Megatron-LM and says by how much and why ours is slower, beyond 10%"),
    out: Path = typer.Option(Path("capacity-report"), "--out", help="folder for capacity.html, capacity.md, charts/"),
    as_json: bool = typer.Option(False, "--json", help="print the table of options as one JSON object"),
    trust_remote_code: bool = TRUST_REMOTE_CODE,
) -> None:
    """For every hardware x GPU count x method: the planner's best plan, its wall-clock time, GPU-hours,
    cost, MFU, memory headroom, checkpoint and failure overhead; the scaling knee; full against
    LoRA; and a recommendation with its main risk."""
    # deferred: imports matplotlib (0.5 s at every start)
    from reports.capacity import CapacityRequest, capacity_report, parse_counts, parse_prices
    from reports.pages import capacity_document

    def build():
        check_number(tokens, "--tokens", gt=0)
        check_number(mtbf_hours, "--mtbf-hours", gt=0)
        check_number(restart_minutes, "--restart-minutes", ge=0)
        check_out_folder(out)
        hws = [load_hardware(h.strip()) for h in hardware.split(",") if h.strip()]
        prices = parse_prices(price, hws)
        for name, value in prices.items():
            check_number(value, f"--price-per-gpu-hour {name}=", ge=0)
        command = ["advisor report capacity", f"--model {model}"] + (
            [f"--tokens {tokens:g}"] if tokens is not None else []) + ([f"--task {task}"] if task else []) + [
            f"--hardware {hardware}", f"--gpus {gpus}", f"--method {method}"] + [
            f"{flag} {value}" for flag, value in (("--price-per-gpu-hour", price), ("--deadline", deadline),
                                                  ("--seq-len", seq_len), ("--global-batch", global_batch),
                                                  ("--mtbf-hours", mtbf_hours)) if value is not None] + (
            [f"--engine {engine}"] if not prices_ours(engine) else []) + (
            ["--trust-remote-code"] if trust_remote_code else [])
        cost_engine(engine)  # one line and exit 2 for an unknown engine
        extra = {"mtbf_hours": mtbf_hours} if mtbf_hours is not None else {}
        spec_task = load_task(task) if task else None
        req = CapacityRequest(
            model=load_model(model, trust_remote_code), hardware=hws, gpu_counts=parse_counts(gpus),
            methods=[m.strip() for m in method.split(",") if m.strip()], tokens=tokens, task=spec_task,
            stage_tokens=stage_tokens(spec_task), seq=seq_len, global_batch=global_batch,
            prices=prices, deadline_s=parse_duration(deadline) if deadline else None,
            restart_s=restart_minutes * 60, command=" ".join(command), priced_engine=engine, **extra)
        total = len(hws) * len(req.gpu_counts) * len(req.methods)
        # no refresh thread: planner workers are forked, and a fork should not copy a running thread
        with Progress(TextColumn("planning"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                      TimeElapsedColumn(), console=err_console, transient=True, auto_refresh=False) as bar:
            job = bar.add_task("", total=total)

            def advance(option) -> None:
                bar.update(job, advance=1, description=f"{option.label} ({option.plan_seconds:.1f} s)")
                bar.refresh()

            report = capacity_report(req, advance, jobs)
        written = capacity_document(report).write(out, "capacity")
        return report, written

    report, written = exit_on_error(build)
    if as_json:
        print(json.dumps({**report.to_json(), "files": [str(p) for p in written]}))
        return
    render_capacity(report, written)


@report_app.command("run")
def report_run(
    run_dir: Path = typer.Argument(..., help="a run dir from `advisor train` or `advisor run`"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for run.html, run.md, charts/ (default RUN_DIR/report)"),
    as_json: bool = typer.Option(False, "--json", help="print predicted against measured and per-stage results"),
) -> None:
    """Predicted against measured (peak memory, step time, tokens/s), loss and learning rate per
    stage, spikes and rollbacks, checkpoints, per-skill evaluation, and the plan that ran."""
    from reports.run_report import run_report  # deferred: imports matplotlib (0.5 s at every start)

    def build():
        check_out_folder(out or run_dir / REPORT_DIR)
        analysis, document = run_report(run_dir)
        return analysis, document.write(out or run_dir / REPORT_DIR, "run")

    analysis, written = exit_on_error(build)
    if as_json:
        print(json.dumps({
            "comparisons": [{"name": c.key, "predicted": c.predicted, "measured": c.measured, "ratio": c.ratio}
                            for c in analysis.comparisons],
            "stages": [vars(s) for s in analysis.stages], "spikes": len(analysis.spikes),
            "rollbacks": len(analysis.rollbacks), "finished": analysis.finished,
            "files": [str(p) for p in written]}))
        return
    for c in analysis.comparisons:
        if c.ratio is not None:
            console.print(f"{c.name}: measured / predicted = {c.ratio:.2f}")
    for path in written[:2]:
        console.print(f"wrote {path}")
