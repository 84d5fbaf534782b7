"""Nobody in (issue 31, finding 5): a model or tokenizer folder whose files name Python code of their own
(`auto_map`) is refused in one line before transformers reads it; its code never runs and nothing
asks "run the custom code? [y/N]"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from advisor.errors import UsageError
from advisor.specs import Layout, ModelSpec
from presets import load_model
from trainer.data.tokenizer import load_tokenizer
from trainer.model import build_model

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
