"""Nobody in (issue 31, finding 5): a model or tokenizer folder whose files name Python code of their own
(`auto_map`) is refused in one line before transformers reads it; its code never runs and nothing
asks "run the custom code? [y/N]"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_model_families import DIMS, SEQ, WORDS, runner
from test_model_families import _tokenizer as write_word_tokenizer

from advisor.cli import app
from specs.errors import UsageError
from specs.remote_code import code_digest
from specs.core import Layout, ModelSpec
from presets import load_model
from trainer.data.tokenizer import load_tokenizer
from trainer.model import build_model
from trainer.run_identity import check_resume

PLANTED = '''from pathlib import Path
Path(__file__).with_name("ran.txt").write_text("the folder's code ran")
'''


def _folder_with_code(tmp_path: Path, file: str, content: dict) -> Path:
    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / file).write_text(json.dumps(content))
    for module in ("configuration_custom.py", "modeling_custom.py", "tokenization_custom.py"):
        (folder / module).write_text(PLANTED)
    return folder


def test_a_weights_folder_with_its_own_code_is_refused_and_its_code_never_runs(tmp_path: Path) -> None:
    config = {**load_model("demo-tiny").hf_config,
              "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                           "AutoModelForCausalLM": "modeling_custom.CustomModel"}}
    folder = _folder_with_code(tmp_path, "config.json", config)
    with pytest.raises(UsageError, match="names its own Python code"):
        build_model(ModelSpec(name="x", hf_config=config), Layout(), seed=0, weights=str(folder))
    assert not (folder / "ran.txt").exists()


def test_a_tokenizer_folder_with_its_own_code_is_refused(tmp_path: Path) -> None:
    folder = _folder_with_code(tmp_path, "tokenizer_config.json",
                               {"auto_map": {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}})
    with pytest.raises(UsageError, match="names its own Python code"):
        load_tokenizer(folder)
    assert not (folder / "ran.txt").exists()


# --trust-remote-code (issue 31): a folder whose config names its own classes, here a Llama under another
# model_type, whose model leaves a line in MARKER each time it is built: proof that the folder's code ran
CUSTOM_CONFIG = '''from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"
'''
CUSTOM_MODEL = '''from pathlib import Path

from transformers import LlamaForCausalLM

from .configuration_tiny import TinyCustomConfig

MARKER = Path({marker!r})


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig

    def __init__(self, config):
        super().__init__(config)
        with MARKER.open("a") as marker:
            marker.write(type(config).__name__ + "\\n")
'''


def _custom_code_folder(tmp_path: Path) -> tuple[Path, Path]:
    """A saved tiny Llama and its tokenizer, its config.json renamed to a model_type of its own whose
    classes its own Python files define (auto_map); and the marker file its model writes when built."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder, marker = tmp_path / "tiny-custom-code", tmp_path / "built-by-the-folder-code.txt"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **DIMS)).save_pretrained(folder)
    write_word_tokenizer(folder)
    (folder / "configuration_tiny.py").write_text(CUSTOM_CONFIG)
    (folder / "modeling_tiny.py").write_text(CUSTOM_MODEL.format(marker=str(marker)))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny_custom", architectures=["TinyCustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny.TinyCustomConfig",
                            "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker


def _refused_naming_the_flag(result) -> None:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "--trust-remote-code" in lines[0] and "names its own Python code" in lines[0], lines


def test_a_folder_with_its_own_code_plans_and_trains_only_with_trust_remote_code(tmp_path: Path) -> None:
    folder, marker = _custom_code_folder(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": " ".join(WORDS[i:] + WORDS[:i])}) + "\n" for i in range(16)))
    plan = tmp_path / "plan.yaml"
    plan_args = ["plan", "--model", str(folder), "--hardware", "cpu", "--gpus-per-node", "1", "--seq-len", str(SEQ),
                 "--global-batch", "2", "--method", "lora", "--fix", "zero=0,mbs=2,gas=1", "--top", "1",
                 "--out", str(plan)]
    _refused_naming_the_flag(runner.invoke(app, plan_args))
    assert not marker.exists() and not plan.exists()

    estimate_args = ["estimate", "--model", str(folder), "--hardware", "cpu", "--gpus-per-node", "1", "--seq-len",
                     str(SEQ), "--layout", "method=lora,mbs=2,gas=1", "--json"]
    _refused_naming_the_flag(runner.invoke(app, estimate_args))
    assert not marker.exists()

    planned = runner.invoke(app, [*plan_args, "--trust-remote-code"])
    assert planned.exit_code == 0, planned.output
    assert "TinyCustomConfig" in marker.read_text()  # the trace built the folder's own model
    estimated = runner.invoke(app, [*estimate_args, "--trust-remote-code"])
    assert estimated.exit_code == 0, estimated.output
    assert json.loads(estimated.stdout)["memory"]["weights"] > 0
    marker.unlink()

    run = tmp_path / "run"
    train_args = ["train", str(plan), "--data", str(rows), "--steps", "2", "--weights", str(folder), "--out", str(run),
                  "--exact-match-prompts", "0", "--merge"]
    _refused_naming_the_flag(runner.invoke(app, train_args))
    assert not marker.exists() and not run.exists()

    trained = runner.invoke(app, [*train_args, "--trust-remote-code"])
    assert trained.exit_code == 0, trained.output
    assert "TinyCustomConfig" in marker.read_text()  # the trainer built the folder's own model
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # a resume must keep the run's --trust-remote-code setting (run.json's fingerprint holds it)
    fingerprint = json.loads((run / "run.json").read_text())["fingerprint"]
    assert fingerprint["trust_remote_code"] is True
    with pytest.raises(UsageError, match="another --trust-remote-code setting"):
        check_resume(run, {**fingerprint, "trust_remote_code": False})
    # the merged model keeps the folder's code beside its config, so that it loads again (with the opt-in)
    merged = run / "model" / "merged"
    assert json.loads((merged / "config.json").read_text())["auto_map"] == \
        json.loads((folder / "config.json").read_text())["auto_map"]
    assert [(merged / name).read_text() for name in ("configuration_tiny.py", "modeling_tiny.py")] == \
        [(folder / name).read_text() for name in ("configuration_tiny.py", "modeling_tiny.py")]


def test_a_cached_trace_of_a_folders_own_code_is_keyed_by_that_code(tmp_path: Path) -> None:
    folder, _ = _custom_code_folder(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    source = str(folder / "config.json")
    before = code_digest(config, source)
    (folder / "modeling_tiny.py").write_text((folder / "modeling_tiny.py").read_text() + "\n# edited\n")
    assert before and code_digest(config, source) not in ("", before)
    assert code_digest({k: v for k, v in config.items() if k != "auto_map"}, source) == ""  # no code: keys unchanged


def test_a_tokenizer_folder_with_its_own_code_loads_it_only_with_trust_remote_code(tmp_path: Path) -> None:
    folder, marker = tmp_path / "tokenizer-with-code", tmp_path / "tokenizer-code-ran.txt"
    write_word_tokenizer(folder)
    (folder / "tokenization_custom.py").write_text(
        "from pathlib import Path\n\nfrom transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        super().__init__(*args, **kwargs)\n"
        f"        Path({str(marker)!r}).write_text('ran')\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="CustomTokenizer",
                  auto_map={"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]})
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="--trust-remote-code"):
        load_tokenizer(folder)
    assert not marker.exists()
    assert type(load_tokenizer(folder, trusted=True)).__name__ == "CustomTokenizer" and marker.exists()
