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


def test_the_bench_prices_table_1_with_each_rows_own_ddp_as_the_table_1_test_does() -> None:
    """Two paths price Table 1: this bench (rows of bench/published_runs.py) and bench/megatron_table1.py
    (tests/paper_tables.py, held by tests/test_megatron_schedule.py). They must give the same step.
    The bench once read the DDP from the row's notes by the word "local", which every row's note
    explains, so the four PyTorch-DDP rows (1.7B to 18.4B) were priced with nothing hidden; each row
    now carries its DDP."""
    from bench.megatron_table1 import predicted_tflops
    from presets import load_hardware
    from paper_tables import MEGATRON_SEQ_LEN, MEGATRON_TABLE1

    bench_rows = {p.row.name: p for p in _priced() if p.row.source == "narayanan2021"}
    assert {r["ddp"] for r in MEGATRON_TABLE1} == {"torch", "local"}
    for row in MEGATRON_TABLE1:
        est, _ = predicted_tflops(row, load_hardware("a100-80g"))
        tokens_s = row["batch_size"] * MEGATRON_SEQ_LEN / est.time.step_s / row["gpus"]
        priced = bench_rows[f"gpt-{row['params_billion']}b"]
        assert priced.predicted_tokens_s == pytest.approx(tokens_s, rel=1e-9), row["params_billion"]


def test_every_megatron_lm_row_is_within_15_percent() -> None:
    rows = [p for p in _priced() if p.row.engine.startswith("megatron") and p.error is not None]
    assert len(rows) >= 20
    assert all(abs(p.error) <= THROUGHPUT_BOUND for p in rows), [f"{p.row.name} {p.error:+.1%}" for p in rows]


@pytest.mark.xfail(strict=True, reason="78% of rows within 15% (goal 90%): torchtitan's six 64-A100 rows are "
                   "priced 27-58% slow (a collective across nodes is priced over one network adapter, where NCCL "
                   "runs a group with k members per node over k) and six llm-foundry H100 rows 18-32% fast, which "
                   "that slow network had hidden; pricing the adapters as NCCL uses them moves fms-fsdp's H100 rows "
                   "out too (docs/benchmarks.md, published_bench, 'found, not landed')")
def test_90_percent_of_rows_are_within_15_percent() -> None:
    errors = [abs(p.error) for p in _priced() if p.error is not None]
    assert sum(e <= THROUGHPUT_BOUND for e in errors) >= SHARE_WITHIN * len(errors)


def test_every_fms_fsdp_row_is_within_15_percent() -> None:
    """IBM's runs state their overlap of computation and communication (EngineTraits.prefetches_units)."""
    rows = [p for p in _priced() if p.row.source == "fmsfsdp"]
    assert len(rows) == 6
    assert all(abs(p.error) <= THROUGHPUT_BOUND for p in rows), [f"{p.row.name} {p.error:+.1%}" for p in rows]


def test_every_multi_node_llm_foundry_a100_row_is_within_15_percent() -> None:
    rows = [p for p in _priced() if p.row.source == "llmfoundry" and p.row.gpu.startswith("a100") and p.row.gpus > 8]
    assert len(rows) == 6
    assert all(abs(p.error) <= THROUGHPUT_BOUND for p in rows), [f"{p.row.name} {p.error:+.1%}" for p in rows]


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


def _dp_priced(hardware_name: str, layout_text: dict, engine: str):
    from specs.core import Layout
    from planner.cost_model import estimate
    from presets import load_hardware, load_model

    layout = Layout(**layout_text)
    return estimate(load_model("llama2-7b"), load_hardware(hardware_name), layout, engine=engine), layout


