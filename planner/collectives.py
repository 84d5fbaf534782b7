"""Time of one collective on the hardware's links (ring algorithms, alpha-beta model).

Bus-bandwidth factors follow nccl-tests' definitions: a ring all-reduce moves 2(n-1)/n of the
buffer through each device's link, all-gather and reduce-scatter (n-1)/n, send/recv the whole
buffer once (Thakur, Rabenseifner and Gropp 2005, the ring costs in Table 1).
"""

from __future__ import annotations

from specs.core import HardwareSpec


def link(hardware: HardwareSpec, spans_nodes: bool, op: str = "all_reduce") -> tuple[float, float]:
    """Achievable bytes/s and latency (s) of `op` over the slowest link a group of devices crosses:
    the op's own measured fit where the profile has one, else the link's all-reduce figures."""
    eff = hardware.efficiency
    scope = "inter" if spans_nodes else "intra"
    efficiency = eff.inter_node_collective if spans_nodes else eff.intra_node_collective
    own = hardware.collective_links.get(f"{op}/{scope}")
    if own is not None:
        return own.bandwidth_gbs * 1e9 * efficiency, own.latency_us * 1e-6
    if spans_nodes:
        return hardware.inter_node_bandwidth_gbs * 1e9 * efficiency, hardware.inter_node_latency_us * 1e-6
    return hardware.intra_node_bandwidth_gbs * 1e9 * efficiency, hardware.intra_node_latency_us * 1e-6


def all_reduce_s(nbytes: float, ranks: int, hardware: HardwareSpec, spans_nodes: bool) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = link(hardware, spans_nodes)
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


def _half_ring_s(op: str, nbytes: float, ranks: int, hardware: HardwareSpec, spans_nodes: bool) -> float:
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = link(hardware, spans_nodes, op)
    return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency


def all_gather_s(nbytes: float, ranks: int, hardware: HardwareSpec, spans_nodes: bool) -> float:
    """`nbytes` is the gathered (full) buffer."""
    return _half_ring_s("all_gather", nbytes, ranks, hardware, spans_nodes)


def reduce_scatter_s(nbytes: float, ranks: int, hardware: HardwareSpec, spans_nodes: bool) -> float:
    """`nbytes` is the full buffer before the scatter."""
    return _half_ring_s("reduce_scatter", nbytes, ranks, hardware, spans_nodes)


def send_recv_s(nbytes: float, hardware: HardwareSpec, spans_nodes: bool) -> float:
    if nbytes <= 0:
        return 0.0
    bandwidth, latency = link(hardware, spans_nodes, "send_recv")
    return nbytes / bandwidth + latency
