"""The planner's choice equals the best layout found by brute-force enumeration of the same cost
model (every shape, every layer-to-stage split, every per-stage recomputation count)."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specs.errors import UsageError
from specs.core import HardwareSpec, Layout, ModelSpec
from specs.capabilities import runnable_problem
from planner.cost_model import estimate_from_trace, model_shape
from planner.search import PlanRequest, SearchSpace, search
from profiler.model_trace import trace_model

TINY = ModelSpec(name="tiny-llama", hf_config={
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256})
SEQ = 128


def hardware(memory_mib: float, host_mib: float = 1e6, devices_per_node: int = 4) -> HardwareSpec:
    return HardwareSpec(
        name="test-gpu", device_type="cuda", memory_gib=memory_mib / 1024, reserved_gib=0,
        host_memory_gib=host_mib / 1024,
        peak_tflops={"bf16": 1.0, "fp16": 1.0, "fp32": 0.25}, memory_bandwidth_gbs=100,
        intra_node_bandwidth_gbs=50, inter_node_bandwidth_gbs=10, devices_per_node=devices_per_node,
        host_to_device_gbs=2, cpu_adam_params_per_s=5e7,
    )


def compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def brute_force(trace, hw: HardwareSpec, devices: int, batch: int, min_fraction: float, margin: float,
                runnable_only: bool = False):
    """Every layout of the space with every split and recompute count, scored by the cost model;
    `runnable_only`: only those `advisor train` runs (specs/capabilities.py)."""
    capacity = hw.usable_bytes * (1 - margin)
    best = None
    layers = trace.num_layers
    for tp, pp in itertools.product((1, 2, 4), (1, 2, 4)):
        if devices % (tp * pp) or pp > layers:
            continue
        dp = devices // (tp * pp)
        if batch % dp:
            continue
        for mbs in (m for m in range(1, batch // dp + 1) if (batch // dp) % m == 0):
            gas = batch // (dp * mbs)
            for vpp, sp, zero, offload, mode in itertools.product(
                    (1, 2), (False, True), (0, 1, 2, 3), ("none", "optimizer", "optimizer+params"),
                    ("none", "selective", "full")):
                try:
                    base = Layout(dp=dp, tp=tp, pp=pp, vpp=vpp, sp=sp, zero=zero, offload=offload, mbs=mbs,
                                  gas=gas, recompute=mode, dtype="bf16", seq=SEQ)
                except ValueError:
                    continue
                if zero and dp == 1 and (zero, offload) != (2, "optimizer"):
                    continue  # without replicas ZeRO only serves ZeRO-Offload (DeepSpeed's 1-GPU mode)
                for split in compositions(layers, pp):
                    ranges = [range(n + 1) for n in split] if mode != "none" else [[0] * 1 for _ in split]
                    for recomputed in itertools.product(*ranges):
                        layout = base.model_copy(update={"stage_layers": split, "recompute_layers": list(recomputed)
                                                         if mode != "none" else None})
                        if runnable_only and runnable_problem(layout, model_shape(trace), hw.device_type):
                            continue
                        try:
                            est = estimate_from_trace(trace, layout, hw)
                        except UsageError:
                            continue
                        if est.memory.peak > capacity or not est.memory.host_fits or est.compute_fraction < min_fraction:
                            continue
                        if best is None or est.time.step_s < best[0] - 1e-12:
                            best = (est.time.step_s, layout)
    return best


@pytest.fixture(scope="module")
def tiny_trace():
    return trace_model(TINY, SEQ, "bf16", attention="eager", device_type="cuda")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    devices=st.sampled_from([1, 2, 4]),
    batch=st.sampled_from([1, 2, 4, 8]),
    memory_share=st.floats(0.05, 1.0),
    min_fraction=st.sampled_from([0.0, 0.5]),
    host_share=st.sampled_from([0.2, 1.0, 100.0]),
    runnable_only=st.booleans(),
)
def test_ilp_choice_equals_brute_force_optimum(tiny_trace, devices, batch, memory_share, min_fraction,
                                               host_share, runnable_only) -> None:
    # capacity relative to the simplest layout's peak, so memory binds in some draws and not others
    reference = estimate_from_trace(tiny_trace, Layout(dp=1, mbs=batch, gas=1, dtype="bf16", seq=SEQ), hardware(1e6))
    hw = hardware(reference.memory.peak * memory_share / 2**20, reference.memory.peak * host_share / 2**20)
    req = PlanRequest(model=TINY, hardware=hw, devices=devices, seq=SEQ, global_batch=batch, dtype="bf16",
                      space=SearchSpace(max_vpp=2, tp_degrees=(1, 2, 4), pp_degrees=(1, 2, 4),
                                        runnable_only=runnable_only),
                      min_compute_fraction=min_fraction, memory_margin=0.0, top_k=1, attention="eager")
    found = search(req, "full", min_fraction, trace=tiny_trace)
    truth = brute_force(tiny_trace, hw, devices, batch, min_fraction, 0.0, runnable_only)
    if truth is None:
        assert not found.solutions
        return
    assert found.solutions, f"brute force found {truth[1].short()}"
    assert found.solutions[0].step_s == pytest.approx(truth[0], rel=1e-9)
