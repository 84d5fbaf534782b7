"""Table 1 of Narayanan et al. 2021 against the cost model: its throughput on every row, and its
pipeline terms (bubble, activation and gradient messages per micro-batch and chunk) against a
replay of the programs Megatron-LM runs (tests/megatron_schedule.py)."""

from __future__ import annotations

import pytest

from specs.core import Layout, ModelSpec
from bench.megatron_table1 import predicted_tflops
from megatron_schedule import makespan, messages_sent, replay
from paper_tables import MEGATRON_SEQ_LEN, MEGATRON_TABLE1, MEGATRON_VOCAB
from planner.cost_model import Placement, StageTime, default_split, stage_time, step_seconds
from specs.engine_traits import MEGATRON
from presets import load_hardware
from profiler.model_trace import trace_model


def test_a_tiny_interleaved_schedule_sends_what_a_hand_count_gives() -> None:
    # p=2, v=2: device 0 sends chunk 0's and chunk 1's outputs forward and chunk 1's input gradient
    # back (chunk 0 is the model's first: nothing to send back); device 1 sends chunk 0's output on
    # to device 0's chunk 1 and both chunks' input gradients back (chunk 1 is the model's last)
    assert messages_sent(2, 2, 4) == [3 * 4, 3 * 4]
    # without interleaving: one activation forward, one gradient back, none past the ends
    assert messages_sent(3, 1, 5) == [5, 10, 5]


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 3, 8), (4, 1, 6), (3, 2, 9)])
def test_the_priced_message_count_per_micro_batch_is_the_schedules(p, v, m) -> None:
    # what activation_comm charges each device per micro-batch: 2v boundaries, less the model's ends
    priced = [2 * v - (d == 0) - (d == p - 1) for d in range(p)]
    assert [n / m for n in messages_sent(p, v, m)] == priced


@pytest.mark.parametrize("p,v,m", [(4, 1, 8), (4, 2, 8), (4, 3, 12), (8, 2, 16)])
def test_without_communication_the_replayed_bubble_is_p_minus_1_over_v_slots(p, v, m) -> None:
    forward, backward = 1.0, 3.0  # full recomputation: backward runs the forward again
    assert makespan(p, v, m, forward / v, backward / v, 0.0) == pytest.approx((m + (p - 1) / v) * (forward + backward))


def _stage(compute: float, backward_share: float = 2 / 3) -> StageTime:
    return StageTime(compute_mb=compute, useful_compute_mb=compute, backward_mb=backward_share * compute,
                     tp_comm_mb=0.0, pp_comm_mb=0.0, dp_comm=0.0, dp_hidden_max=0.0, optimizer=0.0, offload=0.0,
                     dp_overlap=0.0)


@pytest.mark.parametrize("pp,gas,last", [(2, 2, 7.0), (2, 4, 1.5), (4, 8, 3.0), (3, 3, 1.2)])
def test_a_pipeline_whose_last_stage_carries_the_head_is_priced_as_its_replayed_schedule(pp, gas, last) -> None:
    """Stages of 1 s per micro-batch but the last (a large vocabulary's head and loss: 7x on the
    accuracy bench's 50k row): the slowest stage's gas slots plus the others' fill and drain, not
    (p - 1) slots of the slowest."""
    times = [_stage(1.0)] * (pp - 1) + [_stage(last)]
    replayed = replay(pp, 1, gas, times)
    assert step_seconds(Layout(pp=pp, gas=gas), times) == pytest.approx(replayed, rel=1e-6)
    assert (gas + pp - 1) * last > 1.05 * replayed  # the old price


@pytest.mark.parametrize("pp,gas,last", [(2, 4, 0.5), (3, 3, 0.5), (4, 4, 0.3), (4, 8, 0.8)])
def test_a_lighter_last_stage_is_priced_no_faster_than_its_replayed_schedule(pp, gas, last) -> None:
    """With the slowest stage first, the stages after it partly hide behind its warm-up forwards;
    the price leaves them exposed: never optimistic, and within 10% here."""
    times = [_stage(1.0)] * (pp - 1) + [_stage(last)]
    replayed = replay(pp, 1, gas, times)
    assert replayed <= step_seconds(Layout(pp=pp, gas=gas), times) <= 1.10 * replayed


