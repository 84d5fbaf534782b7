"""Stragglers: devices and links slower than the median of their kind by more than a threshold.

Every device ran the same GEMM and memory benchmark at once, and every node pair the same
send/recv, so their figures compare like for like. A synchronous step runs at the pace of its
slowest member: the profile's `hardware` takes a straggler's figures (`pace`), and this module
names who they are.
"""

from __future__ import annotations

import statistics

from specs.profile import DeviceRate, LinkRate, Straggler

DEFAULT_THRESHOLD = 0.2  # 20% below the median: beyond the run-to-run noise of a quiet GPU node


def straggles(value: float, median: float, threshold: float) -> bool:
    """Whether a member's figure lies more than `threshold` below its kind's median."""
    return value < (1 - threshold) * median


def pace(values: list[float], threshold: float) -> float:
    """The figure a synchronous step of these members runs at: the slowest one's where it straggles
    (more than `threshold` below the median), else the median. Within the threshold members differ
    by their benchmark's noise (a CPU's cores, measured at once, by 5-15% from one quick profile to
    the next), and pricing the lowest draw would price every plan by that noise."""
    median = statistics.median(values)
    return min(values) if straggles(min(values), median, threshold) else median


def device_name(node: int, local_rank: int) -> str:
    return f"n{node}d{local_rank}"


def device_figures(device: DeviceRate) -> dict[str, float]:
    """The figures a device is compared on: GEMM per dtype and the memory bandwidth."""
    return {**{f"gemm/{dtype}": tflops for dtype, tflops in device.gemm_tflops.items() if tflops > 0},
            "memory_bandwidth": device.memory_gbs}


def find_stragglers(devices: list[DeviceRate], links: list[LinkRate], threshold: float) -> list[Straggler]:
    """Each device figure and each link's bandwidth more than `threshold` below the median of its kind,
    slowest first."""
    out = []
    for figure in sorted({f for d in devices for f in device_figures(d)}):
        values = {d.name: device_figures(d)[figure] for d in devices if figure in device_figures(d)}
        out += _below_median(values, "device", figure, threshold)
    out += _below_median({link.name: link.bandwidth_gbs for link in links}, "link", "send_recv", threshold)
    return sorted(out, key=lambda s: -s.slower_by)


def _below_median(values: dict[str, float], kind: str, figure: str, threshold: float) -> list[Straggler]:
    if len(values) < 2:
        return []
    median = statistics.median(values.values())
    return [Straggler(name=name, kind=kind, figure=figure, value=value, median=median,  # type: ignore[arg-type]
                      slower_by=1 - value / median)
            for name, value in values.items() if straggles(value, median, threshold)]


def describe(straggler: Straggler) -> str:
    unit = {"memory_bandwidth": "GB/s", "send_recv": "GB/s"}.get(straggler.figure, "TFLOP/s")
    return (f"{straggler.kind} {straggler.name}: {straggler.figure} {straggler.value:.4g} {unit}, "
            f"{100 * straggler.slower_by:.0f}% below the median {straggler.median:.4g}")
