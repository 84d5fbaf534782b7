"""Specs validate once at the edge; presets carry their sources and load into the specs."""

import re

import pytest

from specs.errors import UsageError
from specs.core import Layout, parse_layout_string, resolve_layout
from presets import PRESETS_DIR, load_hardware, load_model, load_task, preset_data, preset_names


def test_layout_string_round_trips_through_short_form() -> None:
    hw = load_hardware("h100-80g")
    layout = resolve_layout("tp=4,pp=2,vpp=2,sp=1,zero=1,mbs=2,gas=8,recompute=selective", 64, hw, 4096)
    assert (layout.dp, layout.tp, layout.pp, layout.vpp, layout.sp) == (8, 4, 2, 2, True)
    assert layout.global_batch == 8 * 2 * 8 and layout.tokens_per_step == 128 * 4096
    assert Layout(**parse_layout_string(layout.short())) == layout


@pytest.mark.parametrize("text", [
    "dp=1,mbs=4,seq=512,loss=hf",  # transformers' loss, as a user's own script runs it
    "dp=2,zero=2,offload=optimizer,method=lora,lora_rank=8,recompute=full,recompute_layers=3,loss=hf",
    "dp=1,tp=2,pp=2,stage_layers=5/7,method=full,loss=chunked",
])
def test_every_key_round_trips_through_the_short_form(text: str) -> None:
    layout = Layout(**parse_layout_string(text))
    assert Layout(**parse_layout_string(layout.short())) == layout
    assert ("loss=hf" in layout.short()) == (layout.loss == "hf")  # the default stays unsaid


def test_the_loss_key_defaults_to_the_trainers_own_and_names_its_choices() -> None:
    assert Layout().loss == "chunked" and resolve_layout("mbs=2", 8, load_hardware("a100-80g")).loss == "chunked"
    with pytest.raises(UsageError, match=re.escape("loss: must be one of 'chunked' or 'hf'")):
        resolve_layout("loss=liger", 8, load_hardware("a100-80g"))


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


# --- numbers: finite, and within their bounds ------------------------------------------------------------


def write_yaml(path, data) -> str:
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def demo_task() -> dict:
    import yaml

    return yaml.safe_load((PRESETS_DIR / "tasks" / "demo.yaml").read_text())


@pytest.mark.parametrize("change,message", [
    (lambda t: t["stages"][0].update(lr=float("nan")), "stages.0.lr: Input should be a finite number"),
    (lambda t: t["stages"][0].update(lr=float("inf")), "stages.0.lr: Input should be a finite number"),
    (lambda t: t["stages"][0]["sources"][0].update(weight=float("inf")), "weight: Input should be a finite number"),
    (lambda t: t["data"]["dedup"].update(threshold=float("nan")), "data.dedup.threshold: Input should be a finite"),
    (lambda t: t["stages"][3].update(replay={"language": -0.2}), "replay share of 'language' is -0.2"),
    (lambda t: t["stages"][3].update(replay={"language": 0.6, "reasoning": 0.4}), "replay shares sum to 1"),
    (lambda t: t["stages"][3].update(replay={"language": float("nan")}), "Input should be a finite number"),
])
def test_task_numbers_are_finite_and_bounded(tmp_path, change, message: str) -> None:
    task = demo_task()
    change(task)
    with pytest.raises(UsageError, match=re.escape(message)):
        load_task(write_yaml(tmp_path / "task.yaml", task))


@pytest.mark.parametrize("field,value", [("memory_gib", float("inf")), ("memory_bandwidth_gbs", float("nan")),
                                         ("reserved_gib", 90.0), ("peak_tflops", {"bf16": -1.0})])
def test_hardware_numbers_are_finite_and_bounded(tmp_path, field: str, value) -> None:
    data = preset_data("hardware", "a100-80g")
    data[field] = value
    with pytest.raises(UsageError, match=field):
        load_hardware(write_yaml(tmp_path / "hw.yaml", data))


def test_a_model_config_with_nan_is_refused(tmp_path) -> None:
    import json

    config = dict(load_model("demo-tiny").hf_config, rope_theta=float("nan"))
    (tmp_path / "config.json").write_text(json.dumps(config))  # json writes NaN, and reads it back
    with pytest.raises(UsageError, match="rope_theta is not a finite number"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("change,message", [
    (lambda p: p["stages"][0].update(checkpoint_every_steps=0), "checkpoint_every_steps: Input should be greater"),
    (lambda p: p.update(min_compute_fraction=float("nan")), "min_compute_fraction: Input should be a finite"),
    (lambda p: p.update(nodes=0), "nodes: Input should be greater than or equal to 1"),
    (lambda p: p["solver"].update(seconds=float("inf")), "solver: seconds is not a finite number"),
])
def test_plan_file_numbers_are_finite_and_bounded(tmp_path, change, message: str) -> None:
    from specs.plan_file import load_plan
    from planner.plan import PlanOptions, make_plan

    plan = make_plan(PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("a100-80g"), gpus_per_node=1,
                                 task=load_task("demo"), top_k=1))
    data = plan.model_dump(mode="json")
    change(data)
    with pytest.raises(UsageError, match=re.escape(message)):
        load_plan(write_yaml(tmp_path / "plan.yaml", data))


def test_seq_len_beyond_the_models_positions_is_refused_at_plan_time(tmp_path) -> None:
    from planner.plan import PlanOptions, make_plan

    task = demo_task()
    task["seq_len"] = 2048  # demo-tiny has 1024 positions
    opts = PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("a100-80g"), gpus_per_node=1,
                       task=load_task(write_yaml(tmp_path / "task.yaml", task)))
    with pytest.raises(UsageError, match="seq_len 2048 exceeds model demo-tiny's max_position_embeddings 1024"):
        make_plan(opts)
    with pytest.raises(UsageError, match="--seq-len 1025 exceeds"):
        make_plan(PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("a100-80g"), seq=1025))


@pytest.mark.parametrize("text,seconds", [("14d", 14 * 86400), ("1.5h", 5400), ("90m", 5400), (" 30 ", 30),
                                          (".5d", 43200)])
def test_durations_read(text: str, seconds: float) -> None:
    from planner.plan import parse_duration

    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["1.2.3d", "1..2h", ".", "d", "-1d", "0h", "1e3s", "nan", "inf", "5 days", ""])
def test_durations_refuse_anything_else(text: str) -> None:
    from planner.plan import parse_duration

    with pytest.raises(UsageError, match="--deadline"):
        parse_duration(text)


def test_ranks_beyond_the_cores_time_share_them_in_the_price() -> None:
    """4 one-thread ranks on a 2-core node take twice the compute of the same 4 ranks on 4 cores
    (the kernel gives each half a core); 2 such ranks on 2 cores fit."""
    from planner.cost_model import estimate

    base = load_hardware("cpu").model_copy(update={"threads_per_device": 1, "devices_per_node": 4})
    assert base.model_copy(update={"cpu_cores": 2}).oversubscription(4) == 2.0
    assert base.model_copy(update={"cpu_cores": 2}).oversubscription(2) == 1.0
    assert load_hardware("cpu").oversubscription(64) == 1.0  # cores unknown: no claim
    model = load_model("demo-tiny")
    layout = Layout(dp=4, mbs=2, seq=128, dtype="fp32")
    shared, own = (estimate(model, base.model_copy(update={"cpu_cores": cores}), layout) for cores in (2, 4))
    assert shared.time.compute_s == pytest.approx(2 * own.time.compute_s, rel=1e-9)
