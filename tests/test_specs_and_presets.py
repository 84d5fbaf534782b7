"""Specs validate once at the edge; presets carry their sources and load into the specs."""

import re

import pytest

from advisor.errors import UsageError
from advisor.specs import Layout, parse_layout_string, resolve_layout
from presets import PRESETS_DIR, load_hardware, load_model, preset_data, preset_names


def test_layout_string_round_trips_through_short_form() -> None:
    hw = load_hardware("h100-80g")
    layout = resolve_layout("tp=4,pp=2,vpp=2,sp=1,zero=1,mbs=2,gas=8,recompute=selective", 64, hw, 4096)
    assert (layout.dp, layout.tp, layout.pp, layout.vpp, layout.sp) == (8, 4, 2, 2, True)
    assert layout.global_batch == 8 * 2 * 8 and layout.tokens_per_step == 128 * 4096
    assert Layout(**parse_layout_string(layout.short())) == layout


@pytest.mark.parametrize(
    "text,message",
    [
        ("sp=1", "sp=1 needs tp>1"),
        ("pp=1,vpp=2", "vpp>1 needs pp>1"),
        ("zero=0,offload=optimizer", "offload needs zero>=1"),
        ("zero=2,offload=optimizer+params", "needs zero=3"),
        ("mbs=0", "mbs: Input should be greater than or equal to 1"),
        ("dtype=fp8", "dtype: must be one of 'bf16', 'fp16' or 'fp32'"),
        ("tp=2,tp=4", "given twice"),
    ],
)
def test_invalid_layouts_name_the_field_and_the_rule(text: str, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        resolve_layout(text, 8, load_hardware("a100-80g"))


def test_cpu_has_no_fp16_path() -> None:
    with pytest.raises(UsageError, match="does not run fp16"):
        resolve_layout("dtype=fp16", 2, load_hardware("cpu"))


@pytest.mark.parametrize("name", preset_names("hardware"))
def test_every_hardware_number_states_its_source(name: str) -> None:
    text = (PRESETS_DIR / "hardware" / f"{name}.yaml").read_text()
    numeric = [line for line in text.splitlines() if re.match(r"\s*\w+:\s*[-+]?[\d.]+(e[-+]?\d+)?\s*(#|$)", line)]
    assert numeric
    for line in numeric:
        assert "#" in line, f"{name}: no source comment on '{line.strip()}'"
    hw = load_hardware(name)
    assert hw.usable_bytes < hw.memory_bytes
    assert 0 < hw.efficiency.gemm <= 1


@pytest.mark.parametrize("name", preset_names("models"))
def test_model_presets_build_and_match_published_sizes(name: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = load_model(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec.hf_config))
    params = sum(p.numel() for p in model.parameters())
    assert params / 1e9 == pytest.approx(preset_data("models", name)["params_b"], rel=0.01)
