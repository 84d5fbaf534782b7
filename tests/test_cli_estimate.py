"""`advisor estimate` and `advisor presets` as a user meets them: the JSON contract, clear errors."""

import json

import pytest
from typer.testing import CliRunner

from advisor.cli import app
from specs.core import LAYOUT_KEYS_HELP

runner = CliRunner()

CONTRACT = {
    "model": {"params", "trainable_params"},
    "memory": {"weights", "gradients", "optimizer", "activations", "other", "peak", "capacity", "fits"},
    "time": {"step_s", "compute_s", "comm_exposed_s", "bubble_s", "optimizer_s"},
    "throughput": {"tokens_per_s", "model_tflops_per_device", "mfu"},
}


def run(*args: str):
    return runner.invoke(app, list(args))


def test_estimate_json_keeps_the_contract() -> None:
    result = run("estimate", "--model", "demo-tiny", "--hardware", "a100-80g", "--nodes", "1",
                 "--layout", "tp=2,pp=2,zero=1,mbs=2,gas=4,recompute=selective", "--seq-len", "512", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for section, keys in CONTRACT.items():
        assert keys <= out[section].keys(), section
    assert 0 < out["compute_fraction"] <= 1
    mem = out["memory"]
    parts = sum(mem[k] for k in ("weights", "gradients", "optimizer", "activations", "other"))
    assert mem["peak"] == pytest.approx(parts, abs=5)
    assert out["layout"]["dp"] == 2  # 8 devices / (tp 2 * pp 2)
    t = out["time"]
    assert t["step_s"] == pytest.approx(t["compute_s"] + t["comm_exposed_s"] + t["bubble_s"] + t["optimizer_s"])
    tokens = 2 * 2 * 4 * 512  # dp * mbs * gas * seq
    assert out["throughput"]["tokens_per_s"] == pytest.approx(tokens / t["step_s"])


def test_estimate_defaults_dtype_to_fp32_on_cpu() -> None:
    result = run("estimate", "--model", "demo-tiny", "--hardware", "cpu", "--layout", "dp=1", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["layout"]["dtype"] == "fp32"



def test_the_compute_rule_verdict_uses_the_requested_threshold() -> None:
    args = ("estimate", "--model", "demo-tiny", "--hardware", "a100-80g", "--layout", "tp=2,pp=2,mbs=1,gas=4")
    fraction = json.loads(run(*args, "--json").stdout)["compute_fraction"]
    below, above = fraction - 0.05, min(1.0, fraction + 0.05)
    assert "(ok)" in " ".join(run(*args, "--min-compute-fraction", f"{below}").stdout.split())
    text = " ".join(run(*args, "--min-compute-fraction", f"{above}").stdout.split())
    assert f"below the {100 * above:.0f}% rule" in text

@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "no-such-model", "--hardware", "a100-80g"], "unknown models preset 'no-such-model'"),
        (["--model", "demo-tiny", "--hardware", "tpu-v9"], "unknown hardware preset 'tpu-v9'"),
        (["--model", "demo-tiny", "--hardware", "a100-80g", "--layout", "tp=2;pp"], "layout tp=2;pp: must be an integer"),
        (["--model", "demo-tiny", "--hardware", "a100-80g", "--layout", "warp=9"], "unknown layout key 'warp'"),
        (["--model", "demo-tiny", "--hardware", "a100-80g", "--layout", "dp=3,tp=1,pp=1", "--nodes", "1"],
         "dp*tp*pp = 3*1*1 = 3 but there are 8 devices"),
        (["--model", "demo-tiny", "--hardware", "a100-80g", "--layout", "tp=8"],
         "tp=8 does not divide the 4 attention heads"),
        (["--model", "demo-tiny", "--hardware", "a100-80g", "--layout", "recompute=most"],
         "recompute: must be one of 'none', 'selective' or 'full'"),
        (["--model", "/nowhere/config.json", "--hardware", "a100-80g"], "model config not found"),
    ],
)
def test_bad_input_gives_one_clear_line_and_exit_code_2(args, message) -> None:
    result = run("estimate", *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2  # one line, maybe wrapped


def test_model_folder_with_any_hf_config_is_accepted(tmp_path) -> None:
    config = {"model_type": "mistral", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500}
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = run("estimate", "--model", str(tmp_path), "--hardware", "h100-80g", "--layout", "dp=1,tp=1,pp=1",
                 "--seq-len", "128", "--json")
    assert result.exit_code == 0, result.output
    params = json.loads(result.stdout)["model"]["params"]
    h, i, layers, kv = 128, 256, 2, 64
    assert params == 2 * 500 * h + layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + h


def test_estimate_help_explains_every_layout_key() -> None:
    result = run("estimate", "--help")
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for key in LAYOUT_KEYS_HELP:
        assert f"{key}:" in text, key


def test_presets_lists_the_shipped_hardware_and_models() -> None:
    result = run("presets", "--json")
    assert result.exit_code == 0
    listing = json.loads(result.stdout)
    hardware = {p["name"] for p in listing["hardware"]}
    models = {p["name"] for p in listing["models"]}
    assert {"cpu", "a100-40g", "a100-80g", "h100-80g", "h200-141g", "l40s-48g", "rtx4090-24g"} <= hardware
    assert {"llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b", "mistral-7b",
            "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-72b", "gpt3-175b", "demo-tiny"} <= models


def test_a_layout_advisor_train_does_not_run_is_priced_with_the_declarations_reason() -> None:
    from specs.capabilities import config_shape, runnable_problem
    from specs.core import Layout
    from presets import load_model

    layout = "tp=2,zero=1,offload=optimizer,mbs=1,gas=8"
    result = CliRunner().invoke(app, ["estimate", "-m", "llama3-8b", "-H", "h100-80g", "--gpus-per-node", "8",
                                      "--layout", layout, "--json"])
    assert result.exit_code == 0, result.output
    reason = runnable_problem(Layout(dp=4, tp=2, zero=1, offload="optimizer", mbs=1, gas=8),
                              config_shape(load_model("llama3-8b").hf_config), "cuda")
    assert reason and f"advisor train does not run this layout: {reason}" in json.loads(result.stdout)["notes"]
