"""Benchmarks of the links between nodes, run by every rank of a multi-node profile together.

* Every node pair: ping-pong send/recv between the pair's first ranks (one-way time = half the
  round trip, which cancels the skew of ranks leaving a barrier), at a small and a large size,
  fitted to latency + bytes / bandwidth (hardware_bench.fit_alpha_beta). The pairs of a round of
  the circle method are disjoint and run at once, as the links of a data-parallel ring do.
* The effective bisection: an all-to-all of every rank; what crosses the cut between the first
  and the second half of the nodes, both ways, per second.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from profiler.hardware_bench import Repeater, fit_alpha_beta, synchronize


def pair_rounds(nodes: int) -> list[list[tuple[int, int]]]:
    """Every unordered pair of nodes once, in rounds of disjoint pairs (the circle method)."""
    ring = list(range(nodes)) + ([None] if nodes % 2 else [])
    rounds = []
    for _ in range(len(ring) - 1):
        pairs = [(ring[i], ring[-1 - i]) for i in range(len(ring) // 2)]
        rounds.append([tuple(sorted(p)) for p in pairs if None not in p])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return rounds  # type: ignore[return-value]


def bench_node_pairs(rank: int, local_world: int, nodes: int, sizes: list[int], repeats: int,
                     device: torch.device, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Send/recv of every node pair; returns, on every rank, the pairs this rank timed (the first
    rank of the lower node of each pair it belongs to)."""
    import torch.distributed as dist

    out = []
    for pairs in pair_rounds(nodes):
        mine = next(((a, b) for a, b in pairs if rank in (a * local_world, b * local_world)), None)
        points = []
        for nbytes in sizes:
            buffer = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
            samples = []
            for attempt in range(repeats + 1):  # the first is the warm-up (gloo pairs connect lazily)
                dist.barrier()
                if mine is not None:
                    seconds = _ping_pong(buffer, rank, mine[0] * local_world, mine[1] * local_world)
                    if attempt:
                        samples.append(seconds)
            if samples:
                points.append((nbytes, statistics.median(samples)))
        if mine is not None and rank == mine[0] * local_world:
            fit = fit_alpha_beta("send_recv", 2, points)
            out.append({"nodes": list(mine), "points": points, "fit": fit.__dict__})
        if progress:
            progress(f"send/recv {len(pairs)} node pair(s)")
    return out


def _ping_pong(buffer: torch.Tensor, rank: int, first: int, second: int) -> float:
    import torch.distributed as dist

    synchronize(buffer.device)
    start = time.perf_counter()
    if rank == first:
        dist.send(buffer, dst=second)
        dist.recv(buffer, src=second)
    else:
        dist.recv(buffer, src=first)
        dist.send(buffer, dst=first)
    synchronize(buffer.device)
    return (time.perf_counter() - start) / 2


def crossing_bytes(per_rank_bytes: int, world: int, local_world: int) -> float:
    """Bytes of an all-to-all (each rank sends per_rank_bytes / world to every rank) that cross
    between the first ceil(n/2) nodes and the rest, both ways."""
    nodes = world // local_world
    first = (nodes + 1) // 2 * local_world
    return 2 * first * (world - first) * per_rank_bytes / world


def bench_bisection(world: int, local_world: int, nbytes: int, budget_s: float,
                    device: torch.device) -> dict[str, Any]:
    """All-to-all of `nbytes` per rank over every rank at once; the slowest rank's median time."""
    import torch.distributed as dist

    elems = max(world, nbytes // 4 // world * world)
    send, receive = torch.ones(elems, device=device), torch.empty(elems, device=device)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def sample() -> float:
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        dist.all_to_all_single(receive, send)
        synchronize(device)
        return time.perf_counter() - start

    sample()  # warm-up
    timing = Repeater(budget_s=budget_s, min_repeats=3, agree=slowest).run(sample)
    crossing = crossing_bytes(elems * 4, world, local_world)
    return {"bytes": elems * 4, "crossing_bytes": crossing, "bisection_gbs": crossing / timing.median_s / 1e9,
            **timing.__dict__}
