"""`advisor data`: prepare a task's data (prepare), show a prepared folder (stats), generate the demo's."""

from __future__ import annotations

import importlib
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Optional

import typer

from advisor.cli.common import (MAX_SCALE, TRUST_REMOTE_CODE, check_out_folder, console, err_console, exit_on_error,
                                print_or_render)
from advisor.cli.render import render_data_manifest, render_partial_prepare
from specs.errors import UsageError
from specs.core import check_number
from presets import load_task
from trainer.data.demo_corpus import ensure_generated_data, generate_demo_corpus
from trainer.data.manifest import default_out_dir, read_manifest
from trainer.data.partial import partial_prepare

# pyproject's `data` extra: what `advisor data prepare` and training on its shards import, and the
# main job (`advisor run`) never does
DATA_EXTRA = ("datasets", "pandas", "datatrove")


def require_data_extra(command: str) -> None:
    """One line naming the install, instead of an ImportError from deep inside the pipeline."""
    missing = []
    for module in DATA_EXTRA:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise UsageError(f"{command} needs {' and '.join(missing)}: pip install -e \".[data]\"")


def require_ray() -> None:
    """`--executor ray` needs the `ray` extra (Ray's wheel is large and most prepares never use it)."""
    try:
        importlib.import_module("ray")
    except ImportError:
        raise UsageError('--executor ray needs ray: pip install -e ".[ray]"') from None


EXECUTORS = ("local", "slurm", "ray")


def check_executor(name: str, dry_run: bool, partition: Optional[str], ray_address: Optional[str] = None) -> None:
    if name not in EXECUTORS:
        raise UsageError(f"--executor {name[:40]!r}: unknown; use {', '.join(EXECUTORS)}")
    if name == "slurm" and not dry_run and shutil.which("sbatch") is None:
        raise UsageError("--executor slurm: sbatch is not on PATH (no Slurm client here); --dry-run writes the job "
                         "scripts without submitting them")
    if name == "slurm" and not partition:
        raise UsageError("--executor slurm needs --partition (the Slurm partition to run on)")
    if dry_run and name != "slurm":
        raise UsageError("--dry-run goes with --executor slurm (a local prepare has nothing to write aside)")
    if ray_address is not None and name != "ray":
        raise UsageError("--ray-address goes with --executor ray")
    if ray_address is not None and not ray_address.strip():
        raise UsageError("--ray-address is empty; use auto (the running cluster) or the head's host:port")


data_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode="rich",
    help="Prepare a task's data: clean, deduplicate, grade by difficulty, bucket by length, shard into stages.",
)


@data_app.command("prepare")
def data_prepare(
    task: str = typer.Option(..., "--task", help="task preset (e.g. demo) or task YAML"),
    out: Optional[Path] = typer.Option(None, "--out", help="output folder (default: the task's data.out, "
                                                           "relative to the task file)"),
    micro_batch_tokens: Optional[int] = typer.Option(
        None, "--micro-batch-tokens", min=8, help="token budget of one micro-batch for the bucket edges"),
    as_json: bool = typer.Option(False, "--json", help="print the manifest as one JSON object"),
    allow_code: bool = typer.Option(False, "--allow-code", help="let a difficulty rule `module:function` or "
                                                                "`file.py:function` import and run that code"),
    workers: Optional[int] = typer.Option(
        None, "--workers", help="scan this many parts of the data at a time, one core each (default: every "
                                "core; with --ray-address, as many as the cluster runs); the output is the same"),
    executor: str = typer.Option("local", "--executor", help="where the scan runs: local (this machine's cores), "
                                                             "slurm (a job array) or ray (a Ray cluster)"),
    rows_per_part: Optional[int] = typer.Option(
        None, "--rows-per-part", min=1, help="rows of a JSON-lines file per scan task, the unit of work and of "
                                             "resume (default 10000)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="with --executor slurm: write the job scripts, submit "
                                                          "nothing"),
    partition: Optional[str] = typer.Option(None, "--partition", help="with --executor slurm: the partition"),
    time_limit: str = typer.Option("04:00:00", "--time", help="with --executor slurm: each job's time limit"),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="with --executor ray: the cluster "
                                              "(auto: the one running here; default: start a local instance)"),
    trust_remote_code: bool = TRUST_REMOTE_CODE,
) -> None:
    """Clean (exact and MinHash near-duplicate removal, length and character-quality thresholds),
    grade by difficulty, bucket by length and write tokenised stage shards plus a manifest.

    The folder is written aside and renamed at the end: it is whole or untouched. The scan runs as
    datatrove tasks on every core; a killed prepare, run again, resumes from the parts it finished.
    """
    def compute():
        if out is not None:
            check_out_folder(out)
        check_executor(executor, dry_run, partition, ray_address)
        if workers is not None:
            check_number(workers, "--workers", ge=1)
        scan_workers = _default_workers(executor, ray_address) if workers is None else workers
        require_data_extra("advisor data prepare")
        if executor == "ray":
            require_ray()
        from trainer.data.prepare import prepare  # deferred: imports datasets/pandas (an extra; 0.5 s at every start)

        spec = load_task(task)
        if executor == "slurm":
            return _slurm_job(spec, task, out, partition, time_limit, workers, rows_per_part, allow_code,
                              trust_remote_code, submit=not dry_run)
        log = None if as_json else (lambda message: err_console.print(message, style="dim", highlight=False))
        if ensure_generated_data(spec) and log:
            log(f"generated the {spec.name} task's data into {spec.base_dir}")
        return prepare(spec, out, micro_batch_tokens=micro_batch_tokens, log=log, allow_code=allow_code,
                       workers=scan_workers, trusted=trust_remote_code, executor=executor, ray_address=ray_address,
                       **({"rows_per_part": rows_per_part} if rows_per_part else {}))

    result = exit_on_error(compute)
    if executor == "slurm":
        _print_slurm_job(*result)
        return
    folder, manifest = result
    if as_json:
        print(json.dumps(manifest))
        return
    render_data_manifest(manifest)
    console.print(f"wrote {folder}")


