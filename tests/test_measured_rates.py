"""Rates a profile measures by size: the LM head's GEMMs by the vocabulary a device holds, the host's
AdamW by the tensor it updates. The cost model prices each at its measured rate, computed here
from the trace's own FLOPs and parameter counts."""

import pytest

from specs.core import Layout, ModelSpec, SizeCurve
from planner.compute_time import loss_recompute_flops
from planner.cost_model import estimate_from_trace
from planner.optimizer_step import optimizer_tensors
from presets import load_hardware
from profiler.hardware_bench import bench_cpu_adam_by_size, bench_head_gemms, linear_gemms
from profiler.model_trace import trace_model

WIDE_VOCAB = ModelSpec(name="wide-vocab", hf_config={
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 344,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32000,
    "max_position_embeddings": 512, "tie_word_embeddings": False})


def test_a_size_curve_reads_linearly_in_log_size_and_flat_beyond_its_ends() -> None:
    curve = SizeCurve(sizes=[1024, 4096, 65536], relative=[1.0, 0.8, 0.4])
    assert curve.at(16) == 1.0 and curve.at(1e9) == 0.4
    assert curve.at(2048) == pytest.approx(0.9)  # half way in log2 between 1024 and 4096
    assert curve.at(16384) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        SizeCurve(sizes=[4096, 1024], relative=[1.0, 1.0])


def test_the_heads_measured_rate_prices_exactly_its_gemms_at_that_rate() -> None:
    """A head measured at half the dense rate costs its FLOPs once more at the dense rate: the
    forward (twice under the chunked loss), the input and the weight gradients of every sequence."""
    layout = Layout(mbs=2, seq=256, dtype="fp32")
    trace = trace_model(WIDE_VOCAB, layout.seq, "fp32", device_type="cpu")
    cpu = load_hardware("cpu").model_copy(update={"devices_per_node": 1})
    half = cpu.model_copy(update={"head_gemm": SizeCurve(sizes=[1000.0], relative=[0.5])})
    dense, slow = (estimate_from_trace(trace, layout, hw) for hw in (cpu, half))
    head_flops = layout.mbs * (trace.head.fwd_flops + loss_recompute_flops(trace, layout, "plain")
                               + trace.head.bwd_flops)
    rate = cpu.peak_flops("fp32") * cpu.efficiency.gemm  # at 256 tokens the tokens slope does not apply
    assert slow.time.step_s - dense.time.step_s == pytest.approx(head_flops / rate, rel=1e-6)


@pytest.mark.parametrize("layout,engine", [
    (Layout(mbs=1, seq=128, dtype="fp32"), "plain"),
    (Layout(dp=2, zero=2, mbs=1, seq=128, dtype="fp32"), "fsdp2"),
    (Layout(dp=2, zero=1, mbs=1, seq=128, dtype="fp32"), "deepspeed"),
    (Layout(mbs=1, seq=128, dtype="fp32", method="lora"), "plain"),
])
def test_the_optimizer_updates_each_trainable_parameter_once_at_its_tensors_rate(layout, engine) -> None:
    trace = trace_model(WIDE_VOCAB, layout.seq, "fp32", layout.method, device_type="cpu")
    tensors = optimizer_tensors(trace, layout, engine, trace.num_layers, 0)
    updated = trace.trainable_params / (layout.dp if layout.zero else 1)
    assert sum(count for count, _ in tensors) == pytest.approx(updated, rel=1e-9)
    cpu = load_hardware("cpu").model_copy(update={"devices_per_node": 2})
    # tensors of up to 2^20 parameters update at the base rate, from 4M on at a quarter of it
    curve = SizeCurve(sizes=[2.0**20, 4e6], relative=[1.0, 0.25])
    sized = cpu.model_copy(update={"cpu_adam_by_tensor": curve})
    base, slow = (estimate_from_trace(trace, layout, hw, engine).time.optimizer_s for hw in (cpu, sized))
    extra = sum(count * (1 / curve.at(size) - 1) for count, size in tensors) / cpu.cpu_adam_params_per_s
    assert slow - base == pytest.approx(extra, rel=1e-6)
    if engine == "plain" and layout.method == "full":  # the 32000 x 128 tables, 4.1M parameters each, at a quarter
        big = 2 * 32000 * 128 + 128  # and the final norm, which the trace counts with the head
        assert [(count, size) for count, size in tensors if size >= 4e6] == [(big, 32000 * 128)]
        assert slow - base == pytest.approx(3 * big / cpu.cpu_adam_params_per_s, rel=1e-6)


def test_the_profile_measures_a_wide_head_and_big_tensors_against_its_base_rates() -> None:
    """The benches return rates relative to their base: a "head" as narrow as the dense shapes it is
    compared with reads 1, within the benchmark's noise; AdamW handed its own rate reads 1 too."""
    import torch

    cpu = torch.device("cpu")
    same = bench_head_gemms(64, 64, [64], "fp32", cpu, 0.4, dense=linear_gemms(64, 64, 64))
    # within 2x either way: CI's shared machine read 1.54 once. A raw rate (TFLOP/s, or parameters
    # per second for AdamW) instead of a ratio would be off by orders of magnitude.
    assert 0.5 < same["relative"][0] < 2.0, same
    adam = bench_cpu_adam_by_size([1 << 12], 0.2, base_params_per_s=1.0)["relative"][0]
    assert 0.5 < bench_cpu_adam_by_size([1 << 12], 0.2, base_params_per_s=adam)["relative"][0] < 2.0


@pytest.mark.parametrize("recompute,passes", [("none", 3), ("selective", 3), ("full", 4)])
def test_the_attention_kernels_measured_rate_prices_exactly_its_counted_flops(recompute, passes) -> None:
    """Attention measured at a quarter of the dense rate costs its counted FLOPs (4 s^2 heads
    head_dim per layer forward, twice that backward, once more under full recomputation) three
    times over at the dense rate."""
    layout = Layout(mbs=2, seq=256, dtype="fp32", recompute=recompute)
    trace = trace_model(WIDE_VOCAB, layout.seq, "fp32", device_type="cpu")
    cpu = load_hardware("cpu").model_copy(update={"devices_per_node": 1})
    slow = cpu.model_copy(update={"attention": SizeCurve(sizes=[256.0], relative=[0.25])})
    dense, quarter = (estimate_from_trace(trace, layout, hw) for hw in (cpu, slow))
    flops = layout.mbs * passes * trace.num_layers * 4 * 256 * 256 * trace.num_heads * trace.head_dim
    rate = cpu.peak_flops("fp32") * cpu.efficiency.gemm
    assert quarter.time.step_s - dense.time.step_s == pytest.approx(3 * flops / rate, rel=1e-6)


def test_the_gemm_slope_over_tokens_holds_only_where_calibration_measured_it() -> None:
    """Fitted over 256-2048 tokens per micro-batch (mbs 1 to 8 at seq 256), the slope is not
    carried beyond them: 4096 and 8192 tokens are priced as 2048, 128 as 256."""
    from planner.compute_time import gemm_tokens_factor

    cpu = load_hardware("cpu")
    cpu = cpu.model_copy(update={"efficiency": cpu.efficiency.model_copy(update={"gemm_tokens_slope": -0.1})})
    at = {tokens: gemm_tokens_factor(Layout(mbs=tokens // 128, seq=128), cpu) for tokens in (128, 256, 1024, 2048,
                                                                                               4096, 8192)}
    assert at[256] == at[128] == 1.0
    assert at[1024] == pytest.approx(0.8) and at[2048] == at[4096] == at[8192] == pytest.approx(0.7)
