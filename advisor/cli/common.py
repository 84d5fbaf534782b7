"""What every verb shares: the two consoles, the error wrapper, the layout help text, the compute rule,
the per-user cache folder, and the stage token counts a task's prepared data gives the planner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import typer
from rich.console import Console
from rich.markup import escape

from specs import environment
from specs.errors import UsageError
from specs.remote_code import TRUST_FLAG, TRUST_HELP
from specs.core import LAYOUT_KEYS_HELP, MIN_COMPUTE_FRACTION, ModelSpec  # noqa: F401  (the verbs' default)
from specs.task import TaskSpec
from trainer.data.manifest import manifest_stage_tokens

console = Console()
err_console = Console(stderr=True)

LAYOUT_HELP = "Layout keys (comma-separated key=value; left-out keys take defaults):\n\n" + "\n\n".join(
    f"[bold]{k}[/bold]: {v}" for k, v in LAYOUT_KEYS_HELP.items()
)


# `--scale` of `data generate-demo` (file sizes) and `curriculum compare` (token budgets): beyond it
# the demo's files or runs outgrow any disk or day
MAX_SCALE = 1000.0
# Every verb that reads a user's model or tokenizer folder takes it: without it, a folder naming Python
# code of its own (auto_map) is refused in one line (specs/remote_code.py)
# (with its --no- form, so that a script can state the default explicitly)
TRUST_REMOTE_CODE = typer.Option(False, f"{TRUST_FLAG}/--no-{TRUST_FLAG[2:]}", help=TRUST_HELP)

# `--engine` of estimate, plan and report capacity: whose behaviour is priced
PRICED_ENGINE_HELP = ("the engine whose behaviour is priced: ours (default: what `advisor train` runs), megatron "
                      "(Megatron-LM, as the published runs it produced were made: fused kernels, 4 TP all-reduces "
                      "per layer, fp32 master in the optimizer) or fsdp (PyTorch FSDP with bf16 reductions, as "
                      "llm-foundry and fms-fsdp run it; data parallelism only); priced only, never run here")


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
        if environment.read("ADVISOR_DEBUG"):
            raise
        err_console.print(f"[red]internal error:[/red] {type(exc).__name__}: {escape(str(exc))} "
                          "(rerun with ADVISOR_DEBUG=1 for the traceback)", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def check_run_dir(out: Path, flag: str = "--out") -> None:
    """A run dir of `advisor train`/`run`: an output folder (`check_out_folder`) that is neither the
    current folder nor one above it, which a later run would move aside with everything in it (an
    empty --out is the current folder)."""
    resolved, here = out.resolve(), Path.cwd().resolve()
    if resolved == here or resolved in here.parents:
        raise UsageError(f"{flag} {str(out) or repr('')}: the current folder, or one above it, cannot be a run "
                         f"dir (a later run moves it aside whole); name a folder inside it, e.g. {flag} runs/mine")
    check_out_folder(out, flag)


def check_out_folder(out: Path, flag: str = "--out") -> None:
    """An output folder the command may create or use: refused in one line when it, or a folder on its
    way, is a file (mkdir would fail with a traceback, or the run would write beside the user's file)."""
    for path in (out, *out.parents):
        try:
            found = path.exists() or path.is_symlink()
        except OSError as exc:  # a name the filesystem cannot hold (too long, ...)
            raise UsageError(f"{flag} {str(out)[:80]}: {exc.strerror}") from None
        if found:
            if not path.is_dir():
                raise UsageError(f"{flag} {out}: {path} is a file, not a folder")
            return


def stage_tokens(task: TaskSpec | None, model: ModelSpec | None = None,
                 seq: int | None = None) -> dict[str, int] | None:
    """Each stage's tokens from the task's prepared data when it is fresh (None: the task file's);
    with the model, stages budgeted in epochs that the manifest does not count are counted from
    their raw data when it is readable (one pass; the others are sized at run time)."""
    if task is None:
        return None
    counts = manifest_stage_tokens(task)
    if model is not None and any(s.epochs is not None and s.name not in (counts or {}) for s in task.stages):
        # deferred: tokenizes the stage's data (only tasks with an epochs budget pay for it)
        from trainer.corpus import epoch_pass_tokens

        raw = epoch_pass_tokens(task, model.name, int(model.hf_config.get("vocab_size", 0)), seq or task.seq_len)
        counts = {**raw, **(counts or {})} or None
    return counts


def print_or_render(value: Any, as_json: bool, render: Callable[[Any], None]) -> None:
    """`--json`: the value as one JSON object on stdout (what scripts read); otherwise the verb's tables."""
    if as_json:
        print(json.dumps(value))
    else:
        render(value)
