"""`advisor train PLAN --dry-run`: the trainer's checks on the meta device, and the model states each
rank holds, against hand counts."""

import json
import math
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from specs.capabilities import ENGINES
from advisor.cli import app
from specs.plan_file import load_plan
from specs.core import Layout, ModelSpec
from trainer.dry_run import _rank_states, meta_model

runner = CliRunner()

MISTRAL_TASK = {
    "name": "mistral-sft", "seq_len": 4096, "global_batch": 256,
    "stages": [{"name": "continued", "sources": [{"path": "general.jsonl"}], "tokens": 2_000_000_000},
               {"name": "instructions", "sources": [{"path": "instructions.jsonl"}], "tokens": 50_000_000,
                "method": "lora"}],
}

# The plans issue 13 names: each must dry-run with exit 0.
PLANS = {
    "llama3-8b-1x8": ["-m", "llama3-8b", "-H", "h100-80g", "--seq-len", "4096", "--global-batch", "512"],
    "llama3-70b-16x8": ["-m", "llama3-70b", "-H", "h100-80g", "--nodes", "16"],
    "llama3-405b-64x8": ["-m", "llama3-405b", "-H", "h100-80g", "--nodes", "64"],
    "llama2-7b-4090-auto": ["-m", "llama2-7b", "-H", "rtx4090-24g", "--gpus-per-node", "1", "--method", "auto"],
    "qwen2.5-72b-8x8": ["-m", "qwen2.5-72b", "-H", "h200-141g", "--nodes", "8"],
    "mistral-7b-lora-stage": ["-m", "mistral-7b", "-H", "h100-80g", "--per-stage-devices", "--task", "TASK"],
}