@pytest.mark.parametrize("row", [r for r in MEGATRON_TABLE1 if r["pp"] > 1], ids=lambda r: f"{r['params_billion']}B")
def test_the_priced_pipeline_of_table_1_equals_megatrons_replayed_schedule(row) -> None:
    """Bubble, head/embedding imbalance and every blocking exchange, on the paper's own layouts."""
    hardware = load_hardware("a100-80g")
    config = {"model_type": "gpt2", "n_embd": row["hidden"], "n_layer": row["layers"], "n_head": row["heads"],
              "n_positions": MEGATRON_SEQ_LEN, "vocab_size": MEGATRON_VOCAB, "activation_function": "gelu"}
    gas = row["batch_size"] // (row["dp"] * row["micro_batch"])
    layout = Layout(dp=row["dp"], tp=row["tp"], pp=row["pp"], vpp=row["model_chunks"], mbs=row["micro_batch"],
                    gas=gas, recompute="full", dtype="fp16", seq=MEGATRON_SEQ_LEN)
    trace = trace_model(ModelSpec(name="gpt", hf_config=config), layout.seq, dtype="fp16", attention="eager",
                        device_type="cuda")
    placement = Placement.of(layout, hardware.devices_per_node)
    split, recomputed = default_split(trace, layout)
    times = [stage_time(trace, layout, hardware, placement, i, n, r, MEGATRON)
             for i, (n, r) in enumerate(zip(split, recomputed))]
    replayed = replay(layout.pp, layout.vpp, gas, times)
    priced = (step_seconds(layout, times) - max(t.dp_exposed for t in times)
              - max(t.optimizer + t.offload for t in times))
    assert priced == pytest.approx(replayed, rel=0.01)


@pytest.mark.parametrize("row", MEGATRON_TABLE1, ids=lambda r: f"{r['params_billion']}B")
def test_the_predicted_throughput_of_every_table_1_row_is_within_10_percent_of_the_published(row) -> None:
    """The paper's TFLOP/s per GPU (its equation 3 over the measured iteration time), priced with the
    layout, DDP and kernels the authors' run_table_1.sh ran; no factor fitted to the table."""
    _, predicted = predicted_tflops(row, load_hardware("a100-80g"))
    assert predicted == pytest.approx(row["tflops_per_gpu"], rel=0.10)


# Megatron-LM's README, "Distributed Optimizer": theoretical bytes per parameter (d: data-parallel size),
# without and with the distributed optimizer (ZeRO-1 here). bf16 accumulates and all-reduces its gradients
# in fp32 by default; fp16 keeps fp16 gradients and the optimizer takes an fp32 copy of them.
MEGATRON_BYTES_PER_PARAM = {"fp16": (20, lambda d: 4 + 16 / d), "bf16": (18, lambda d: 6 + 12 / d),
                            "fp32": (16, lambda d: 8 + 8 / d)}


@pytest.mark.parametrize("dtype", sorted(MEGATRON_BYTES_PER_PARAM))
@pytest.mark.parametrize("dp", [1, 8, 64])
def test_megatrons_model_states_are_its_readmes_bytes_per_parameter(dtype, dp) -> None:
    from planner.comm_time import gradient_comm_bytes
    from planner.memory import model_state_bytes

    plain, distributed = MEGATRON_BYTES_PER_PARAM[dtype]
    for zero, expected in ((0, plain), (1, distributed(dp))):
        if zero and dp == 1:
            continue  # the distributed optimizer shards across replicas
        layout = Layout(dp=dp, zero=zero, mbs=1, gas=1, dtype=dtype, seq=2048)
        states = model_state_bytes(1e9, 1e9, layout, engine=MEGATRON)
        assert (states.weights + states.gradients + states.optimizer) / 1e9 == pytest.approx(expected)
    # the gradients are all-reduced as they are kept: fp32 under bf16, in the parameters' dtype otherwise
    reduced = gradient_comm_bytes(Layout(dp=dp, mbs=1, gas=1, dtype=dtype, seq=2048), MEGATRON, 1e9) / 1e9
    assert reduced == {"fp16": 2, "bf16": 4, "fp32": 4}[dtype]
