"""The scan of `advisor data prepare` as a datatrove pipeline: one task per part, on every core.

datatrove runs the tasks (`LocalPipelineExecutor`: a pool of worker processes) and records each
finished task with a completion marker in its logging folder; a prepare that is killed and run
again skips the tasks already marked. The work folder is named by a hash of everything that
decides the parts (`job_key`), so a changed task or file never reuses a stale part.

The scan itself is ours (`ScanStep` wraps trainer/data/scan.py): datatrove's own steps work on one
document at a time as text, while the scan spools token ids, quality numbers, exact hashes, MinHash
signatures and difficulty grades as columns that the whole-task duplicate resolution reads back.
Near duplicates are datatrove's MinHash stages (trainer/data/near_dedup.py): its signature stage
in each scan task, after the scan (writing the signatures the scan spooled), its buckets and
clusters in the prepare's process once every part is in.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from datatrove.executor.local import LocalPipelineExecutor
from datatrove.pipeline.base import PipelineStep
from loguru import logger

from specs import environment
from specs.errors import UsageError
from specs.task import DifficultySpec, TaskSpec
from trainer.data import near_dedup
from trainer.data.difficulty import Grader
from trainer.data.partial import scan_folder, scan_folders
from trainer.data.scan import Part, ScanSettings, UnitColumns, part_column, scan_part
from trainer.data.tokenizer import TextTokenizer

# raise when a part's files change meaning: older work folders are then not reused (1: main's MinHash
# band keys; 2: no signature column, datatrove's signature stage read the texts again; 3: buckets over
# every document, clusters of unverified pairs)
SCAN_FORMAT = 4
KILL_HOOK = "ADVISOR_PREPARE_KILL_AFTER_PARTS"
_POLL_S = 1.0

Log = Callable[[str], None]


@dataclass
class ScanJob:
    """What a worker process needs to scan parts: plain data, pickled to every worker."""

    key: str
    task: TaskSpec
    tokenizer_path: Path
    allow_code: bool
    trusted: bool  # --trust-remote-code: the tokenizer's and reference model's own code
    graders: dict[str, DifficultySpec]   # grader key -> its difficulty spec
    units: list[UnitColumns]
    parts: list[Part]                     # by index: task rank r scans parts[r]
    work: Path
    main_pid: int


def job_key(fingerprint: str, rows_per_part: int, tokenizer_path: Path) -> str:
    blob = f"{fingerprint}|{rows_per_part}|{tokenizer_path}|{SCAN_FORMAT}"
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def work_folder(out: Path, key: str) -> Path:
    """Beside the output folder (the output is written aside and renamed; the work must outlive a
    killed run). Work folders of other keys for the same output are stale and removed."""
    out = Path(out).resolve()
    for stale in scan_folders(out):
        if stale != scan_folder(out, key):
            shutil.rmtree(stale, ignore_errors=True)
    return scan_folder(out, key)


_SETTINGS: dict[str, ScanSettings] = {}  # per process: a worker loads the tokenizer and graders once


def remember_settings(key: str, settings: ScanSettings) -> None:
    """Settings the calling process already built (tasks run in-process at one worker)."""
    _SETTINGS[key] = settings


def one_core_per_worker() -> None:
    """A worker scans on one core, on every executor: `--workers N` uses N cores, as datatrove's
    Slurm and Ray executors give each task one CPU. `tokenizers` would encode a batch on a rayon
    pool as wide as the machine (a 1-worker scan then took about 1.3 cores here, and 2 workers on 2
    cores ran 4 busy threads that preempt each other); with TOKENIZERS_PARALLELISM off it encodes on
    the calling thread (read at every call; RAYON_NUM_THREADS when the pool is first built). The
    prepare's own process (the in-process task of a 1-worker scan) sets it for the scan only
    (`one_core_here`)."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


@contextlib.contextmanager
def one_core_here() -> Iterator[None]:
    """`one_core_per_worker` in the prepare's process for the scan's duration, then as it was."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def scan_settings(job: ScanJob) -> ScanSettings:
    if job.key not in _SETTINGS:
        if os.getpid() != job.main_pid:
            one_core_per_worker()
        dedup = job.task.data.dedup
        tokenizer = TextTokenizer(job.tokenizer_path, job.trusted)
        graders = {key: Grader(spec, Path(job.task.base_dir), job.task.seq_len, job.allow_code, job.trusted)
                   for key, spec in job.graders.items()}
        _SETTINGS[job.key] = ScanSettings(tokenizer=tokenizer, eos_id=tokenizer.eos_id,
                                          append_eos=job.task.data.append_eos, exact=dedup.exact,
                                          graders=graders, signer=near_dedup.scan_signer(job.work, dedup))
    return _SETTINGS[job.key]


class ScanStep(PipelineStep):
    """Task r scans part r of the job. Written here rather than composed of datatrove's steps: see
    the module's docstring."""

    name = "scan parts"
    type = "advisor"

    def __init__(self, job: ScanJob) -> None:
        super().__init__()
        self.job = job

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Iterator[Any]:
        job = self.job
        _kill_hook(job)
        part = job.parts[rank]
        with self.track_time():
            rows = scan_part(job.units[part.unit], part, scan_settings(job), job.work / "parts")
        self.stat_update("documents", value=rows)
        if data:
            yield from data


