"""The published-runs bench (bench/published_bench.py) as a test, pricing only: every row of
bench/published_runs.py priced with the engine that produced it (issue 29)."""

from __future__ import annotations

import functools

import pytest

from bench.published_bench import MEGATRON_2021_BOUND, SHARE_WITHIN, THROUGHPUT_BOUND, Priced, price
from bench.published_runs import ROWS


@functools.lru_cache(maxsize=1)
def _priced() -> tuple[Priced, ...]:
    return tuple(price(row) for row in ROWS)


def test_the_bench_prices_at_least_25_rows_from_5_sources() -> None:
    priced = [p for p in _priced() if p.error is not None]
    assert len(priced) >= 25
    assert len({p.row.source for p in priced}) >= 5
    assert all(p.skipped for p in _priced() if p.error is None)  # every row left out says why


def test_every_megatron_2021_table_1_row_is_within_10_percent_under_the_megatron_engine() -> None:
    rows = [p for p in _priced() if p.row.source == "narayanan2021"]
    assert len(rows) == 10
    worst = max(abs(p.error) for p in rows)
    assert worst <= MEGATRON_2021_BOUND, [f"{p.row.name} {p.error:+.1%}" for p in rows]


def test_every_megatron_lm_row_is_within_15_percent() -> None:
    rows = [p for p in _priced() if p.row.engine.startswith("megatron") and p.error is not None]
    assert len(rows) >= 20
    assert all(abs(p.error) <= THROUGHPUT_BOUND for p in rows), [f"{p.row.name} {p.error:+.1%}" for p in rows]


@pytest.mark.xfail(strict=True, reason="57% of rows within 15% (goal 90%): the FSDP rows (llm-foundry, fms-fsdp, "
                   "torchtitan) are priced as our FSDP2 engine runs them (fp32 gradient reduction, half of the "
                   "data-parallel traffic exposed): too slow on many nodes; and h100-80g prices one H100 node "
                   "15-32% faster than llm-foundry measured")
def test_90_percent_of_rows_are_within_15_percent() -> None:
    errors = [abs(p.error) for p in _priced() if p.error is not None]
    assert sum(e <= THROUGHPUT_BOUND for e in errors) >= SHARE_WITHIN * len(errors)