def _plan(tmp_path: Path, name: str) -> Path:
    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump(MISTRAL_TASK))
    out = tmp_path / f"{name}.yaml"
    args = [str(task) if a == "TASK" else a for a in PLANS[name]]
    result = runner.invoke(app, ["plan", *args, "--top", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_dry_run_accepts_the_plans_advisor_plan_writes(tmp_path: Path, name: str) -> None:
    plan_path = _plan(tmp_path, name)
    plan = load_plan(plan_path)
    started = time.perf_counter()
    result = runner.invoke(app, ["train", str(plan_path), "--dry-run", "--json"])
    seconds = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    layouts = [s.layout for s in plan.stages] or [plan.chosen.layout]
    assert [s["layout"] for s in report["stages"]] == [layout.short() for layout in layouts]
    for stage, layout in zip(report["stages"], layouts):
        assert len(stage["ranks"]) == layout.pp
        assert sum(r["decoder_layers"] for r in stage["ranks"]) == plan.model.hf_config["num_hidden_layers"]
        assert all(r["parameters"] > 0 for r in stage["ranks"])
    assert seconds < 60  # the meta device: a 405B model builds without memory


def test_zero1_ranks_hold_whole_16_bit_weights_and_a_dp_th_of_fp32_adam(tmp_path: Path) -> None:
    """llama3-8b on 8 devices, DeepSpeed ZeRO-1: 2 bytes per parameter of weights and gradients,
    12/dp of master and moments. The parameter count from Llama's layer formula."""
    plan_path = tmp_path / "plan.yaml"
    result = runner.invoke(app, ["plan", *PLANS["llama3-8b-1x8"], "--fix", "dp=8,zero=1", "--top", "1",
                                 "--out", str(plan_path)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["train", str(plan_path), "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    (rank,) = json.loads(result.stdout)["stages"][0]["ranks"]
    h, layers, kv_dim, mlp, vocab = 4096, 32, 1024, 14336, 128256
    params = layers * (2 * h * h + 2 * h * kv_dim + 3 * h * mlp + 2 * h) + 2 * vocab * h + h
    assert (rank["parameters"], rank["gradients"]) == (2 * params, 2 * params)
    assert rank["optimizer"] == round(12 * params / 8)
    assert json.loads(result.stdout)["stages"][0]["engine"] == "deepspeed"


TINY = ModelSpec(name="tiny", hf_config={
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
    "tie_word_embeddings": False})


def test_pipeline_ranks_hold_their_stage_split_by_tp_and_sharded_by_fsdp() -> None:
    """pp=2, tp=2, dp=2, ZeRO-1 on the pipeline engine, counted by hand: the Megatron projections
    halved by tp (norms, embedding, LM head whole), each stage's tensors halved again by FSDP2
    across dp, kept in fp32 with two fp32 Adam moments; below ZeRO-2 FSDP2 skips the reduce-scatter
    while accumulating (gas=2), so the fp32 gradients are whole until the step."""
    layout = Layout(dp=2, tp=2, pp=2, zero=1, mbs=1, gas=2, dtype="bf16", seq=64)
    ranks = _rank_states(meta_model(TINY, layout), layout, "pipeline", [2, 2])
    projections = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128
    layer = projections // 2 + 2 * 64  # tp halves the projections; the two norms stay whole
    first = (2 * layer + 256 * 64) // 2  # then FSDP2 halves every tensor (all even)
    last = (2 * layer + 64 + 256 * 64) // 2  # the final norm and LM head
    assert [(r.parameters, r.gradients, r.optimizer) for r in ranks] == [
        (4 * first, 4 * 2 * first, 8 * first), (4 * last, 4 * 2 * last, 8 * last)]


def test_plain_lora_keeps_a_16_bit_base_and_fp32_adapters() -> None:
    layout = Layout(method="lora", lora_rank=4, dtype="bf16", seq=64)
    (rank,) = _rank_states(meta_model(TINY, layout), layout, "plain", [4])
    base = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 2 * 256 * 64 + 64
    # rank-4 A (in x 4) and B (4 x out) on every linear of the decoder layers (peft's all-linear)
    adapters = 4 * 4 * ((64 + 64) * 2 + (64 + 32) * 2 + 2 * (64 + 128) + (128 + 64))
    assert (rank.parameters, rank.gradients, rank.optimizer) == (2 * base + 4 * adapters, 4 * adapters, 8 * adapters)


def test_dry_run_refuses_a_layout_the_trainer_does_not_run(tmp_path: Path) -> None:
    plan_path = _plan(tmp_path, "llama2-7b-4090-auto")
    data = yaml.safe_load(plan_path.read_text())
    data["chosen"]["layout"].update({"method": "full", "dtype": "fp16", "zero": 0, "offload": "none"})
    plan_path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["train", str(plan_path), "--dry-run"])
    if "fp16" in ENGINES["plain"].dtypes:
        pytest.skip("the plain engine runs fp16 now")
    assert result.exit_code == 2
    assert "dtype=fp16 is not run by the plain engine" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_meta_model_of_405b_builds_in_seconds() -> None:
    from presets import load_model

    started = time.perf_counter()
    model = meta_model(load_model("llama3-405b"), Layout())
    assert time.perf_counter() - started < 30
    assert math.isclose(sum(p.numel() for p in model.parameters()), 405.85e9, rel_tol=1e-3)
    assert next(model.parameters()).is_meta


def test_qlora_counts_the_decoder_linear_weights_in_nf4() -> None:
    """The 4-bit base: decoder projections at NF4's 4.127 bits (QLoRA section 3) plus each quantised
    tensor's fixed constants; norms, the embedding and the LM head in fp32 (peft's
    prepare_model_for_kbit_training up-casts them: tests/test_qlora.py measures it); adapters fp32
    (with their gradients and moments)."""
    from planner.memory import NF4_BYTES_PER_PARAM, NF4_TENSOR_BYTES

    layout = Layout(method="qlora", lora_rank=4, dtype="bf16", seq=64)
    (rank,) = _rank_states(meta_model(TINY, layout), layout, "plain", [4])
    projections = 4 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)
    sixteen_bit = 4 * 2 * 64 + 2 * 256 * 64 + 64
    adapters = 4 * 4 * 1024
    quantised_tensors = 4 * 7  # q, k, v, o, gate, up, down in each of the 4 layers
    assert rank.parameters == round(projections * NF4_BYTES_PER_PARAM + quantised_tensors * NF4_TENSOR_BYTES
                                    + 4 * sixteen_bit + 4 * adapters)
    assert (rank.gradients, rank.optimizer) == (4 * adapters, 8 * adapters)