def scan_steps(job: ScanJob) -> list[PipelineStep]:
    """What each scan task runs: the scan, then (near duplicates on) datatrove's MinHash signature
    stage, which writes its files from the signatures the scan spooled."""
    dedup = job.task.data.dedup
    signatures = near_dedup.signature_step(job.work, dedup, functools.partial(spooled_signatures, job))
    return [ScanStep(job)] + ([signatures] if dedup.near else [])


def spooled_signatures(job: ScanJob, rank: int) -> np.ndarray:
    return part_column(job.work / "parts", job.parts[rank], "signature")


def _kill_hook(job: ScanJob) -> None:
    """Test hook: once K parts are finished, kill the prepare and this worker outright (kill -9),
    before the next part starts, so that a test can resume a prepare killed midway."""
    text = environment.read(KILL_HOOK).strip()
    if not text:
        return
    if not text.isdigit():
        raise UsageError(f"{KILL_HOOK}={text[:40]!r}: expected a whole number of parts")
    folder = job.work / "datatrove" / "completions"  # datatrove's markers: what a rerun will skip
    finished = sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0
    if finished >= int(text):
        os.kill(job.main_pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


class _Discard:
    """A stream that drops what is written (never closed: loguru keeps the stream it was given)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


class _QuietExecutor(LocalPipelineExecutor):
    """datatrove's local executor, its console logging sent to the task log files only: the
    prepare shows its own progress lines."""

    def _run_for_rank(self, rank: int, local_rank: int = 0, node_rank: int = -1) -> Any:
        # datatrove adds a loguru sink on sys.stderr as it is at this moment, per task
        with contextlib.redirect_stderr(_Discard()):
            return super()._run_for_rank(rank, local_rank, node_rank)


def run_scan(job: ScanJob, workers: int, log: Log) -> int:
    """Scan every part not finished before, `workers` at a time; returns how many were reused."""
    logging_dir = job.work / "datatrove"
    workers = max(1, min(workers, len(job.parts)))
    executor = _QuietExecutor(scan_steps(job), tasks=len(job.parts), workers=workers, logging_dir=str(logging_dir))
    reused = len(job.parts) - len(executor.get_incomplete_ranks())
    if reused:
        log(f"resuming: {reused} of {len(job.parts)} parts were scanned before")
    logger.remove()  # datatrove logs through loguru to stderr; the task log files keep everything
    stop = threading.Event()
    watcher = threading.Thread(target=_report_progress, args=(job, logging_dir, stop, log), daemon=True)
    watcher.start()
    try:
        with one_core_here():
            executor.run()
    finally:
        stop.set()
        watcher.join()
        logger.remove()  # the sinks datatrove added while it ran
    return reused


def run_minhash_stages(job: ScanJob, keep: Callable[[int], np.ndarray],
                       signatures: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
    """datatrove's MinHash buckets (one task per band, over the documents `keep` lets take part),
    our verification of their pairs, and datatrove's clusters (one task), over the signatures the
    scan tasks wrote; each stage's finished tasks are skipped on a rerun. All run in this process
    (datatrove's local executor at one worker): a band's buckets take milliseconds
    (`SortedBuckets`), while a fresh pool's workers each spend a CPU second or more importing."""
    dedup = job.task.data.dedup
    stages = [(near_dedup.bucket_step(job.work, dedup, keep), dedup.bands),
              (near_dedup.verify_step(job.work, dedup, signatures), 1),
              (near_dedup.cluster_step(job.work, dedup), 1)]
    logger.remove()
    try:
        for step, tasks in stages:
            folder = job.work / "minhash" / f"logs-{step.name.split()[-1]}"
            _QuietExecutor([step], tasks=tasks, workers=1, logging_dir=str(folder)).run()
    finally:
        logger.remove()


def _report_progress(job: ScanJob, logging_dir: Path, stop: threading.Event, log: Log) -> None:
    shown = -1
    while not stop.wait(_POLL_S):
        folder = logging_dir / "completions"
        done = sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0
        if done != shown and done < len(job.parts):
            log(f"scanning: {done}/{len(job.parts)} parts done")
            shown = done


# --- Slurm: the same tasks as a job array ------------------------------------------------------------


@dataclass
class SlurmOptions:
    """The job array's resources: each array task scans one part on one core."""

    partition: str
    time: str = "04:00:00"
    mem_per_cpu_gb: int = 4
    array_parallelism: int = 64   # array tasks running at once (sbatch --array=0-N%P)
    job_name: str = "advisor-prepare"


def write_slurm_scripts(job: ScanJob, options: SlurmOptions, finish_command: str) -> dict[str, Path]:
    """Write the scan's job array as datatrove writes it (its pickled executor, the ranks to run and
    `launch_script.slurm`) and a finishing job (`finish.slurm`) that runs `finish_command`, plus
    `submit.sh`, which submits both, the second after the first succeeds. Nothing is submitted.

    datatrove 0.10 has no dry run: its own `launch_job` runs here with the one function that calls
    sbatch replaced by one that keeps the script, so the scripts are exactly those it would submit."""
    from datatrove.executor import slurm

    logging_dir = job.work / "datatrove"
    executor = slurm.SlurmPipelineExecutor(
        scan_steps(job), tasks=len(job.parts), time=options.time, partition=options.partition, cpus_per_task=1,
        mem_per_cpu_gb=options.mem_per_cpu_gb, workers=options.array_parallelism, job_name=options.job_name,
        logging_dir=str(logging_dir), slurm_logs_folder=str(job.work / "slurm_logs"), requeue=True, qos="",
        mail_type="NONE")
    kept: list[str] = []

    def keep_script(contents: str, job_id_retriever: Any, *args: str) -> str:
        kept.append(contents)
        return "0"

    submit = slurm.launch_slurm_job
    slurm.launch_slurm_job = keep_script
    logger.remove()  # its log would say that a job was launched
    try:
        executor.launch_job()
    finally:
        slurm.launch_slurm_job = submit
    paths = {"array": logging_dir / "launch_script.slurm", "finish": job.work / "finish.slurm",
             "submit": job.work / "submit.sh"}
    if not kept:  # every part was scanned before: only the finishing job is left
        paths.pop("array")
    paths["finish"].write_text(_finish_script(options, finish_command, job.work / "slurm_logs"))
    arrays = math.ceil(len(executor.get_incomplete_ranks()) / executor.max_array_size)
    paths["submit"].write_text(_submit_script(paths, arrays))
    return paths


def _finish_script(options: SlurmOptions, command: str, logs: Path) -> str:
    return "\n".join([
        "#!/bin/bash", f"#SBATCH --job-name={options.job_name}-finish", f"#SBATCH --partition={options.partition}",
        f"#SBATCH --time={options.time}", "#SBATCH --nodes=1", "#SBATCH --cpus-per-task=1",
        f"#SBATCH --mem-per-cpu={options.mem_per_cpu_gb}G", f"#SBATCH --output={logs}/finish-%j.out",
        f"#SBATCH --error={logs}/finish-%j.out", "set -e", command, ""])


def _submit_script(paths: dict[str, Path], arrays: int) -> str:
    """Submit the array (in slices of datatrove's largest array, each with its RUN_OFFSET, as its
    own launcher does), then the finishing job once every slice has succeeded."""
    lines = ["#!/bin/bash", "set -e", "after=afterok"]
    for offset in range(arrays if "array" in paths else 0):  # --parsable prints `id` or `id;cluster`
        lines += [f"scan=$(sbatch --parsable --export=ALL,RUN_OFFSET={offset} {paths['array']})",
                  "after=\"$after:${scan%%;*}\"", "echo \"scan job ${scan%%;*}\""]
    depend = "--dependency=$after " if "array" in paths else ""
    lines += [f"finish=$(sbatch --parsable {depend}{paths['finish']})", "echo \"finish job ${finish%%;*}\""]
    return "\n".join(lines) + "\n"


def submit_slurm_scripts(paths: dict[str, Path]) -> dict[str, list[str]]:
    """Submit what `write_slurm_scripts` wrote by running its `submit.sh` (so that what runs is what
    a dry run shows); returns the job ids it printed: {"scan": [...], "finish": [...]}."""
    import subprocess

    done = subprocess.run(["bash", str(paths["submit"])], capture_output=True, text=True)
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines()[-1]
        raise UsageError(f"sbatch refused the prepare's job: {said[:300]} (the scripts: {paths['submit'].parent})")
    ids: dict[str, list[str]] = {"scan": [], "finish": []}
    for line in done.stdout.splitlines():
        kind, _, job_id = line.partition(" job ")
        if kind in ids and job_id.strip():
            ids[kind].append(job_id.strip())
    return ids
