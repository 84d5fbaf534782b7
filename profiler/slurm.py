"""Slurm's view of a job: how many nodes, which one this is, and the master's address, read from the
environment srun sets. Torch-free on purpose: a second `advisor train` on a run dir in use reads its
node rank here before it is refused, and that refusal must not wait on importing torch."""

from __future__ import annotations

import os
import subprocess

from specs import environment
from specs.core import MAX_NODES
from specs.errors import UsageError


def slurm_topology() -> tuple[int, int, str] | None:
    """(nodes, node rank, master address) from Slurm's environment, when run under srun; a malformed
    or inconsistent value is refused in one line."""
    if "SLURM_JOB_NUM_NODES" not in os.environ or "SLURM_NODEID" not in os.environ:
        return None
    nodes = environment.whole_number("SLURM_JOB_NUM_NODES", least=1, most=MAX_NODES)
    node = environment.whole_number("SLURM_NODEID", least=0, most=MAX_NODES - 1)
    if nodes is None or node is None or node >= nodes:
        raise UsageError(f"Slurm's environment: node {os.environ['SLURM_NODEID']!r} of "
                         f"{os.environ['SLURM_JOB_NUM_NODES']!r} nodes is not a node of the job")
    master = os.environ.get("MASTER_ADDR")
    if master is None:
        try:
            hosts = subprocess.run(["scontrol", "show", "hostnames", os.environ.get("SLURM_JOB_NODELIST", "")],
                                   capture_output=True, text=True, check=False, timeout=30).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            hosts = []
        if not hosts and nodes > 1:
            raise UsageError("Slurm's environment names several nodes but scontrol did not list "
                             "SLURM_JOB_NODELIST's hosts: set MASTER_ADDR to the first node's address")
        master = hosts[0] if hosts else "127.0.0.1"
    return nodes, node, master
