"""What every verb shares: the two consoles, the error wrapper, the layout help text, the compute rule,
the per-user cache folder, and the stage token counts a task's prepared data gives the planner."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import typer
from rich.console import Console
from rich.markup import escape

from advisor.errors import UsageError
from advisor.specs import LAYOUT_KEYS_HELP, MIN_COMPUTE_FRACTION  # noqa: F401  (the verbs' default)
from advisor.task import TaskSpec
from trainer.data.manifest import manifest_stage_tokens

console = Console()
err_console = Console(stderr=True)

LAYOUT_HELP = "Layout keys (comma-separated key=value; left-out keys take defaults):\n\n" + "\n\n".join(
    f"[bold]{k}[/bold]: {v}" for k, v in LAYOUT_KEYS_HELP.items()
)


def exit_on_error(action: Callable[[], Any]) -> Any:
    """Run `action`; turn user errors into one clear line and exit code 2."""
    try:
        return action()
    except UsageError as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except (KeyboardInterrupt, typer.Exit):
        raise
    except Exception as exc:  # an unexpected failure: say what, hide the traceback unless asked
        if os.environ.get("ADVISOR_DEBUG"):
            raise
        err_console.print(f"[red]internal error:[/red] {type(exc).__name__}: {escape(str(exc))} "
                          "(rerun with ADVISOR_DEBUG=1 for the traceback)", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def stage_tokens(task: TaskSpec | None) -> dict[str, int] | None:
    """Each stage's tokens from the task's prepared data when it is fresh (None: the task file's)."""
    return manifest_stage_tokens(task) if task is not None else None


def print_or_render(value: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    """`--json`: the value as one JSON object on stdout (what scripts read); otherwise the verb's tables."""
    if as_json:
        print(json.dumps(value))
    else:
        render(value)
