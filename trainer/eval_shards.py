"""The stage-end evaluation split over the data-parallel replicas, as torchtitan's validator splits
its data: each replica scores a contiguous share of the held-out rows and the sums are all-reduced,
so no rank repeats what another scored (before, every rank scored every row: on 2 CPU cores that
was half of a short run's evaluation time, on 64 GPUs 63 copies of it).

Shares are cut at micro-batch boundaries, so every micro-batch holds the rows it held unsplit and
only the order of the float64 sums changes. Engines whose forward is a collective (ZeRO-3, FSDP2,
tensor and pipeline parallelism) need every rank to run as many forwards: a replica whose share is
shorter runs padding forwards, whose results it drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class EvalShard:
    rank: int = 0  # this rank's data-parallel replica (tensor and pipeline ranks of one replica share it)
    replicas: int = 1  # the layout's dp

    def _share(self, rows: int, unit: int) -> int:
        """Rows of a full share: rows / replicas, rounded up to whole units."""
        per_replica = -(-rows // self.replicas)
        return -(-per_replica // unit) * unit

    def bounds(self, rows: int, unit: int) -> tuple[int, int]:
        """This replica's rows [lo, hi) of `rows`: contiguous shares of whole `unit`s (micro-batches)."""
        share = self._share(rows, unit)
        return min(self.rank * share, rows), min((self.rank + 1) * share, rows)

    def slots(self, rows: int, unit: int) -> int:
        """Forwards every replica runs over `rows` in micro-batches of `unit`: the first (longest) share's."""
        return -(-min(self._share(rows, unit), rows) // unit)

    def total(self, values: Sequence[float], device: torch.device) -> list[float]:
        """`values` summed over the replicas: an all-reduce over every rank, divided by the ranks that
        hold each replica's copy (tp x pp). Unsplit: `values` as they are."""
        if self.replicas == 1 or not dist.is_initialized():
            return [float(v) for v in values]
        summed = torch.tensor(list(values), dtype=torch.float64, device=device)
        dist.all_reduce(summed)
        copies = dist.get_world_size() // self.replicas
        return [v / copies for v in summed.tolist()]
