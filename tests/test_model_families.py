"""Every current decoder family plans, dry-runs and trains (issue 32).

transformers 5 saves per-layer lists in a family's config (`layer_types` for Qwen2/3 and Gemma 2/3),
and refuses a config whose layer count and lists disagree: the trace, which cuts a model to one and
two layers, used to stop `advisor plan` on a Qwen2 folder with "num_hidden_layers (1) must be equal
to the number of layer_types (3)". Each family here is a tiny model saved with `save_pretrained`
(config, weights and a word-level tokenizer), planned for LoRA, checked by `advisor train --dry-run`
(whose every rank's parameter, gradient and optimizer counts must equal the cost model's), and
trained for two steps from its saved weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from advisor.cli import app

runner = CliRunner()
SEQ = 32
WORDS = "the cat sat on a mat while dogs ran in park and birds sang over old trees".split()
DIMS = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "max_position_embeddings": 64,
        "bos_token_id": 1, "eos_token_id": 1, "pad_token_id": 0}
# model_type -> what the family's config adds; the layer kinds written out where a family mixes them
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 16},
    "gemma2": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3_text": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {},
    "olmo2": {},
}
CARRY_LAYER_TYPES = {"qwen2", "qwen3", "gemma2", "gemma3_text"}  # what transformers 5 writes for them


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", *WORDS])}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", pad_token="<pad>").save_pretrained(folder)


def _saved_model(folder: Path, model_type: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    assert model_type in CONFIG_MAPPING, f"transformers has no {model_type} config class"
    config = AutoConfig.for_model(model_type, **DIMS, **FAMILIES[model_type])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    _tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(14)) for i in range(40)]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return path


def _dry_run_ranks(plan: Path) -> list[dict]:
    checked = runner.invoke(app, ["train", str(plan), "--dry-run", "--json"])
    assert checked.exit_code == 0, checked.output
    return [rank for stage in json.loads(checked.stdout)["stages"] for rank in stage["ranks"]]


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_plans_dry_runs_and_trains_two_lora_steps(tmp_path: Path, rows: Path, model_type: str) -> None:
    folder = _saved_model(tmp_path / model_type, model_type)
    saved = json.loads((folder / "config.json").read_text())
    assert ("layer_types" in saved) == (model_type in CARRY_LAYER_TYPES)
    plan = tmp_path / "plan.yaml"
    made = runner.invoke(app, ["plan", "--model", str(folder), "--hardware", "cpu", "--gpus-per-node", "1",
                               "--seq-len", str(SEQ), "--global-batch", "2", "--method", "lora",
                               "--fix", "zero=0,mbs=2,gas=1", "--top", "1", "--out", str(plan)])
    assert made.exit_code == 0, made.output

    for rank in _dry_run_ranks(plan):  # the trace's layers add up to the model the trainer builds
        predicted = rank["predicted"]
        assert (rank["parameters"], rank["gradients"], rank["optimizer"]) == \
            (predicted["weights"], predicted["gradients"], predicted["optimizer"])
        assert rank["decoder_layers"] == DIMS["num_hidden_layers"] and rank["gradients"] > 0

    run = tmp_path / "run"
    trained = runner.invoke(app, ["train", str(plan), "--data", str(rows), "--steps", "2", "--weights", str(folder),
                                  "--out", str(run)])
    assert trained.exit_code == 0, trained.output
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # a fresh model predicts about uniformly over the vocabulary: loss near ln(vocab), never far off
    assert all(math.isfinite(m["loss"]) and abs(m["loss"] - math.log(DIMS["vocab_size"])) < 2 for m in metrics)
    assert any((run / "stages" / "train" / "model").glob("adapter_model.safetensors"))
