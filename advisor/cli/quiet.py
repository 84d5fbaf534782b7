"""A quiet console: our own lines and one progress display on the terminal; every third-party
warning, log line and native print goes to RUN_DIR/logs/output.log.

Design: one redirection at the file-descriptor level, made once in the CLI process before any work.
File descriptors 1 and 2 are pointed at the log file, and our two rich consoles (common.py) write to
duplicates of the terminal's descriptors taken just before. Everything else then inherits the
redirection without knowing about it:

* Python warnings and logging handlers write to `sys.stderr`/`sys.stdout`, which are descriptors 2/1;
* native code writes to the descriptors directly (DeepSpeed's op builder runs ninja and prints);
* ranks forked by profiler/ranks.py (profiling, calibration, verification trials) inherit them;
* torchrun and its workers are started with them, so every rank's output lands in the same file
  (each write is appended whole: O_APPEND).

No worker therefore prints to the console, rank 0 included: the CLI draws progress itself from the
run's metrics.jsonl (advisor/cli/progress.py). Python warnings are also routed into logging
(`logging.captureWarnings`), so a warning and a library's log record read alike in the file, with a
time stamp. A failure restores the descriptors before the error leaves the block, so a traceback
asked for with ADVISOR_DEBUG=1 reaches the terminal.

`--verbose` leaves the terminal's descriptors alone (third-party output shows on the console, as it
would without this module) but for sending descriptor 1 to 2, so that stdout carries our lines (and
`--json`) alone; the Python warnings and logging records of this process and its forked ranks are
then also copied to the log file. Native prints and torchrun workers' output are not: copying a
descriptor to two places needs a tee process, which is not worth it for a debugging switch.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import logging
import os
import sys
from pathlib import Path
from typing import Iterator, TextIO

from advisor.cli.common import console, err_console
from specs.run_dir import LOGS_DIR
from trainer.options import WORKER_LOG_ENV

LOG_DIR = LOGS_DIR
LOG_FILE = "output.log"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"



def log_path(run_dir: Path) -> Path:
    return run_dir / LOG_DIR / LOG_FILE


@contextlib.contextmanager
def quiet_console(run_dir: Path, verbose: bool = False) -> Iterator[TextIO]:
    """Route third-party output to RUN_DIR/logs/output.log for the block; yields the terminal's stdout
    (where our own output, `--json` included, goes)."""
    path = log_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal_out, terminal_err = _terminal(sys.stdout, 1), _terminal(sys.stderr, 2)
    log = open(path, "a", buffering=1)
    log.write(f"--- {dt.datetime.now().isoformat(timespec='seconds')} pid {os.getpid()}: {' '.join(sys.argv)}\n")
    consoles = [(c, c._file) for c in (console, err_console)]  # None: rich follows sys.stdout/err
    console.file, err_console.file = terminal_out, terminal_err
    handlers = _route_logging(log, verbose)
    os.dup2(2 if verbose else log.fileno(), 1)
    if not verbose:
        os.dup2(log.fileno(), 2)
    os.environ[WORKER_LOG_ENV] = str(path)  # the launcher quotes a failed worker's error from it
    try:
        yield terminal_out
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in zip((1, 2), saved):
            os.dup2(original, fd)
            os.close(original)
        _unroute_logging(handlers)
        for c, file in consoles:
            c.file = file
        for stream in (terminal_out, terminal_err):
            if stream not in (sys.stdout, sys.stderr):
                stream.close()
        os.environ.pop(WORKER_LOG_ENV, None)
        log.close()


def _terminal(stream: TextIO, fd: int) -> TextIO:
    """Where our own lines go during the block: a copy of the terminal's descriptor `fd`, or `stream`
    itself when it is not that descriptor (a test runner's capture, which the redirection leaves be)."""
    try:
        if stream.fileno() == fd:
            return os.fdopen(os.dup(fd), "w", buffering=1)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    return stream


def _route_logging(log: TextIO, verbose: bool) -> list[logging.Handler]:
    """Warnings into logging, and root-logger handlers: one that writes records to the log file and,
    with --verbose, one to the terminal's stderr (once the root logger has a handler, logging's
    last-resort stderr handler no longer speaks, so this one stands in for it)."""
    logging.captureWarnings(True)
    handlers: list[logging.Handler] = [logging.StreamHandler(log)]
    if verbose:
        handlers.append(logging.StreamHandler(sys.stderr))
    for handler in handlers:
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        logging.getLogger().addHandler(handler)
    return handlers


def _unroute_logging(handlers: list[logging.Handler]) -> None:
    for handler in handlers:
        logging.getLogger().removeHandler(handler)
    logging.captureWarnings(False)
