"""One rank of a multi-process run: `python -m trainer.worker RUN/launch.json`, what torchrun's agent
starts in every rank (trainer/launch.py). It trains the launch file's plan (trainer/launch_file.py)
with its options, resuming when the file says so or when torchrun or Slurm restarted the job.

Its output goes where the launcher sent it (the CLI's quiet console routes it to the run's logs/),
and an error is one line starting `error:` (bad input, exit 2) or `internal error:` (exit 1), the
lines the launcher quotes from that log when the ranks fail.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from specs import environment
from specs.errors import UsageError
from trainer.launch_file import read_launch_file
from trainer.run_lock import die_with_parent

USAGE = "usage: python -m trainer.worker RUN_DIR/launch.json (written by the launcher of `advisor train`)"


def run_worker(launch_path: Path) -> dict:
    """Train this rank of the launch in `launch_path`; rank 0's summary."""
    launch = read_launch_file(launch_path)
    # deferred: torch and the loop (seconds), after a bad launch file has had its say
    from trainer.launch import train_rank
    from trainer.run_identity import restarted

    resume = launch.resume or restarted()  # a torchrun restart or Slurm requeue continues the run
    return train_rank(launch.plan, launch.out, resume, launch.options, distributed=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    die_with_parent(os.getppid())  # torchrun's agent: a worker outlives neither it nor the launcher
    try:
        run_worker(Path(args[0]))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # as the CLI words it: the launcher quotes this line on the console
        if environment.read("ADVISOR_DEBUG"):
            raise
        print(f"internal error: {type(exc).__name__}: {exc} (rerun with ADVISOR_DEBUG=1 for the traceback)",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
