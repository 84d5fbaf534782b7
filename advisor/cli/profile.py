"""`advisor profile`: measure this machine and write profile.json for --hardware."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from advisor.cli.common import TRUST_REMOTE_CODE, err_console, exit_on_error
from advisor.cli.progress import ProfileBar
from advisor.cli.render import render_profile
from presets import load_model
from profiler.cluster import DEFAULT_PORT, DEFAULT_TIMEOUT_S, cluster_options
from profiler.inventory import resolve_device
from profiler.stragglers import DEFAULT_THRESHOLD


def profile(
    out: Path = typer.Option(Path("profile.json"), "--out", "-o", help="where to write the profile"),
    quick: bool = typer.Option(False, "--quick", help="short budgets: about a minute on a 2-core CPU"),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="model preset, HF config.json or model folder: GEMM shapes and calibration"),
    nproc: Optional[int] = typer.Option(
        None, "--nproc", min=1, help="ranks (devices) to profile together; default: GPUs, or CPU cores"),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu"),
    calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate", help="fit efficiencies to real steps"),
    nnodes: Optional[int] = typer.Option(
        None, "--nnodes", min=1, help="nodes profiling together (default: Slurm's, else 1); run the same command "
        "on each with its --node-rank; node 0 writes the profile"),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", min=0, help="this node, 0 to nnodes-1"),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="address of node 0 (its launchers meet there)"),
    master_port: int = typer.Option(DEFAULT_PORT, "--master-port", help="port on node 0; the ranks also use the next one"),
    timeout_s: float = typer.Option(
        DEFAULT_TIMEOUT_S, "--timeout-s", help="seconds to wait for the master, the other nodes, or any collective"),
    straggler_threshold: float = typer.Option(
        DEFAULT_THRESHOLD, "--straggler-threshold", help="a device or link this far below the median (0.2 = 20%) is "
        "listed as a straggler"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object: the profile"),
    trust_remote_code: bool = TRUST_REMOTE_CODE,
) -> None:
    """Measure this machine (devices, GEMM per dtype, memory, host<->device, CPU Adam, collectives),
    calibrate the cost model on a few real steps of --model, and write profile.json for --hardware.

    With --nnodes N (or under Slurm), every node runs this command and the profile, written on node 0,
    covers the cluster: each node's inventory, collectives inside and across nodes, every node pair's
    send/recv, the all-to-all bisection, and the stragglers (devices or links slower than the median).
    """
    this_node = {"rank": 0}

    def measure():
        cluster = cluster_options(nnodes, node_rank, master_addr, master_port, timeout_s)  # bad flags: at once
        this_node["rank"] = cluster.node_rank if cluster else 0
        # deferred: imports torch, transformers and deepspeed (about 2 s)
        from advisor.cli.compose import ProfileOptions, profile_this_machine

        resolve_device(device)  # refuse MPS and friends before drawing a progress bar
        opts = ProfileOptions(out=out, quick=quick, model=load_model(model, trust_remote_code) if model else None,
                              nproc=nproc, device=device, calibrate=calibrate, cluster=cluster,
                              straggler_threshold=straggler_threshold, trust_remote_code=trust_remote_code)
        columns = (TextColumn("{task.fields[detail]:<36}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn())
        # transient for a cluster: a failed meeting leaves its one line, not an empty bar
        with Progress(*columns, console=err_console, transient=as_json or cluster is not None) as bar:
            return profile_this_machine(opts, ProfileBar(bar))

    result = exit_on_error(measure)
    if result is None:  # a torchrun job or node 0 wrote it
        if this_node["rank"]:
            err_console.print(f"node {this_node['rank']} measured; node 0 writes the profile")
        return
    if as_json:
        print(result.model_dump_json())
        return
    render_profile(result, out)