@pytest.mark.parametrize("seq, mbs", [(4096, 2), (256, 1)])  # compute-bound, then communication-bound
def test_published_fsdp_hides_its_collectives_but_one_unit_per_micro_batch(seq: int, mbs: int) -> None:
    """FSDP's prefetch (EngineTraits.prefetches_units): each unit's all-gather runs while the unit before
    it computes, so of a step's data-parallel traffic only the first of its 33 units (32 layers and
    the root) waits, unless the traffic outlasts the compute; our FSDP2 keeps the preset's half."""
    from specs.engine_traits import FSDP_BF16

    spec = dict(dp=64, zero=3, mbs=mbs, gas=1, recompute="full", seq=seq)
    theirs, layout = _dp_priced("a100-80g", spec, FSDP_BF16)
    comm, compute = theirs.time.dp_comm_s, theirs.time.compute_s
    assert theirs.time.comm_exposed_s == pytest.approx(max(comm / 33, comm - compute))
    assert (comm < compute) == (seq == 4096)
    ours, _ = _dp_priced("a100-80g", spec, "fsdp2")
    assert ours.time.comm_exposed_s == pytest.approx(max(ours.time.dp_comm_s / 2, ours.time.dp_comm_s
                                                         - ours.time.compute_s))


def test_prefetch_hides_nothing_where_collectives_share_the_cores() -> None:
    """The CPU preset's comm_overlap 0 (gloo runs on the cores the compute runs on): nothing hides."""
    from specs.engine_traits import FSDP_BF16

    est, _ = _dp_priced("cpu", dict(dp=2, zero=3, mbs=1, gas=1, seq=128), FSDP_BF16)
    assert est.time.dp_comm_s > 0
    assert est.time.comm_exposed_s == pytest.approx(est.time.dp_comm_s)


def test_h100_prices_flash_attention_at_35_percent_of_peak() -> None:
    """FlashAttention-2 reaches 35% of an H100's dense peak (Shah et al. 2024, FlashAttention-3,
    abstract): the attention FLOPs of a micro-batch (4 s^2 h per layer forward, twice that backward)
    cost 1/0.35 of the peak's time, where the preset without its curve prices them at the GEMMs' 0.7."""
    from specs.core import Layout
    from planner.cost_model import estimate
    from presets import load_hardware, load_model

    h100, model = load_hardware("h100-80g"), load_model("llama2-7b")
    layout = Layout(dp=8, zero=3, mbs=1, gas=1, recompute="none", seq=4096)
    with_curve = estimate(model, h100, layout, engine="fsdp2").time.compute_s
    without = estimate(model, h100.model_copy(update={"attention": None}), layout, engine="fsdp2").time.compute_s
    flops = 3 * 32 * 4 * 4096**2 * 4096  # layers x (forward + backward) x 4 s^2 h
    peak = h100.peak_flops("bf16")
    assert with_curve - without == pytest.approx(flops / (0.35 * peak) - flops / (0.7 * peak), rel=1e-6)


def test_megatron_cores_h100_table_is_transcribed_as_its_sizes_and_mfu_say() -> None:
    """Megatron-LM's README table (Megatron-Core r0.8.0): each row's parameters, 12 L h^2 + 2 V h (a 4h
    MLP, untied embeddings), are its label within 3% (the labels round either way: 1.74 B is "1.7B",
    31.5 B "32B"), and its TFLOP/s over the H100's 989.4 dense bf16 is its MFU within 0.6 points (whole
    percents, over a peak its rows put at 985-989 TFLOP/s); its rows are listed, not priced, until an
    engine prices Megatron-Core's overlaps."""
    rows = [p for p in _priced() if p.row.source == "megatroncore2024"]
    assert len(rows) == 9 and all(p.error is None and p.skipped for p in rows)
    for p in rows:
        r = p.row
        params = 12 * r.layers * r.hidden**2 + 2 * r.vocab * r.hidden
        assert params / 1e9 == pytest.approx(float(r.name.removeprefix("gpt-").removesuffix("b")), rel=0.03)
        assert abs(100 * r.tflops_per_gpu / 989.4 - 100 * r.mfu) <= 0.6
        assert p.published_tokens_s == pytest.approx(r.gbs * r.seq / r.gpus / (
            12 * r.gbs * r.seq * r.layers * r.hidden**2 * (6 + r.seq / r.hidden + r.vocab / (2 * r.layers * r.hidden))
            / (r.tflops_per_gpu * 1e12 * r.gpus)))
