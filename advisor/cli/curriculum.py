"""`advisor curriculum compare`: train a small proxy under each curriculum variant, several seeds, and
say whether staging pays on this task (reports/curriculum.py)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from advisor.cli.common import MAX_SCALE, check_out_folder, console, exit_on_error
from advisor.cli.quiet import quiet_console
from specs.errors import UsageError
from specs.run_dir import METRICS_FILE
from specs.core import check_number
from presets import load_hardware, load_model, load_task
from reports import curriculum as cc
from reports.curriculum_variants import VARIANTS
from trainer.data.demo_corpus import ensure_generated_data

curriculum_app = typer.Typer(no_args_is_help=True, rich_markup_mode="rich",
                             help="Does splitting the objective pay? Compare curricula on your task.")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _local_hardware() -> str:
    import torch  # deferred: the CLI's other verbs start without it

    if torch.cuda.is_available():
        raise UsageError("on a GPU machine, give --hardware: a preset or `advisor profile`'s profile.json")
    return "cpu"


@curriculum_app.command("compare")
def compare(
    task: str = typer.Option(..., "--task", help="task preset (e.g. demo) or task YAML"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="the proxy: model preset, HF config.json or "
                                        "folder (default: the task's model)"),
    hidden: Optional[int] = typer.Option(None, "--hidden", min=8, help="scale the proxy down to this hidden size"),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="scale the proxy down to this many layers"),
    seeds: int = typer.Option(3, "--seeds", min=1, help="seeds per variant (2+ for a spread)"),
    jobs: int = typer.Option(1, "--jobs", min=1, help="runs at a time, each in its own process with its share of "
                             "the CPU cores, or its own GPU where there are as many"),
    variants: Optional[str] = typer.Option(None, "--variants", help=f"comma-separated subset of {', '.join(VARIANTS)}"),
    scale: float = typer.Option(1.0, "--scale", min=0.0001, help="multiplies every stage's token budget"),
    eval_sequences: int = typer.Option(16, "--eval-sequences", min=1, help="held-out sequences per skill"),
    lr_grid: str = typer.Option(",".join(f"{f:g}" for f in cc.LR_FACTORS), "--lr-grid",
                                help="peak rates every variant is tried at (seed 0), as comma-separated factors of "
                                "the task's first stage's rate; each variant keeps its best"),
    hardware: Optional[str] = typer.Option(None, "--hardware", "-H", help="hardware preset or profile.json "
                                           "(default: this machine's kind: cpu, or a GPU preset)"),
    out: Path = typer.Option(Path("runs/curriculum"), "--out", help="report dir: compare.json, compare.md, "
                             "compare.png, and one run dir per variant and seed under runs/"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as one JSON object"),
    verbose: bool = typer.Option(False, "--verbose", help="third-party output on the console too"),
) -> None:
    """Train the proxy under one-pot, staged (hard switch), staged + replay (ramps), staged + replay +
    mixed (the task as written) and late-mix (one-pot, then the decay on the later skills' data), at
    equal tokens, all under one WSD schedule, each at its best peak rate of --lr-grid, several seeds;
    report per-skill eval loss (and exact match where the evaluation gives it) as mean ± spread, and
    recommend a variant only when its advantage beats the seeds' spread."""

    def prepare() -> tuple[cc.CompareRequest, dict]:
        check_number(scale, "--scale", gt=0, le=MAX_SCALE)
        check_out_folder(out)
        spec = load_task(task)
        if spec.model is None and model is None:
            raise UsageError(f"task {spec.name} names no model: give the proxy with --model")
        base = load_model(model or spec.model)  # type: ignore[arg-type]
        chosen = tuple(v.strip() for v in variants.split(",") if v.strip()) if variants else VARIANTS
        req = cc.CompareRequest(task=spec, model=cc.proxy_model(base, hidden, layers),
                                hardware=load_hardware(hardware or _local_hardware()), out=out, seeds=seeds,
                                variants=chosen, scale=scale, eval_sequences=eval_sequences, jobs=jobs,
                                gpus=_gpus(), lr_factors=_factors(lr_grid))
        if ensure_generated_data(spec):
            console.print(f"generated the {spec.name} task's data into {spec.base_dir}")
        return req, cc.plan_variants(req)

    req, plans = exit_on_error(prepare)
    per_variant = cc.runs_per_variant(req)
    total = sum(cc.plan_steps(next(iter(by_lr.values()))) for by_lr in plans.values()) * per_variant
    stderr = os.fdopen(os.dup(2), "w", buffering=1)  # the terminal's: the quiet console routes fd 2 to the log
    with stderr, quiet_console(out, verbose) as terminal:
        with _Bar(Console(file=stderr if as_json else terminal), total) as bar:
            result = exit_on_error(lambda: cc.compare(req, plans, bar.hooks()))
            paths = cc.write_outputs(result, out)
    if as_json:
        print(json.dumps(result))
        return
    _render(result)
    console.print(f"wrote {', '.join(str(p) for p in paths)}", highlight=False)


def _factors(text: str) -> tuple[float, ...]:
    try:
        factors = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--lr-grid {text!r}: give comma-separated numbers, e.g. 0.5,1,2") from None
    return factors  # checked (positive, finite, at least one) by cc.lr_grid


class _Bar:
    """One bar over all runs' optimizer steps, with an ETA; the running one's steps read from its
    metrics.jsonl once a second (the trainer writes a line per step)."""

    def __init__(self, term: Console, total: int):
        self.term, self.lines = term, not term.is_terminal  # a log gets one line per finished run instead
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("steps"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=term, disable=self.lines, refresh_per_second=1)
        self.bar = self.progress.add_task("curriculum runs", total=total)
        self.done, self.running, self.stop = 0, {}, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "_Bar":
        self.progress.__enter__()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.progress.__exit__(*exc)

    def hooks(self) -> cc.Progress:
        def started(variant: str, seed: int, run_dir: Path, steps: int) -> None:
            self.running[run_dir] = run_dir / METRICS_FILE

        def finished(variant: str, seed: int, run_dir: Path, steps: int) -> None:
            self.running.pop(run_dir, None)
            self.done += steps
            self.progress.update(self.bar, completed=self.done)
            if self.lines:
                task = self.progress.tasks[0]
                eta = task.elapsed / self.done * (task.total - self.done) if self.done and task.elapsed else 0.0
                self.term.print(f"{variant} seed {seed} done: {self.done}/{task.total:.0f} steps, "
                                f"{task.elapsed or 0:.0f} s elapsed, ETA {eta:.0f} s", highlight=False)

        return cc.Progress(started, finished)

    def _poll(self) -> None:
        while not self.stop.wait(1.0):
            lines = 0
            for path in list(self.running.values()):
                if path.is_file():  # a run not started yet has none
                    with open(path, "rb") as f:
                        lines += f.read().count(b"\n")
            self.progress.update(self.bar, completed=self.done + lines)


def _render(result: dict) -> None:
    scored = result["skills"]
    table = Table(title=f"{result['task']}: final eval loss per skill, mean ± spread over {result['seeds']} seeds "
                  f"({result['model']})")
    table.add_column("variant")
    table.add_column("tokens", justify="right")
    table.add_column("peak lr", justify="right")
    for skill in scored:
        table.add_column(f"{skill} loss", justify="right")
    table.add_column("mean loss", justify="right")
    has_em = any("exact_match" in v for v in result["variants"].values())
    if has_em:
        for skill in scored:
            table.add_column(f"{skill} EM", justify="right")
    for name, entry in result["variants"].items():
        cells = [cc.mean_spread(entry["eval"]["skills"][s]) for s in scored] + [cc.mean_spread(entry["eval"]["mean"])]
        if has_em:
            cells += [cc.mean_spread(entry.get("exact_match", {}).get("skills", {}).get(s)) for s in scored]
        table.add_row(name, f"{entry['tokens']:,}", cc.chosen_lr_text(entry), *cells)
    console.print(table)
    console.print(f"schedule: {result['schedule']}", highlight=False)
    console.print(f"[bold]recommendation:[/bold] {result['recommendation']['text']}", highlight=False)
    console.print(f"per skill: {cc.winners_text(result)}", highlight=False)
    if result.get("finding"):
        console.print(f"[bold]finding:[/bold] {result['finding']}", highlight=False)