def _default_workers(executor: str, ray_address: Optional[str]) -> int:
    """Every core of this machine; on a Ray cluster joined by address, 0: as many as it runs."""
    if executor == "ray" and ray_address is not None:
        return 0
    return os.cpu_count() or 1


def _slurm_job(spec, task: str, out: Optional[Path], partition: str, time_limit: str, workers: Optional[int],
               rows_per_part: Optional[int], allow_code: bool, trusted: bool,
               submit: bool) -> tuple[dict[str, Path], Optional[dict[str, list[str]]], Path]:
    """The scan as a Slurm job array and a finishing job (the same prepare, run where every part is
    already scanned, merges and writes the shards): the scripts' paths, and the job ids once
    submitted (with `submit`)."""
    # deferred: pyarrow, datatrove and the tokenizer (the data extra; seconds at every start)
    from trainer.data.parts import ROWS_PER_PART
    from trainer.data.pipeline import SlurmOptions, submit_slurm_scripts
    from trainer.data.prepare import write_slurm_job

    if not re.fullmatch(r"(\d+-)?\d{1,3}(:\d{2}){0,2}", time_limit):
        raise UsageError(f"--time {time_limit[:40]!r}: use minutes, [D-]HH:MM:SS or D-HH")
    final = (out or default_out_dir(spec)).resolve()
    task_arg = str(Path(task).resolve()) if Path(task).is_file() else task
    rows = rows_per_part or ROWS_PER_PART
    finish = shlex.join([sys.executable, "-m", "advisor.cli", "data", "prepare", "--task", task_arg, "--out", str(final),
                         "--workers", "1", "--rows-per-part", str(rows)] + (["--allow-code"] if allow_code else [])
                        + (["--trust-remote-code"] if trusted else []))
    options = SlurmOptions(partition=partition, time=time_limit, array_parallelism=workers or 64)
    paths = write_slurm_job(spec, final, options, finish, allow_code=allow_code, rows_per_part=rows, trusted=trusted)
    return paths, submit_slurm_scripts(paths) if submit else None, final


def _print_slurm_job(paths: dict[str, Path], ids: Optional[dict[str, list[str]]], final: Path) -> None:
    for name, path in paths.items():
        console.print(f"wrote {path} ({name})", soft_wrap=True)
    if ids is None:
        console.print(f"submit with: bash {paths['submit']}", soft_wrap=True)
        return
    scan = f"the scan as job {', '.join(ids['scan'])}, then " if ids["scan"] else ""
    console.print(f"submitted {scan}the finishing job {', '.join(ids['finish'])}; it writes "
                  f"{final} (logs: {paths['submit'].parent / 'slurm_logs'})", soft_wrap=True)


@data_app.command("stats")
def data_stats(
    directory: Path = typer.Argument(..., help="a folder written by `advisor data prepare` (or its manifest.json), "
                                               "or one whose prepare has not finished"),
    as_json: bool = typer.Option(False, "--json", help="print the manifest (or the partial report) as one JSON object"),
) -> None:
    """Show a prepared folder's manifest: tokens, samples, buckets and padding per stage. For a prepare
    that has not finished (killed, or still running): the parts scanned so far, marked partial."""
    manifest = exit_on_error(lambda: _manifest_or_partial(directory))
    if manifest.get("partial") is True:
        print_or_render(manifest, as_json, render_partial_prepare)
        return
    print_or_render(manifest, as_json, lambda m: exit_on_error(lambda: render_checked(m, directory)))


def _manifest_or_partial(directory: Path) -> dict:
    """A finished folder's manifest; else what an unfinished prepare there holds; else one line."""
    try:
        return read_manifest(directory)
    except UsageError as finished_error:
        if Path(directory).is_file():
            raise
        try:
            partial = partial_prepare(directory)
        except OSError:
            partial = None
        if partial is None:
            raise UsageError(f"{finished_error}; nor is a prepare of {directory} under way (no scan work folder "
                             "beside it)") from None
        return partial


def render_checked(manifest: dict, directory: Path) -> None:
    """Render, or say in one line that the manifest lacks what a prepared folder's has (edited, or
    written by something else): the tables are built before anything is printed."""
    try:
        render_data_manifest(manifest)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        what = f"no key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise UsageError(f"{directory}: damaged manifest ({what}); rerun `advisor data prepare`") from None


@data_app.command("generate-demo")
def data_generate_demo(
    out: Path = typer.Option(..., "--out", help="folder: data/*.jsonl and task.yaml go there"),
    seed: int = typer.Option(0, "--seed", help="random seed (same seed, same files)"),
    scale: float = typer.Option(1.0, "--scale", min=0.0001, help="multiply every file's size"),
) -> None:
    """Generate the embedded demo's curriculum data (language, arithmetic, instructions, eval splits)."""
    def generate() -> dict[str, Path]:
        check_number(scale, "--scale", gt=0, le=MAX_SCALE)
        check_out_folder(out)
        return generate_demo_corpus(out, seed=seed, scale=scale)

    written = exit_on_error(generate)
    for path in written.values():
        console.print(f"wrote {path}")
