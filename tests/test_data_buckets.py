"""Bucket edges minimise padding: the dynamic programme equals a brute-force search over every set
of edges, and the padding it reports equals micro-batches built one by one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from trainer.data.buckets import choose_edges, cost_of_edges, one_bucket_edges, round_up


def materialised_slots(lengths: np.ndarray, counts: np.ndarray, edges: list[int], budget: int) -> tuple[int, int]:
    """Build the micro-batches sample by sample: each bucket fills batches of budget // edge samples
    (at least one), every sample padded to the edge, the last batch padded with empty rows."""
    samples = np.repeat(lengths, counts)
    tokens = slots = 0
    lower = 0
    for edge in edges:
        inside = [int(n) for n in samples if lower < n <= edge]
        per_batch = max(1, budget // edge)
        batches = [inside[i:i + per_batch] for i in range(0, len(inside), per_batch)]
        tokens += sum(sum(b) for b in batches)
        slots += len(batches) * per_batch * edge
        lower = edge
    return tokens, slots


@pytest.mark.parametrize("seed", range(40))
def test_dynamic_programme_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    max_len = 128
    lengths = np.sort(rng.choice(np.arange(1, max_len + 1), size=int(rng.integers(1, 9)), replace=False))
    counts = rng.integers(1, 40, size=len(lengths))
    budget = int(rng.choice([16, 64, 200, 512]))
    max_buckets = int(rng.integers(1, 5))
    pad = int(rng.choice([1, 8]))
    edges = choose_edges(lengths, counts, budget, max_buckets, pad, max_len)
    candidates = np.unique(round_up(lengths, pad, max_len))
    best = min(
        (materialised_slots(lengths, counts, [*subset, int(candidates[-1])], budget)[1], k + 1)
        for k in range(max_buckets) for subset in itertools.combinations(candidates[:-1].tolist(), k)
    )
    assert (materialised_slots(lengths, counts, edges, budget)[1], len(edges)) == best
    assert edges == sorted(edges) and edges[-1] == candidates[-1] and all(e % pad == 0 or e == max_len for e in edges)


def test_reported_padding_equals_materialised_micro_batches() -> None:
    rng = np.random.default_rng(1)
    raw = np.minimum(np.round(rng.lognormal(4.0, 0.9, size=5000)).astype(int) + 1, 1024)
    lengths, counts = np.unique(raw, return_counts=True)
    for edges in (choose_edges(lengths, counts, 8192, 8, 8, 1024), one_bucket_edges(lengths, 8, 1024)):
        cost = cost_of_edges(lengths, counts, edges, 8192)
        tokens, slots = materialised_slots(lengths, counts, edges, 8192)
        assert (cost.tokens, cost.slots) == (tokens, slots) == (int(raw.sum()), slots)
    bucketed = cost_of_edges(lengths, counts, choose_edges(lengths, counts, 8192, 8, 8, 1024), 8192)
    single = cost_of_edges(lengths, counts, one_bucket_edges(lengths, 8, 1024), 8192)
    assert bucketed.padding_fraction < single.padding_fraction / 2  # long tail: buckets cut most padding


def test_more_buckets_never_pad_more() -> None:
    rng = np.random.default_rng(2)
    lengths, counts = np.unique(rng.integers(1, 300, size=2000), return_counts=True)
    slots = [cost_of_edges(lengths, counts, choose_edges(lengths, counts, 1024, k, 8, 512), 1024).slots
             for k in range(1, 9)]
    assert slots == sorted(slots, reverse=True)
