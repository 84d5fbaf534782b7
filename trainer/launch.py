"""Start the processes a plan needs and run the training loop in each.

One device: in this process. Several: `torchrun` (the field's launcher) starts `python -m
trainer.worker RUN/launch.json` (trainer/worker.py) in every rank, on one node or, with
--nnodes/--node-rank/--master-addr or Slurm's environment, on many; the launch file
(trainer/launch_file.py) carries the plan and the options. Workers use nccl on CUDA and gloo on CPU.
When a rank runs out of memory and names the plan's next layout (trainer/oom.py), the launcher starts
the ranks again with resume set, and they continue from the last checkpoint with that layout.
Callers prepare the run dir first (trainer/prepare.py).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from specs import environment
from specs.errors import UsageError
from specs.plan_file import Plan, segment_of
from specs.core import HardwareSpec
from specs.run_dir import (CHECKPOINT_STATE_FILE, CHECKPOINTS_DIR, EVENTS_FILE, LOGS_DIR, SUMMARY_FILE, JsonLines,
                           parse_event)
from profiler.inventory import cpu_cores
from profiler.ranks import free_port, init_device_and_group
from profiler.slurm import slurm_topology
from trainer import checkpoint
from trainer.launch_file import LaunchFile, launch_file_path, write_launch_file
from trainer.loop import train
from trainer.oom import pending_relaunch
from trainer.options import WORKER_LOG_ENV, TrainOptions

DEFAULT_PORT = 29513
_RENDEZVOUS_TIMEOUT = re.compile(r"Timed out after (?P<seconds>\d+) seconds waiting for clients\. "
                                 r"(?P<joined>\d+)/(?P<nodes>\d+) clients joined")


def launch_command(launch_file: Path, timeout_s: float, nproc: int, nnodes: int, node_rank: int, master_addr: str,
                   master_port: int) -> list[str]:
    """torchrun starting the worker module on `launch_file` in every rank; its agent dies with this
    process (trainer/agent.py)."""
    return [sys.executable, "-m", "trainer.agent", str(os.getpid()), f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            f"--node-rank={node_rank}", f"--master-addr={master_addr}", f"--master-port={master_port}",
            # the nodes' rendezvous waits --timeout-s for a missing node, as the process group does
            # for a dead rank (torchrun's static rendezvous otherwise waits 600 s)
            f"--rdzv-conf=timeout={math.ceil(timeout_s)}",
            "-m", "trainer.worker", str(launch_file)]


def run(plan: Plan, out: Path, resume: bool, options: TrainOptions, nnodes: int | None = None, node_rank: int = 0,
        master_addr: str = "127.0.0.1", master_port: int = DEFAULT_PORT) -> dict | None:
    """Train the plan: one launch of ranks per segment of stages that share a layout
    (`specs.plan_file.stage_segments`); each after the first resumes from the full weights the
    previous one handed on."""
    while True:
        segment = segment_of(plan, _next_stage(out) if resume else 0)
        summary = _run_segment(plan, out, resume, options, segment.layout.devices, nnodes, node_rank,
                               master_addr, master_port)
        reached = _next_stage(out)
        if summary is not None and "segment_end" not in summary or not segment.end <= reached < len(plan.stages):
            return summary  # the run is done (or this node does not see the run dir: its rank 0's does)
        resume = True  # the next segment starts from the handoff checkpoint


def _next_stage(out: Path) -> int:
    """The stage the newest checkpoint of `out` resumes into (0 without one)."""
    newest = checkpoint.latest(out / CHECKPOINTS_DIR)
    return int(json.loads((newest / CHECKPOINT_STATE_FILE).read_text())["stage"]) if newest is not None else 0


def _run_segment(plan: Plan, out: Path, resume: bool, options: TrainOptions, devices: int,
                 nnodes: int | None, node_rank: int, master_addr: str, master_port: int) -> dict | None:
    """The ranks of one segment: in this process for one device, else through torchrun (again, with
    --resume, after an out-of-memory fallback)."""
    if devices == 1:
        zero = segment_of(plan, _next_stage(out) if resume else 0).layout.zero
        if zero:  # DeepSpeed needs a process group, even of one
            _single_process_group_env()
        with _cpu_threads(plan, ranks_on_node=1):
            return train_rank(plan, out, resume, options, distributed=bool(zero))
    topology = slurm_topology()
    if topology and nnodes is None:
        nnodes, node_rank, master_addr = topology
    nnodes = nnodes or 1
    if devices % nnodes:
        raise UsageError(f"{devices} processes do not divide over {nnodes} nodes")
    nproc = devices // nnodes
    env = dict(os.environ)
    if not _cuda():  # ranks share the CPU cores; oversubscribed OpenMP threads run 8x slower
        env["OMP_NUM_THREADS"] = str(cpu_threads(plan.hardware, nproc))
    while True:
        started, log_offset = time.time(), _log_size()
        result = _launch_ranks(LaunchFile(plan=plan, out=out, resume=resume, options=options), env, nproc, nnodes,
                               node_rank, master_addr, master_port)
        if result.returncode == 0:  # rank 0 wrote the summary (None on a node that does not share its run dir)
            summary = out / SUMMARY_FILE
            if 0 < _next_stage(out) < len(plan.stages):  # a segment ended: the caller launches the next
                return {"finished": False, "segment_end": _next_stage(out)}
            return json.loads(summary.read_text()) if summary.is_file() else None
        fallback = pending_relaunch(out, started)
        if fallback is None:
            raise UsageError(f"training processes failed (exit {result.returncode}){_worker_error(log_offset)}; "
                             f"see {out / EVENTS_FILE}, and the workers' output in the run's {LOGS_DIR}/")
        # a rank ran out of memory and named the plan's next layout: restart every rank with it
        JsonLines(out / EVENTS_FILE, node_rank == 0).write(parse_event(fallback["event"]))
        resume = True


def _launch_ranks(launch: LaunchFile, env: dict[str, str], nproc: int, nnodes: int, node_rank: int,
                  master_addr: str, master_port: int) -> subprocess.CompletedProcess:
    """torchrun's ranks of this node on `launch`, written to this node's launch file for the time they run."""
    path = write_launch_file(launch_file_path(launch.out, node_rank), launch)
    try:
        command = launch_command(path, launch.options.timeout_s, nproc, nnodes, node_rank, master_addr, master_port)
        return subprocess.run(command, env=env, check=False)
    finally:
        path.unlink(missing_ok=True)  # the run dir keeps no launch: the next one writes its own


def _log_size() -> int:
    path = environment.read(WORKER_LOG_ENV)
    return os.path.getsize(path) if path and os.path.isfile(path) else 0


def _worker_error(offset: int) -> str:
    """The first error line a worker wrote to the routed log since `offset` (the CLI's quiet console
    sends workers' output there), as ": <line>", so that the failing rank's reason reaches the
    console: the first, because the other ranks then fail on the broken collective; "" when there is
    none or no log."""
    path = environment.read(WORKER_LOG_ENV)
    if not path or not os.path.isfile(path):
        return ""
    with open(path, "rb") as log:
        log.seek(offset)
        lines = log.read().decode("utf-8", errors="replace").splitlines()
    errors = [line.strip() for line in lines if line.startswith(("error:", "internal error:"))]
    if errors:
        return f": {errors[0]}"
    missing = next((m for m in map(_RENDEZVOUS_TIMEOUT.search, lines) if m), None)
    if missing:  # torchrun's own agent failed before any worker started: nodes that never joined
        return (f": the nodes' rendezvous timed out after {missing['seconds']} s with {missing['joined']} of "
                f"{missing['nodes']} nodes joined (start advisor train on every node with the same --master-addr "
                f"and --master-port, or raise --timeout-s)")
    return ""


def _single_process_group_env() -> None:
    port = free_port()
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(port))):
        os.environ.setdefault(key, value)


def cpu_threads(hardware: HardwareSpec, ranks_on_node: int) -> int:
    """CPU threads each of the node's ranks trains with: the profile's threads per device, what the
    plan was priced on (a 1-rank run on a 2-core machine whose profile made one core a device runs
    one thread); on a preset, which defines no device, this process's threads for one rank, else
    the user's OMP_NUM_THREADS or the cores shared out."""
    if hardware.threads_per_device:
        return hardware.threads_per_device
    if ranks_on_node == 1:
        return torch.get_num_threads()
    return user_omp_threads() or hardware.threads_per_rank(ranks_on_node, cpu_cores())


def user_omp_threads() -> int | None:
    """The user's OMP_NUM_THREADS when it is one whole number > 0; otherwise (OpenMP's nested lists such
    as `4,2`, a typo) it is ignored with a one-line warning: the ranks get the cores shared out."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return None
    if value.isdigit() and int(value) > 0:
        return int(value)
    print(f"warning: OMP_NUM_THREADS={value!r} is not a whole number > 0: ignored, the ranks share the cores out",
          file=sys.stderr)
    return None


@contextlib.contextmanager
def _cpu_threads(plan: Plan, ranks_on_node: int) -> Iterator[None]:
    """This process trains with `cpu_threads`, and gives the caller its own back."""
    if _cuda():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(cpu_threads(plan.hardware, ranks_on_node))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cuda() -> bool:
    return torch.cuda.is_available()


def train_rank(plan: Plan, out: Path, resume: bool, options: TrainOptions, distributed: bool) -> dict:
    """This process's rank of the plan: in the launching process (one device), or in a worker."""
    # this rank's GPU (LOCAL_RANK) and group; a dead or stuck peer fails the collectives within the
    # timeout instead of torch's 10-30 minutes
    init_device_and_group(distributed=distributed, timeout_s=options.timeout_s)
    if distributed:
        options.show_progress = options.show_progress and dist.get_rank() == 0
    summary = train(plan, out, resume, options)  # on failure torchrun's agent stops the other ranks
    if distributed:
        # gloo's worker threads can crash the interpreter at exit when collectives are still
        # referenced (docs/notes-cpu-stack.md): drop owners, collect, barrier, destroy
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return summary
