"""Current models are grouped-query (GQA): fewer key/value heads than query heads. The trace,
`advisor estimate` and a short train of Llama-3-, Qwen2- and Mistral-shaped tiny configs run on
every torch our floor admits, including torch 2.11, whose `sdpa_flop_count` asserted equal head
counts and stopped every GQA trace (on an H200, every row of the GPU check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.utils.flop_counter as flop_counter
from typer.testing import CliRunner

from advisor.cli import app
from specs.plan_file import load_plan
from specs.core import ModelSpec
from profiler.model_trace import trace_model
from test_trainer import make_plan_file, read_jsonl
from trainer.loop import TrainOptions, train

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 272, "max_position_embeddings": 128}
GQA_CONFIGS = {
    # Llama 3: 4 query heads share each key/value head (8B: 32/8), rope theta 5e5
    "llama3": {**BASE, "model_type": "llama", "num_key_value_heads": 1, "rope_theta": 500000.0,
               "tie_word_embeddings": False},
    # Qwen2: bias on q/k/v, tied embeddings at small sizes
    "qwen2": {**BASE, "model_type": "qwen2", "num_key_value_heads": 2, "tie_word_embeddings": True},
    # Mistral 7B v0.1: 32/8 heads and a sliding window (longer than these sequences)
    "mistral": {**BASE, "model_type": "mistral", "num_key_value_heads": 2, "sliding_window": 4096},
}
SEQ = 32


def _strict_sdpa_flop_count(query_shape, key_shape, value_shape):
    """torch 2.11's formula: every head count equal, or an assertion (as it stopped the H200 run)."""
    b, h, s_q, d_q = query_shape
    _b2, _h2, s_k, _d2 = key_shape
    _b3, _h3, _s3, d_v = value_shape
    assert b == _b2 == _b3 and h == _h2 == _h3 and d_q == _d2 and s_k == _s3 and d_q == d_v, \
        "sdpa_flop_count: query/key/value shapes are incompatible"
    return 2 * b * h * s_q * s_k * (d_q + d_v)


@pytest.fixture(autouse=True)
def torch_2_11_flop_count(monkeypatch):
    # torch's own attention formulas look this name up in their module when they run
    monkeypatch.setattr(flop_counter, "sdpa_flop_count", _strict_sdpa_flop_count)
    with pytest.raises(AssertionError):
        flop_counter.sdpa_flop_count((1, 4, 8, 16), (1, 1, 8, 16), (1, 1, 8, 16))


def _expected_flops(cfg: dict, seq: int) -> float:
    """Model FLOPs of one sequence, forward and backward (3x forward), from the shapes alone:
    q/k/v/o, gate/up/down and the LM head's GEMMs, and attention over the QUERY heads
    (Narayanan et al. 2021's count, 4 s^2 a d forward per layer, with a d the query width)."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = h // cfg["num_attention_heads"]
    q_width, kv_width = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    linear = 2 * seq * (h * q_width + 2 * h * kv_width + q_width * h + 3 * h * inter)
    attention = 4 * seq * seq * q_width
    return 3 * (cfg["num_hidden_layers"] * (linear + attention) + 2 * seq * h * v)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(GQA_CONFIGS))
def test_gqa_trace_counts_attention_over_the_query_heads(name: str, device_type: str) -> None:
    cfg = GQA_CONFIGS[name]
    trace = trace_model(ModelSpec(name=name, hf_config=cfg), SEQ, dtype="fp32", device_type=device_type,
                        use_disk_cache=False)
    assert trace.num_kv_heads < trace.num_heads
    assert trace.flops_per_sequence == pytest.approx(_expected_flops(cfg, SEQ), rel=1e-3)


@pytest.mark.parametrize("name", sorted(GQA_CONFIGS))
def test_gqa_estimate_and_three_step_train_with_recompute(name: str, tmp_path: Path) -> None:
    cfg = GQA_CONFIGS[name]
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(cfg))
    estimate = CliRunner().invoke(app, ["estimate", "--model", str(config_path), "--hardware", "cpu",
                                        "--layout", f"dp=1,mbs=2,seq={SEQ},recompute=selective", "--json"])
    assert estimate.exit_code == 0, estimate.output
    priced = json.loads(estimate.output)
    assert priced["memory"]["peak"] > 0 and priced["time"]["step_s"] > 0 and priced["memory"]["fits"]

    plan = load_plan(make_plan_file(tmp_path, steps=3, config=cfg, layout_fields={"recompute": "full"}))
    summary = train(plan, tmp_path / "run", resume=False,
                    options=TrainOptions(show_progress=False, max_steps_per_stage=3, exact_match_prompts=0))
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 6 and all(loss == loss and 0 < loss < 20 for loss in losses)
    assert summary is not None
