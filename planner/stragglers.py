"""Pricing a cluster at its slowest participating member, with the devices or nodes the user
excludes left out (`advisor plan --exclude n1d0,n3`).

A synchronous step waits for its slowest device, and a ring collective runs at its slowest link,
so the profile's `hardware` holds their pace (profiler.stragglers.pace: a straggler's figure, else
the median). Excluding members reprices each figure by (pace of those kept / pace of all). The
device count is the plan's, not the profile's: an excluded device is assumed replaced by one like
the others (a scheduler's `--exclude`), which is what "what excluding it would gain" means.
"""

from __future__ import annotations

import statistics

from specs.errors import UsageError
from specs.profile import ClusterProfile, DeviceRate, Straggler
from specs.core import HardwareSpec
from profiler.stragglers import pace, straggles


def parse_exclude(text: str | None) -> list[str]:
    return [name.strip() for name in (text or "").split(",") if name.strip()]


def excluded_devices(cluster: ClusterProfile, exclude: list[str]) -> set[str]:
    """Device names left out: `n<i>d<j>` names a device, `n<i>` every device of node i."""
    names = {d.name for d in cluster.devices}
    nodes = {f"n{d.node}" for d in cluster.devices}
    unknown = [name for name in exclude if name not in names and name not in nodes]
    if unknown:
        raise UsageError(f"--exclude {', '.join(unknown)}: not in the profile (devices {', '.join(sorted(names))}; "
                         f"nodes {', '.join(sorted(nodes))})")
    out = {d.name for d in cluster.devices if d.name in exclude or f"n{d.node}" in exclude}
    if out == names:
        raise UsageError(f"--exclude {','.join(exclude)} leaves no measured device to price")
    return out


def priced_without(hardware: HardwareSpec, cluster: ClusterProfile, exclude: list[str]) -> HardwareSpec:
    """`hardware` (priced at the slowest of every device and link) repriced at the slowest of those kept."""
    if not exclude:
        return hardware
    gone = excluded_devices(cluster, exclude)
    kept = [d for d in cluster.devices if d.name not in gone]
    threshold = cluster.straggler_threshold
    peaks = dict(hardware.peak_tflops)
    for dtype in peaks:
        peaks[dtype] *= _ratio([d.gemm_tflops.get(dtype, 0.0) for d in kept],
                               [d.gemm_tflops.get(dtype, 0.0) for d in cluster.devices], threshold)
    memory = _ratio([d.memory_gbs for d in kept], [d.memory_gbs for d in cluster.devices], threshold)
    gone_nodes = {f"n{d.node}" for d in cluster.devices} & set(exclude)
    kept_links = [link.bandwidth_gbs for link in cluster.links
                  if not {f"n{link.nodes[0]}", f"n{link.nodes[1]}"} & gone_nodes]
    network = _ratio(kept_links, [link.bandwidth_gbs for link in cluster.links], threshold)
    return hardware.model_copy(update={
        "peak_tflops": peaks, "memory_bandwidth_gbs": hardware.memory_bandwidth_gbs * memory,
        "inter_node_bandwidth_gbs": hardware.inter_node_bandwidth_gbs * network})


def _ratio(kept: list[float], every: list[float], threshold: float) -> float:
    kept, every = [v for v in kept if v > 0], [v for v in every if v > 0]
    return pace(kept, threshold) / pace(every, threshold) if kept and every else 1.0


def slowest_device(cluster: ClusterProfile, exclude: list[str], dtype: str) -> DeviceRate:
    gone = excluded_devices(cluster, exclude) if exclude else set()
    kept = [d for d in cluster.devices if d.name not in gone]
    return min(kept, key=lambda d: d.gemm_tflops.get(dtype, 0.0) or float("inf"))


def pricing_note(cluster: ClusterProfile, exclude: list[str], dtype: str) -> str:
    device = slowest_device(cluster, exclude, dtype)
    without = f" (without {', '.join(exclude)})" if exclude else ""
    gone = excluded_devices(cluster, exclude) if exclude else set()
    rates = [d.gemm_tflops.get(dtype, 0.0) for d in cluster.devices if d.name not in gone]
    rates = [r for r in rates if r > 0] or [0.0]
    rate = device.gemm_tflops.get(dtype, 0.0)
    if len(rates) == 1 or (rate and straggles(rate, statistics.median(rates), cluster.straggler_threshold)):
        return (f"priced at the slowest participating device{without}: {device.name}, GEMM {dtype} "
                f"{rate * 1e3:,.1f} GFLOP/s, of {len(cluster.devices)} measured (a synchronous step waits for it)")
    return (f"priced at the median participating device{without}: GEMM {dtype} "
            f"{statistics.median(rates) * 1e3:,.1f} GFLOP/s over {len(rates)} measured; the slowest, {device.name}, "
            f"is within the {100 * cluster.straggler_threshold:.0f}% straggler threshold (noise)")


def straggler_candidates(cluster: ClusterProfile, exclude: list[str]) -> dict[str, Straggler]:
    """What `--exclude` could still take out: each straggling device, and the later node of each
    straggling link; the worst figure of each."""
    out: dict[str, Straggler] = {}
    for straggler in cluster.stragglers:
        name = straggler.name if straggler.kind == "device" else straggler.name.split("-")[1]
        if name in exclude or name in out:
            continue
        out[name] = straggler
    return out
