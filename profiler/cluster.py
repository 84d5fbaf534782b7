"""Several nodes profiling together: where the nodes are, and the meeting before any rank starts.

Each node runs `advisor profile --nnodes N --node-rank R --master-addr A [--master-port P]` (or
takes N, R and A from Slurm's environment, as `advisor train` does). Before any rank starts, the
launchers meet in a `TCPStore` that node 0 hosts on port P: each says how many devices it brings,
so that global ranks are numbered without gaps, and a wrong address, a closed port or a node that
never comes fails within `--timeout-s` with one line instead of hanging. The ranks' own process
group then meets on port P + 1 (its store is hosted by global rank 0, as torchrun's is).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator

from profiler.slurm import slurm_topology
from specs.errors import UsageError

DEFAULT_PORT = 29514
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ClusterOptions:
    """The nodes as `cluster_options` checked them (the flags' defaults are DEFAULT_PORT, DEFAULT_TIMEOUT_S)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    timeout_s: float

    @property
    def group_port(self) -> int:
        """Where the ranks' process group meets."""
        return self.master_port + 1


def cluster_options(nnodes: int | None, node_rank: int | None, master_addr: str | None, master_port: int,
                    timeout_s: float) -> ClusterOptions | None:
    """The nodes from the flags, else from Slurm's environment; None for one node. Checked here,
    before anything starts."""
    if not timeout_s > 0:
        raise UsageError(f"--timeout-s must be more than 0 (got {timeout_s})")
    if not 1 <= master_port <= 65534:  # the process group takes the next port
        raise UsageError(f"--master-port must be within 1-65534 (got {master_port})")
    topology = None
    if nnodes is None:
        topology = slurm_topology()
    if topology is not None:
        nnodes, slurm_rank, slurm_master = topology
        node_rank = slurm_rank if node_rank is None else node_rank
        master_addr = master_addr or slurm_master
    nnodes = nnodes or 1
    node_rank = node_rank or 0
    if nnodes < 1:
        raise UsageError(f"--nnodes must be at least 1 (got {nnodes})")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank must be within 0-{nnodes - 1} for --nnodes {nnodes} (got {node_rank})")
    if nnodes == 1:
        return None
    if not master_addr:
        raise UsageError(f"--nnodes {nnodes} needs --master-addr: the address of node 0 (node rank 0)")
    return ClusterOptions(nnodes, node_rank, master_addr, master_port, timeout_s)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """c10d logs every failed connection attempt with a C++ stack trace on file descriptor 2; the
    user gets our one line instead."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@dataclass
class Meeting:
    """What the launchers agreed: devices per node, hence every node's first global rank."""

    devices: list[int]
    store: Any  # node 0 hosts it: kept alive until the profile is done

    @property
    def world(self) -> int:
        return sum(self.devices)

    def first_rank(self, node: int) -> int:
        return sum(self.devices[:node])


def meet(opts: ClusterOptions, devices: int) -> Meeting:
    """Every launcher announces its device count and waits for every other's, within the timeout."""
    from torch.distributed import TCPStore

    deadline = time.monotonic() + opts.timeout_s
    where = f"{opts.master_addr}:{opts.master_port}"
    timeout = datetime.timedelta(seconds=opts.timeout_s)
    if opts.node_rank == 0:
        try:
            with quiet_stderr():
                store = TCPStore(opts.master_addr, opts.master_port, is_master=True, wait_for_workers=False,
                                 timeout=timeout)
        except Exception as exc:  # noqa: BLE001  (c10d raises several kinds; all mean the same here)
            raise UsageError(f"node 0 cannot listen on port {opts.master_port}: {_first_line(exc)}") from None
    else:
        _wait_reachable(opts.master_addr, opts.master_port, deadline, opts.timeout_s)
        try:
            with quiet_stderr():
                store = TCPStore(opts.master_addr, opts.master_port, is_master=False,
                                 timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"cannot join the profile's master at {where}: {_first_line(exc)}") from None
    store.set(f"devices/{opts.node_rank}", str(devices))
    keys = [f"devices/{n}" for n in range(opts.nnodes)]
    try:
        with quiet_stderr():
            store.wait(keys, datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except Exception:  # noqa: BLE001
        missing = [str(n) for n in range(opts.nnodes) if not store.check([f"devices/{n}"])]
        raise UsageError(f"node(s) {', '.join(missing)} of {opts.nnodes} did not join at {where} within "
                         f"{opts.timeout_s:g} s (--timeout-s): start `advisor profile --nnodes {opts.nnodes} "
                         "--node-rank R --master-addr ...` on every node") from None
    counts = [int(store.get(key)) for key in keys]
    if len(set(counts)) > 1:
        raise UsageError("every node must profile the same number of devices (pass the same --nproc on each): "
                         + ", ".join(f"node {n}: {c}" for n, c in enumerate(counts)))
    return Meeting(counts, store)


def _wait_reachable(host: str, port: int, deadline: float, timeout_s: float) -> None:
    """Poll until node 0's store accepts a connection (it may start later than this node)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                return
        except socket.gaierror as exc:
            raise UsageError(f"--master-addr {host}: cannot resolve it ({exc.strerror})") from None
        except OSError:
            if time.monotonic() >= deadline:
                raise UsageError(f"cannot reach the profile's master at {host}:{port} within {timeout_s:g} s "
                                 "(--timeout-s): is node 0 started, and the address and port right?") from None
            time.sleep(0.2)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
