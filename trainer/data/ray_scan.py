"""The scan of `advisor data prepare` on a Ray cluster (`--executor ray`).

The same tasks as on this machine's cores (trainer/data/pipeline.py's `scan_steps`, one part each),
run by datatrove's `RayPipelineExecutor` with the same logging folder, so the same completion
markers decide what a rerun skips and a prepare resumes whichever executor ran it before. Only the
scan runs on Ray: the merge, duplicate resolution and shard writing stay in the prepare's process,
which is why every executor writes the same shards.

Ray's workers must import this project and see the work folder at the same path: true of a local
instance (`ray.init()` here) and of a cluster whose nodes share the file system and the install.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

from datatrove.executor.ray import RayPipelineExecutor  # imports ray only when it runs
from loguru import logger

from specs.errors import UsageError
from trainer.data.pipeline import ScanJob, _report_progress, scan_steps

Log = Callable[[str], None]
_FAILURES = "failures"  # beside datatrove's completions: the one-line error of each part that failed
_TASK_LOGS = "logs"  # datatrove's own per-task logs in its logging folder (not a run dir's logs/)


def run_scan_on_ray(job: ScanJob, workers: int | None, address: str | None, log: Log) -> int:
    """Scan every part not finished before on Ray (`address`: None starts a local instance of
    `workers` CPUs, "auto" joins the running cluster); returns how many parts were reused. A Ray
    already initialised in this process (a notebook's, a test's) is used as it is."""
    executor = _ray_executor(job, workers)
    reused = len(job.parts) - len(executor.get_incomplete_ranks())
    if reused:
        log(f"resuming: {reused} of {len(job.parts)} parts were scanned before")
    with _ray_session(address, workers), _progress(job, log):
        executor.run()
        logger.remove()  # the sinks datatrove added while it ran
    _check_every_part_finished(job, executor)
    return reused


class RayScanExecutor(RayPipelineExecutor):
    """datatrove's Ray executor, keeping a failed part's one-line error where the prepare reads it:
    the executor itself only logs that a task failed."""

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1) -> Any:
        try:
            return super()._run_for_rank(rank, local_rank, node_rank)
        except UsageError as exc:
            with self.logging_dir.open(f"{_FAILURES}/{rank:05d}", "w") as sink:
                sink.write(str(exc))
            raise


def _ray_executor(job: ScanJob, workers: int | None) -> RayScanExecutor:
    logger.remove()  # datatrove warns on stderr that a local logging folder must be shared by the nodes
    return RayScanExecutor(scan_steps(job), tasks=len(job.parts), workers=workers or -1,
                           logging_dir=str(job.work / "datatrove"), cpus_per_task=1, mem_per_cpu_gb=2)


@contextlib.contextmanager
def _ray_session(address: str | None, workers: int | None) -> Iterator[None]:
    """Ray connected for the scan: started (or joined) here and shut down after, unless this process
    had already initialised it."""
    import ray

    if ray.is_initialized():
        yield
        return
    try:
        ray.init(address=address, num_cpus=(workers or os.cpu_count() or 1) if address is None else None,
                 include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError... by cause
        where = f"at {address}" if address else "locally"
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"--executor ray: Ray did not start {where}: {first}") from None
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def _progress(job: ScanJob, log: Log) -> Iterator[None]:
    """The same progress lines as the local scan, from the same completion markers."""
    stop = threading.Event()
    watcher = threading.Thread(target=_report_progress, args=(job, job.work / "datatrove", stop, log), daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()


def _check_every_part_finished(job: ScanJob, executor: Any) -> None:
    """datatrove's Ray executor returns when its tasks end, failed or not: a part without its
    completion marker stops the prepare here, with the part's own error when it raised one."""
    missing = executor.get_incomplete_ranks()
    if not missing:
        return
    failures = Path(job.work / "datatrove" / _FAILURES)
    for rank in missing:
        message = failures / f"{rank:05d}"
        if message.is_file():
            raise UsageError(message.read_text())
    raise UsageError(f"--executor ray: {len(missing)} of {len(job.parts)} parts did not finish (the task logs: "
                     f"{job.work / 'datatrove' / _TASK_LOGS}); run the same command again to resume")
