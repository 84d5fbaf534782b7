"""Collectives on a CPU node whose ranks outnumber its cores: gloo's all-reduce, all-gather and
reduce-scatter (the calls DTensor's TP and FSDP2 make) timed on one pair of ranks, one rank per
core as `advisor profile` measures its links, and then on 4 ranks at once, as two pairs (the
DP x TP mesh: every TP pair and every DP pair communicates together) and as one group of 4.

The cost model prices a collective at the profile's link and multiplies it by the cores'
time-sharing, `HardwareSpec.oversubscription` (planner/cost_model.py `stage_time`), as it does the
compute: gloo's copies and reductions are the ranks' own CPU work. The ratio column is measured
over priced, where priced = the pair's measured time x the ring's bus factor for the group size
x that time-sharing factor.

    python -m bench.time_shared_collectives
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402
from presets import load_hardware  # noqa: E402
from profiler.hardware_bench import RING_FACTORS  # noqa: E402
from profiler.ranks import finish_rank, free_port, init_rank, launch  # noqa: E402

SIZES_MIB = (8, 64)
OPS = ("all_reduce", "all_gather", "reduce_scatter")
REPEATS = 7


def _worker(rank: int, world: int, groups: list[list[int]], port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    init_rank(rank, world, port, True, 1)
    handles = [dist.new_group(members) for members in groups]  # collective: every rank makes every group
    index = next(i for i, members in enumerate(groups) if rank in members)
    group, size = handles[index], len(groups[index])
    times: dict[str, float] = {}
    for mib in SIZES_MIB:
        full = torch.ones(mib * 2**20 // 4)
        shard = torch.ones(full.numel() // size)
        calls = {"all_reduce": lambda: dist.all_reduce(full, group=group),
                 "all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
                 "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group)}
        for op in OPS:
            samples = []
            for _ in range(REPEATS):
                dist.barrier()
                start = time.perf_counter()
                calls[op]()
                samples.append(time.perf_counter() - start)
            times[f"{op}/{mib}"] = statistics.median(samples[1:])
    gathered: list[dict[str, float] | None] = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:  # a collective ends when its slowest rank does
        Path(out).write_text(json.dumps({key: max(t[key] for t in gathered if t) for key in times}))
    finish_rank(True)


def timed(groups: list[list[int]]) -> dict[str, float]:
    world = sum(len(members) for members in groups)
    with tempfile.TemporaryDirectory() as folder:
        out = str(Path(folder) / "times.json")
        launch(_worker, world, (world, groups, free_port(), out))
        return json.loads(Path(out).read_text())


def time_sharing(ranks: int, cores: int) -> float:
    """The factor the cost model puts on a collective when `ranks` ranks of one thread share the
    node's `cores` cores."""
    hardware = load_hardware("cpu").model_copy(update={"cpu_cores": cores, "threads_per_device": 1})
    return hardware.oversubscription(ranks)


def main() -> None:
    cores = os.cpu_count() or 1
    pair = timed([[0, 1]])
    layouts = {"two pairs at once (DP x TP)": ([[0, 2], [1, 3]], 2), "one group of 4": ([[0, 1, 2, 3]], 4)}
    shared = time_sharing(4, cores) / time_sharing(2, cores)
    lines = ["| 4 ranks as | collective | MiB | one pair, ms | 4 ranks, ms | priced, ms | measured / priced |",
             "|---|---|---|---|---|---|---|"]
    over_pair = []  # 4 ranks' time over the pair's, the bus factor included
    for name, (groups, size) in layouts.items():
        four = timed(groups)
        for key, seconds in four.items():  # the cost model prices one group's ring, time-shared
            op, mib = key.split("/")
            bus = RING_FACTORS[op](size)[1] / RING_FACTORS[op](2)[1]  # bytes per rank's link, nccl-tests' factors
            priced = pair[key] * bus * shared
            over_pair.append(seconds / priced * shared)
            lines.append(f"| {name} | {op} | {mib} | {pair[key] * 1e3:.1f} | {seconds * 1e3:.1f} | "
                         f"{priced * 1e3:.1f} | {seconds / priced:.2f} |")
            print(lines[-1], flush=True)
    body = "\n".join(lines) + (
        f"\n\n{cores} cores. Each time is the median of {REPEATS - 1} calls after a barrier, the slowest rank's. "
        f"The cost model's time-sharing factor for 4 single-thread ranks here is {shared:.2f} "
        "(`HardwareSpec.oversubscription`), the factor it puts on their compute too. A ratio below 1 means "
        "the cost model prices the collective slow. On their own, 4 ranks' collectives take "
        f"{min(over_pair):.1f}-{max(over_pair):.1f}x the pair's time (the bus factor included), mostly less than "
        "the cores' time-sharing, as a pair does not keep both cores busy. Inside the trainer's DP x TP step "
        "they take longer than priced even so: FSDP2 "
        "allocates its gather and reduce-scatter buffers afresh each step, and a fresh buffer over glibc's "
        "32 MiB mmap ceiling is written at page-fault speed; the first fit that priced them not time-shared at "
        "all left bench/accuracy.py's 4-rank DP x TP row 25% fast.")
    write_section("time_shared_collectives", "Collectives on time-shared cores (this CPU)",
                  "python -m bench.time_shared_collectives", body)


if __name__ == "__main__":
    main()
