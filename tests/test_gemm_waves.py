"""Tile and wave quantization of GEMMs (planner.compute_time.wave_efficiency) against hand counts of
256x128 tiles over the A100's 108 SMs (the H100's 132), and the Megatron-2021 engine's element-wise traffic."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from specs.core import Layout, ModelSpec
from conftest import gpt_config
from planner import megatron2021
from planner.compute_time import wave_efficiency
from planner.cost_model import Placement, stage_time
from specs.engine_traits import MEGATRON
from presets import load_hardware
from profiler.model_trace import trace_model

A100 = load_hardware("a100-80g")


def test_a_gemm_takes_whole_waves_of_tiles() -> None:
    # 4096 x 3840 output (76B's QKV at TP 8, mbs 2): 16 x 30 tiles of 256x128 = 480 = 4.44 waves of 108 -> 5
    assert wave_efficiency(4096, 3840, A100) == pytest.approx(480 / 540)
    # 2 waves exactly: nothing lost (216 tiles = 8 x 27 of 256x128, 2048 x 3456)
    assert wave_efficiency(2048, 3456, A100) == pytest.approx(1.0)
    # a padded edge tile: 300 rows need 2 tiles of 256 (or 3 of 128), all in one wave of 108
    assert wave_efficiency(300, 128, A100) == pytest.approx(300 * 128 / (256 * 128) / 108)
    # the kernel takes the better orientation: 128 x 2560 is 10 tiles of 128x256, not 20 of 256x128 padded
    assert wave_efficiency(128, 2560, A100) == pytest.approx(10 / 108)


def test_an_h100_wave_is_its_132_sms_of_256x128_tiles() -> None:
    """The H100 SXM5 whitepaper's 132 SMs: a wave is 132 tiles there, not the A100's 108."""
    h100 = load_hardware("h100-80g")
    assert (h100.sm_count, h100.gemm_tile) == (132, (256, 128))
    # mpt-7b's output projection at mbs 6 (12288 tokens x 4096): 48 x 32 = 1536 tiles = 11.6 waves -> 12
    assert wave_efficiency(12288, 4096, h100) == pytest.approx(1536 / (12 * 132))
    # 264 tiles (8 x 33 of 256x128: 2048 x 4224) are 2 waves exactly on H100, 2.4 -> 3 on A100
    assert wave_efficiency(2048, 4224, h100) == pytest.approx(1.0)
    assert wave_efficiency(2048, 4224, A100) == pytest.approx(264 / 324)


def test_cpus_and_measured_profiles_have_no_waves() -> None:
    assert wave_efficiency(300, 128, load_hardware("cpu")) == 1.0
    assert wave_efficiency(300, 128, A100.model_copy(update={"sm_count": None, "gemm_tile": None})) == 1.0
    with pytest.raises(ValidationError, match="sm_count and gemm_tile go together"):
        A100.model_validate({**A100.model_dump(), "gemm_tile": None})


def test_one_megatron_layer_loses_what_a_hand_list_of_its_twelve_gemms_gives() -> None:
    """76.1B of Table 1 (h 10240, TP 8, mbs 2, full recomputation): every linear GEMM of one layer,
    its output shape, FLOPs and useful share written out by hand (tiles / 108-tile wave slots)."""
    T, h = 4096, 10240
    fwd = [(T, 3840, h, 480 / 540), (T, h, 1280, 1280 / 1296), (T, 5120, h, 640 / 648), (T, h, 5120, 1280 / 1296)]
    dgrad = [(T, h, 3840, 1280 / 1296), (T, 1280, h, 160 / 216), (T, h, 5120, 1280 / 1296), (T, 5120, h, 640 / 648)]
    wgrad = [(3840, h, T, 1200 / 1296), (h, 1280, T, 400 / 432), (5120, h, T, 1600 / 1620), (h, 5120, T, 1600 / 1620)]
    runs = [(fwd, 2), (dgrad, 1), (wgrad, 1)]  # the recomputed forward runs the forward GEMMs again
    lost_flops = sum(n * 2 * m * c * k * (1 / useful - 1) for gemms, n in runs for m, c, k, useful in gemms)
    rate = A100.peak_flops("fp16") * A100.efficiency.gemm

    layout = Layout(dp=32, tp=8, pp=4, vpp=3, mbs=2, gas=28, recompute="full", dtype="fp16", seq=2048)
    trace = trace_model(ModelSpec(name="gpt-76b", hf_config=gpt_config(h, 60, 80)), 2048, dtype="fp16",
                        attention="eager", device_type="cuda")
    placement = Placement.of(layout, A100.devices_per_node)
    no_waves = A100.model_copy(update={"sm_count": None, "gemm_tile": None})
    with_waves, without = (stage_time(trace, layout, hw, placement, 1, 1, 1, MEGATRON) for hw in (A100, no_waves))
    assert with_waves.compute_mb - without.compute_mb == pytest.approx(lost_flops / rate, rel=1e-9)


@pytest.mark.parametrize("attention", ["eager", "flash"])
@pytest.mark.parametrize("tp,hidden,heads", [(1, 2304, 24), (8, 10240, 80)])
def test_megatron_layer_traffic_is_the_closed_form_the_benchmark_note_quotes(tp, hidden, heads, attention) -> None:
    # bench/megatron_table1.py: 90 + 118/t + 29 as/(ht) bytes per b s h element, forward twice (recomputed).
    # Under a flash kernel (FlashAttention, Dao et al. 2022; Transformer Engine's fused attention in today's
    # Megatron-LM) the softmax and its dropout stay on chip: no score term, so the traffic per token no longer
    # grows with the sequence
    layout = Layout(dp=1, tp=tp, mbs=2, recompute="full", dtype="fp16", seq=2048)
    trace = trace_model(ModelSpec(name="gpt", hf_config=gpt_config(hidden, 2, heads)), 2048, dtype="fp16",
                        attention=attention, device_type="cuda")
    forward, backward = megatron2021.layer_elementwise_bytes(trace, layout)
    per_element = (2 * forward + backward) / (2 * 2048 * hidden)
    scores = 29 * heads * 2048 / (hidden * tp) if attention == "eager" else 0.0
    assert per_element == pytest.approx(90 + 118 / tp + scores)
