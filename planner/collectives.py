"""Time of one collective on the hardware's links (ring algorithms, alpha-beta model).

Bus-bandwidth factors follow nccl-tests' definitions: a ring all-reduce moves 2(n-1)/n of the
buffer through each device's link, all-gather and reduce-scatter (n-1)/n, send/recv the whole
buffer once (Thakur, Rabenseifner and Gropp 2005, the ring costs in Table 1).
"""

from __future__ import annotations

from advisor.specs import HardwareSpec


def link(hardware: HardwareSpec, spans_nodes: bool) -> tuple[float, float]:
    """Achievable bytes/s and latency (s) of the slowest link a group of devices crosses."""
    eff = hardware.efficiency
    if spans_nodes:
        return (hardware.inter_node_bandwidth_gbs * 1e9 * eff.inter_node_collective,
                hardware.inter_node_latency_us * 1e-6)
    return (hardware.intra_node_bandwidth_gbs * 1e9 * eff.intra_node_collective,
            hardware.intra_node_latency_us * 1e-6)


def all_reduce_s(nbytes: float, ranks: int, hardware: HardwareSpec, spans_nodes: bool) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = link(hardware, spans_nodes)
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


def all_gather_s(nbytes: float, ranks: int, hardware: HardwareSpec, spans_nodes: bool) -> float:
    """`nbytes` is the gathered (full) buffer; reduce-scatter costs the same."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = link(hardware, spans_nodes)
    return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency


reduce_scatter_s = all_gather_s


def send_recv_s(nbytes: float, hardware: HardwareSpec, spans_nodes: bool) -> float:
    if nbytes <= 0:
        return 0.0
    bandwidth, latency = link(hardware, spans_nodes)
    return nbytes / bandwidth + latency
