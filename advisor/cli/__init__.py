"""The `advisor` command line: the one composition root, above every package. Thin: one module per
verb parses, calls one function of a package, renders (advisor/cli/render.py).

Bad input never shows a traceback: a `UsageError` prints one line and exits with code 2.
Set ADVISOR_DEBUG=1 to see tracebacks of unexpected errors.
"""

from __future__ import annotations

import os

import typer

from advisor.cli import curriculum, data, estimate, plan, presets, profile, report, run, train

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="Plan, run and report task-split LLM training: will it fit, how fast, on what hardware.",
)


@app.callback()
def _sane_terminal_size() -> None:
    """rich sizes every print from COLUMNS and LINES: a value that is no size (huge, zero, words) would
    end the first print in a traceback, so it is dropped and the console measures the terminal."""
    for name in ("COLUMNS", "LINES"):
        value = os.environ.get(name, "").strip()
        if value and not (value.isascii() and value.isdigit() and 1 <= int(value) <= 10_000):
            del os.environ[name]


app.command()(presets.presets)
app.command(help=estimate.HELP)(estimate.estimate)
app.command()(plan.plan)
app.command()(train.train)
app.command("run")(run.run_all)
app.command()(profile.profile)
app.add_typer(report.report_app, name="report")
app.add_typer(data.data_app, name="data")
app.add_typer(curriculum.curriculum_app, name="curriculum")
