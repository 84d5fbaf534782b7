"""One launch per run directory (issue 31, finding 3), and workers that die with their launcher.

The launching CLI holds an exclusive `flock` on a lock file in the run dir for the whole launch; the
kernel releases it when the holder exits or is killed, so a stale lock never needs cleaning up. A
second launch on a held dir exits 2 naming the holder's pid. Each node of a multi-node run locks its
own file (a shared run dir is written by every node's launcher).

The process tree dies with the CLI: torchrun's agent and each worker ask the kernel for SIGTERM when
their parent dies (`prctl(PR_SET_PDEATHSIG)`, Linux), and torchrun's agent stops its workers on it.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import sys
from pathlib import Path

from specs.errors import UsageError
from specs.run_dir import lock_file_name

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def lock_path(run_dir: Path, node_rank: int = 0) -> Path:
    return run_dir / lock_file_name(node_rank)


class RunDirLock:
    """The exclusive hold of one launcher on its run dir (`take`, then `release` or process exit)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def take(cls, run_dir: Path, node_rank: int = 0) -> "RunDirLock":
        run_dir.mkdir(parents=True, exist_ok=True)
        path = lock_path(run_dir, node_rank)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the workers (O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise UsageError(f"{run_dir} is in use by another advisor launch (pid {holder}); wait for it to "
                             "finish or stop it, or give another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(path, fd)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def die_with_parent(parent: int) -> None:
    """Ask for SIGTERM when the parent process dies; exit at once if it already has (it died before the
    request took hold)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(143)
