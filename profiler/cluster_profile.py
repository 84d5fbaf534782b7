"""From every rank's gathered figures to the profile's `cluster` section, and the hardware priced
at its members' pace (a synchronous step waits for a straggler; within the threshold, the median)."""

from __future__ import annotations

from typing import Any

from specs.profile import ClusterProfile, DeviceRate, LinkRate, NodeInventory
from specs.core import HardwareSpec
from profiler.stragglers import describe, device_name, find_stragglers, pace


def cluster_of(raw: dict[str, Any], threshold: float) -> ClusterProfile:
    """`raw["ranks"]` holds what every rank measured at once (profiler.run_profile.rank_work)."""
    ranks = sorted(raw["ranks"], key=lambda r: r["rank"])
    nodes = [NodeInventory(**r["inventory"]) for r in ranks if r["inventory"] is not None]
    devices = [DeviceRate(name=device_name(r["node"], r["local_rank"]), node=r["node"], rank=r["rank"],
                          gemm_tflops=r["gemm"], memory_gbs=r["memory_gbs"]) for r in ranks]
    links = [LinkRate(name=f"n{p['nodes'][0]}-n{p['nodes'][1]}", nodes=tuple(p["nodes"]),
                      bandwidth_gbs=p["fit"]["bandwidth_gbs"], latency_us=p["fit"]["latency_us"])
             for r in ranks for p in r["node_pairs"]]
    bisection = raw.get("bisection", {}).get("bisection_gbs")
    return ClusterProfile(nodes=nodes, uniform=_uniform(nodes), devices=devices, links=sorted(links, key=_link_key),
                          bisection_gbs=bisection, straggler_threshold=threshold,
                          stragglers=find_stragglers(devices, links, threshold))


def _link_key(link: LinkRate) -> tuple[int, int]:
    return link.nodes


def _uniform(nodes: list[NodeInventory]) -> bool:
    def shape(n: NodeInventory) -> tuple:
        return (n.cpu_model, n.device_name, n.devices, n.cpu_cores, round(n.host_memory_gib / 4))  # RAM to 4 GiB
    return len({shape(n) for n in nodes}) <= 1


def cluster_notes(cluster: ClusterProfile) -> list[str]:
    """What the console and the inventory say about the cluster: unequal nodes, stragglers."""
    notes = []
    if not cluster.uniform:
        notes.append("unequal nodes (the profile prices the weakest): " + "; ".join(
            f"node {n.node} {n.hostname}: {n.devices} x {n.device_name}, {n.cpu_cores} cores, "
            f"{n.host_memory_gib:,.0f} GiB RAM" for n in cluster.nodes))
    for straggler in cluster.stragglers:
        notes.append(f"straggler: {describe(straggler)} (advisor plan --exclude {straggler.name} prices without it)")
    return notes


def priced_at_slowest(hardware: HardwareSpec, cluster: ClusterProfile) -> HardwareSpec:
    """Each device figure at its devices' pace (a straggler's, else the median: `pace`), memory at
    the smallest node's; the collective fits already ran at the pace of their slowest link."""
    threshold = cluster.straggler_threshold
    peaks = dict(hardware.peak_tflops)
    for dtype in peaks:
        rates = [d.gemm_tflops[dtype] for d in cluster.devices if d.gemm_tflops.get(dtype, 0) > 0]
        if rates:
            peaks[dtype] = pace(rates, threshold)
    update: dict[str, Any] = {"peak_tflops": peaks,
                              "memory_bandwidth_gbs": pace([d.memory_gbs for d in cluster.devices], threshold)}
    if len(cluster.nodes) > 1:
        update["memory_gib"] = min(n.device_memory_gib for n in cluster.nodes)
        update["host_memory_gib"] = min(n.host_memory_gib for n in cluster.nodes)
    return hardware.model_copy(update=update)
