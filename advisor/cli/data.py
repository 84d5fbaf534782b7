"""`advisor data`: prepare a task's data (prepare), show a prepared folder (stats), generate the demo's."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Optional

import typer

from advisor.cli.common import (MAX_SCALE, TRUST_REMOTE_CODE, check_out_folder, console, err_console, exit_on_error,
                                print_or_render)
from advisor.cli.render import render_data_manifest
from advisor.errors import UsageError
from advisor.specs import check_number
from presets import load_task
from trainer.data.demo_corpus import ensure_generated_data, generate_demo_corpus
from trainer.data.manifest import read_manifest

# pyproject's `data` extra: what `advisor data prepare` and training on its shards import, and the
# main job (`advisor run`) never does
DATA_EXTRA = ("datasets", "pandas")


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
    trust_remote_code: bool = TRUST_REMOTE_CODE,
) -> None:
    """Clean (exact and MinHash near-duplicate removal, length and character-quality thresholds),
    grade by difficulty, bucket by length and write tokenised stage shards plus a manifest.

    The folder is written aside and renamed at the end: it is whole or untouched.
    """
    def compute():
        if out is not None:
            check_out_folder(out)
        require_data_extra("advisor data prepare")
        from trainer.data.prepare import prepare  # deferred: imports datasets/pandas (an extra; 0.5 s at every start)

        spec = load_task(task)
        log = None if as_json else (lambda message: err_console.print(message, style="dim", highlight=False))
        if ensure_generated_data(spec) and log:
            log(f"generated the {spec.name} task's data into {spec.base_dir}")
        return prepare(spec, out, micro_batch_tokens=micro_batch_tokens, log=log, allow_code=allow_code,
                       trusted=trust_remote_code)

    folder, manifest = exit_on_error(compute)
    if as_json:
        print(json.dumps(manifest))
        return
    render_data_manifest(manifest)
    console.print(f"wrote {folder}")


@data_app.command("stats")
def data_stats(
    directory: Path = typer.Argument(..., help="a folder written by `advisor data prepare` (or its manifest.json)"),
    as_json: bool = typer.Option(False, "--json", help="print the manifest as one JSON object"),
) -> None:
    """Show a prepared folder's manifest: tokens, samples, buckets and padding per stage."""
    manifest = exit_on_error(lambda: read_manifest(directory))
    print_or_render(manifest, as_json, lambda m: exit_on_error(lambda: render_checked(m, directory)))


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
