"""Every environment variable that steers the advisor, declared once with its meaning.

Code reads them through `read` (never `os.environ` with an `ADVISOR_` name of its own), so that this
table is the whole list: what a user may set, and the hooks the tests use to make a run fail on
purpose. A value that does not parse is refused in one line (exit 2), never a traceback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from specs.errors import UsageError
from specs.core import check_number


@dataclass(frozen=True)
class Variable:
    name: str
    meaning: str
    audience: Literal["user", "test hook", "internal"]


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("ADVISOR_CACHE", "folder of the advisor's caches (model traces, tokenised data, compiled "
             "ops); default ~/.cache/advisor", "user"),
    Variable("ADVISOR_DEBUG", "set to 1: unexpected errors print their traceback instead of one line",
             "user"),
    Variable("ADVISOR_WORKER_LOG", "the file training workers write their logs and third-party warnings to, "
             "set by the CLI for the launch it starts", "internal"),
    Variable("ADVISOR_INJECT_OOM", "step=N and/or tokens=N: a worker raises CUDA's out-of-memory error "
             "there (trainer/oom.py), to test the fallback", "test hook"),
    Variable("ADVISOR_CHECKPOINT_DELAY_S", "seconds slept between the files of a checkpoint save, so that a "
             "test can kill a run in the middle of one", "test hook"),
    Variable("ADVISOR_INJECT_FSYNC_FAILURE", "rank=R[,step=S]: that rank's fsync fails while it seals its "
             "checkpoint files (at step S's save only), to test that such a checkpoint is never sealed", "test hook"),
    Variable("ADVISOR_PREPARE_KILL_AFTER_PARTS", "K: once K parts of `advisor data prepare`'s scan are "
             "finished, the prepare and its worker are killed outright (SIGKILL), to test that the same command "
             "resumes it", "test hook"),
    Variable("ADVISOR_PROFILE_SLOW_RANKS", "rank=factor,...: those ranks of `advisor profile` run that many "
             "times slower, to test straggler detection", "test hook"),
)}


def read(name: str, default: str = "") -> str:
    """The variable's value (`default` when unset). Only declared names may be read."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in specs/environment.py")
    return os.environ.get(name, default)


def read_seconds(name: str) -> float:
    """A declared variable holding a finite, non-negative number of seconds (0 when unset or empty)."""
    text = read(name).strip()
    try:
        value = float(text) if text else 0.0
    except ValueError:
        raise UsageError(f"{name}={text!r}: expected a number of seconds") from None
    check_number(value, name, ge=0)
    return value


def whole_number(name: str, least: int = 0, most: int = 1_000_000) -> int | None:
    """A launcher's variable (Slurm's, torchrun's) holding a whole number in [least, most]; None when unset
    or empty. Anything else is refused in one line naming it: guessing would put a rank on the wrong
    node or resume a run by mistake."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    if not (text.isascii() and text.isdigit()) or not least <= int(text) <= most:
        raise UsageError(f"environment variable {name}={text[:40]!r}: expected a whole number from {least} to "
                         f"{most} (it is set by the launcher; unset it to run outside one)")
    return int(text)
