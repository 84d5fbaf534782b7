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


@pytest.mark.xfail(strict=True, reason="65% of rows within 15% (goal 90%): the FSDP rows are priced too slow on "
                   "many nodes (half of their data-parallel traffic exposed, where FSDP prefetches it behind the "
                   "compute) and h100-80g prices one H100 node 15-32% faster than llm-foundry measured; fixing "
                   "both in the presets (88%) moved Llama 3 70B's GPU-hours 21% below Meta's, so neither landed")
def test_90_percent_of_rows_are_within_15_percent() -> None:
    errors = [abs(p.error) for p in _priced() if p.error is not None]
    assert sum(e <= THROUGHPUT_BOUND for e in errors) >= SHARE_WITHIN * len(errors)


def test_the_fsdp_engine_reduces_gradients_in_bf16_where_ours_reduces_in_fp32() -> None:
    """llm-foundry's FSDP (mixed precision PURE) and fms-fsdp (bfSixteen) reduce in bf16: of ZeRO-3's
    three collectives per micro-batch (two bf16 gathers, one reduce-scatter of gradients the size of
    the weights), the reduction halves, so the traffic is 3/4 of our FSDP2's (fp32 reductions)."""
    from specs.engine_traits import FSDP_BF16
    from specs.core import Layout
    from planner.cost_model import estimate
    from presets import load_hardware, load_model

    hardware, model = load_hardware("a100-80g"), load_model("llama2-7b")
    layout = Layout(dp=64, zero=3, mbs=2, gas=1, recompute="full", seq=2048)
    ours = estimate(model, hardware, layout, engine="fsdp2").time.dp_comm_s
    theirs = estimate(model, hardware, layout, engine=FSDP_BF16).time.dp_comm_s
    assert theirs / ours == pytest.approx(0.75, rel=0.01)
