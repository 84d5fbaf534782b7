"""What this machine (or this torchrun job) has: devices, memory, cores, nodes and links.

CUDA (nccl) and CPU (gloo) are profiled; other accelerators (MPS, XPU, ...) are refused with a
clear line. On CPU a *device* is one rank pinned to `threads_per_device` cores (one per core by
default, as the `cpu` preset's `devices_per_node: 2` says), and the node's RAM is shared out
between its devices.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

from specs.errors import UsageError
from specs.profile import HostFingerprint, Inventory, cpu_model_name

GiB = 1024**3


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_memory() -> tuple[float, float]:
    """(total, available) RAM of this node in GiB."""
    info: dict[str, float] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            info[key] = float(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    if "MemTotal" in info:
        return info["MemTotal"] / GiB, info.get("MemAvailable", info["MemTotal"]) / GiB
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / GiB, total / GiB


def process_rss_gib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024 / GiB
    except (OSError, ValueError):
        pass
    return 0.0


def resolve_device(requested: str) -> str:
    """`auto` picks CUDA when present, else the CPU; MPS and others are refused by name."""
    import torch

    if requested not in ("auto", "cuda", "cpu", "mps", "xpu"):
        raise UsageError(f"--device must be auto, cuda or cpu (got {requested})")
    if requested in ("mps", "xpu"):
        raise UsageError(f"profiling {requested} is not supported: advisor profiles CUDA (nccl) and CPU "
                         "(gloo) devices; use --device cpu to profile the host")
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def _nvidia_topology() -> str:
    """NVLink when `nvidia-smi topo -m` shows NV# links between GPUs, else PCIe."""
    if not shutil.which("nvidia-smi"):
        return "PCIe or NVLink (nvidia-smi not found)"
    try:
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (nvidia-smi topo failed)"
    if any(tok.startswith("NV") and tok[2:].isdigit() for tok in topo.split()):
        return "NVLink"
    return "PCIe"


def _network() -> str:
    if Path("/sys/class/infiniband").is_dir() and any(Path("/sys/class/infiniband").iterdir()):
        return "InfiniBand/RoCE (" + ", ".join(sorted(p.name for p in Path("/sys/class/infiniband").iterdir())) + ")"
    return "TCP sockets"


def take_inventory(device_type: str, devices_per_node: int, nodes: int = 1, threads_per_device: int = 1,
                   reserved_gib: float | None = None) -> Inventory:
    """The inventory of this node; `reserved_gib` is the per-device reserve measured in a rank
    (CUDA: context + NCCL; CPU: the framework's import footprint), when known."""
    import torch

    total, available = host_memory()
    cores = cpu_cores()
    notes = []
    if torch.backends.mps.is_available():
        notes.append("an MPS device is present; profiling MPS is not supported, the CPU was profiled")
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(0)
        count = torch.cuda.device_count()
        if devices_per_node > count:
            raise UsageError(f"--nproc {devices_per_node} exceeds the {count} visible CUDA devices")
        names = {torch.cuda.get_device_name(i) for i in range(count)}
        if len(names) > 1:
            notes.append(f"mixed devices {sorted(names)}: figures are of the slowest rank")
        memory = props.total_memory / GiB
        if reserved_gib is None:
            free, total_dev = torch.cuda.mem_get_info(0)
            reserved_gib = (total_dev - free) / GiB
        return Inventory(
            device_type="cuda", backend="nccl", device_name=props.name, devices_per_node=devices_per_node,
            nodes=nodes, device_memory_gib=memory, device_reserved_gib=reserved_gib, cpu_cores=cores,
            threads_per_device=threads_per_device, host_memory_gib=total, host_memory_available_gib=available,
            intra_node_link=_nvidia_topology() if devices_per_node > 1 else "none (one device)",
            inter_node_link=_network() if nodes > 1 else "none (one node)", notes=notes,
        )
    if devices_per_node * threads_per_device > cores:
        notes.append(f"{devices_per_node} ranks x {threads_per_device} threads oversubscribe {cores} cores")
    return Inventory(
        device_type="cpu", backend="gloo", device_name=cpu_model_name(), devices_per_node=devices_per_node,
        nodes=nodes, device_memory_gib=total / devices_per_node,
        device_reserved_gib=reserved_gib if reserved_gib is not None else process_rss_gib(),
        cpu_cores=cores, threads_per_device=threads_per_device, host_memory_gib=total,
        host_memory_available_gib=available,
        intra_node_link="shared memory (gloo over loopback TCP)" if devices_per_node > 1 else "none (one device)",
        inter_node_link=_network() if nodes > 1 else "none (one node)", notes=notes,
    )


def this_host(device_names: list[str] | None = None) -> HostFingerprint:
    """The fingerprint a new profile records: host, CPU, and the torch and CUDA it measured with."""
    import torch  # heavy: only when a profile is written

    return HostFingerprint(
        hostname=socket.gethostname(), cpu_model=cpu_model_name(), torch_version=torch.__version__,
        device_names=device_names or [], cuda_version=torch.version.cuda,
    )
