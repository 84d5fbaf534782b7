"""`advisor run`: profile, plan, verify, train, feed back and report in one command (advisor/cli/run_chain.py).

Exit 2, with one line and nothing trained, when the verification trials show that the cost model
cannot price the chosen plan on this machine (planner/feedback.py MAX_PRICE_MISS); `--force` trains anyway.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from advisor.cli.common import TRUST_REMOTE_CODE, check_run_dir, console, err_console, exit_on_error
from advisor.cli.progress import RunProgress
from advisor.cli.quiet import log_path, quiet_console
from advisor.cli.render import format_seconds, render_verification, stage_results_lines


def run_all(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="default: the task's model, else demo-tiny"),
    task: Optional[str] = typer.Option(None, "--task", help="task preset or YAML (default: the generated demo)"),
    hardware: Optional[str] = typer.Option(None, "--hardware", "-H", help="default: profile this machine "
                                           "(or reuse its profile from the last week)"),
    verify: int = typer.Option(3, "--verify", min=0, help="measure the top K plans for a few steps each and "
                               "train the fastest measured (0: train the planner's choice untested)"),
    verify_steps: Optional[int] = typer.Option(None, "--verify-steps", min=3, help="steps per verification "
                                               "trial, the first 2 warming up (default: 10 on a CPU, whose steps "
                                               "vary by tens of percent; 4 on GPUs)"),
    feedback: bool = typer.Option(True, "--feedback/--no-feedback", help="refit the profile's efficiency "
                                  "factors to this run's measured steps"),
    # the 3x is planner.feedback.MAX_PRICE_MISS (not imported here: it loads the fit's SciPy on every
    # start of the CLI); tests/test_run_unpriceable.py holds the two together
    force: bool = typer.Option(False, "--force", help="train even a plan the cost model cannot price here: by "
                               "default, when the chosen plan's verification trial and its prediction after the "
                               "refit to the trials differ by more than 3x either way, `run` says so in one line "
                               "and stops with exit 2 before training"),
    out: Path = typer.Option(Path("runs/demo"), "--out", help="run directory"),
    keep_runs: int = typer.Option(3, "--keep-runs", min=0, max=1000, help="previous runs kept in the run directory "
                                  "(previous-<time>/); older ones move into its trash/ folder, which is named on "
                                  "the console (nothing is deleted)"),
    max_steps_per_stage: Optional[int] = typer.Option(None, "--max-steps-per-stage", min=1, help="cap (smoke runs)"),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object at the end"),
    verbose: bool = typer.Option(False, "--verbose", help="also show third-party warnings and logs (torch, "
                                 "DeepSpeed, ...) on the console; they always go to RUN_DIR/logs/"),
    trust_remote_code: bool = TRUST_REMOTE_CODE,
) -> None:
    """Profile, plan, verify, train, feed back and report in one command. With no options: the
    embedded demo (demo-tiny on a generated curriculum: language, arithmetic, instructions, then
    a mixed stage)."""
    exit_on_error(lambda: check_run_dir(out))  # before quiet_console makes out/logs/ in it
    # before the deferred import below, so that its warnings go to the log as well
    with quiet_console(out, verbose) as terminal:
        from advisor.cli.run_chain import RunOptions  # deferred: imports torch/deepspeed (2.6 s)

        options = RunOptions(model=model, task=task, hardware=hardware, out=out,
                             max_steps_per_stage=max_steps_per_stage, seed=seed, verify=verify,
                             verify_steps=verify_steps, feedback=feedback, force=force, keep_runs=keep_runs,
                             trust_remote_code=trust_remote_code)
        result = exit_on_error(lambda: _run(options, as_json))
        if as_json:  # stdout carries the JSON alone: everything else went to the log or to stderr
            print(json.dumps(result, default=str), file=terminal)
            if result["refused"]:
                raise typer.Exit(2)
            return
    if result["refused"]:  # the cost model cannot price the plan here: one line, nothing trained
        err_console.print(f"[red]error:[/red] {escape(result['refused'])}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    summary = result["summary"] or {}
    for line in stage_results_lines(summary):
        console.print(f"[bold]advisor run[/bold]: {line}", highlight=False, soft_wrap=True)
    measured, predicted = summary.get("measured", {}), summary.get("predicted", {})
    console.print(f"done in {result['seconds']:.0f} s: {summary.get('steps')} steps, measured step "
                  f"{format_seconds(measured.get('step_s') or 0)} "
                  f"(predicted {format_seconds(predicted.get('step_s') or 0)}), "
                  f"run dir {result['run_dir']}" + (f", report {result['report']}" if result["report"] else "")
                  + f"; third-party output in {log_path(out)}")


def _run(options, as_json: bool) -> dict:
    """The chain, with our lines and one progress display on the console (none with --json)."""
    from advisor.cli.run_chain import run_chain  # deferred: imports torch/deepspeed (imported by now)

    def say(text: str) -> None:
        if not as_json:
            console.print(f"[bold]advisor run[/bold]: {text}", highlight=False, soft_wrap=True)  # the terminal wraps

    def show(verification) -> None:
        if not as_json:
            render_verification(verification)

    from trainer.run_lock import RunDirLock  # deferred, as above

    lock = RunDirLock.take(options.out)  # one launch per run dir, as `advisor train` holds it
    try:
        with RunProgress(console, enabled=not as_json, title="advisor run") as progress:
            return run_chain(options, say, show, progress)
    finally:
        lock.release()
