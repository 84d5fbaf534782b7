"""`advisor profile`: measure this machine and write profile.json for --hardware."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from advisor.cli.common import err_console, exit_on_error
from advisor.cli.progress import ProfileBar
from advisor.cli.render import render_profile
from presets import load_model
from profiler.inventory import resolve_device


def profile(
    out: Path = typer.Option(Path("profile.json"), "--out", "-o", help="where to write the profile"),
    quick: bool = typer.Option(False, "--quick", help="short budgets: about a minute on a 2-core CPU"),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="model preset, HF config.json or model folder: GEMM shapes and calibration"),
    nproc: Optional[int] = typer.Option(
        None, "--nproc", min=1, help="ranks (devices) to profile together; default: GPUs, or CPU cores"),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu"),
    calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate", help="fit efficiencies to real steps"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object: the profile"),
) -> None:
    """Measure this machine (devices, GEMM per dtype, memory, host<->device, CPU Adam, collectives),
    calibrate the cost model on a few real steps of --model, and write profile.json for --hardware.
    """
    # deferred: imports torch, transformers and deepspeed (about 2 s)
    from advisor.cli.compose import ProfileOptions, profile_this_machine

    def measure():
        resolve_device(device)  # refuse MPS and friends before drawing a progress bar
        opts = ProfileOptions(out=out, quick=quick, model=load_model(model) if model else None, nproc=nproc,
                              device=device, calibrate=calibrate)
        columns = (TextColumn("{task.fields[detail]:<36}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn())
        with Progress(*columns, console=err_console, transient=as_json) as bar:
            return profile_this_machine(opts, ProfileBar(bar))

    result = exit_on_error(measure)
    if result is None:  # a torchrun job wrote it
        return
    if as_json:
        print(result.model_dump_json())
        return
    render_profile(result, out)
