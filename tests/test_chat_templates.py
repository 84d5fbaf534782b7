"""Built-in chat templates (`advisor train --template NAME`) for tokenizers that ship none: each
renders its family's published turn layout, and chat rows train on the answers only through it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from advisor.cli import app
from specs.errors import UsageError
from specs.task import TaskSpec
from trainer.batch import IGNORE
from trainer.corpus import tokenizer_for
from trainer.data.chat_templates import BUILTIN_TEMPLATES, TEMPLATE_NAMES
from trainer.data.formats import render_example

runner = CliRunner()
SPECIALS = sorted({token for template in BUILTIN_TEMPLATES.values() for token in template.special_tokens}
                  | {"[INST]", "[/INST]"})  # Mistral's instruction markers: control tokens since v0.3
WORDS = ["system", "user", "assistant", "model", "be", "brief", "hi", "there", "hello", "how", "are", "you",
         "fine", "thanks"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you"},
        {"role": "assistant", "content": "fine thanks"}]
# each family's layout of CHAT, written out from its published format
LAYOUTS = {
    "llama3": "<|begin_of_text|>"
              "<|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nhow are you<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nfine thanks<|eot_id|>",
    "qwen2.5": "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
               "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nhow are you<|im_end|>\n"
               "<|im_start|>assistant\nfine thanks<|im_end|>\n",
    "mistral": "<s>[INST] be brief\n\nhi there [/INST]hello</s>[INST] how are you [/INST]fine thanks</s>",
    "gemma": "<bos><start_of_turn>user\nbe brief\n\nhi there<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
             "<start_of_turn>user\nhow are you<end_of_turn>\n<start_of_turn>model\nfine thanks<end_of_turn>\n",
    "phi3": "<|system|>\nbe brief<|end|>\n<|user|>\nhi there<|end|>\n<|assistant|>\nhello<|end|>\n"
            "<|user|>\nhow are you<|end|>\n<|assistant|>\nfine thanks<|end|>\n",
}
END_OF_TURN = {"llama3": "<|eot_id|>", "qwen2.5": "<|im_end|>", "mistral": "</s>", "gemma": "<end_of_turn>",
               "phi3": "<|end|>"}


def _tokenizer(folder: Path, specials: list[str] = SPECIALS) -> Path:
    """A word-level tokenizer with every family's special tokens and no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", *specials, *WORDS])}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<eos>", pad_token="<pad>",
                                        additional_special_tokens=list(specials))
    assert not tokenizer.chat_template
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return _tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _task(folder: Path) -> TaskSpec:
    return TaskSpec.model_validate({"name": "t", "base_dir": str(folder), "data": {"tokenizer": str(folder)},
                                    "stages": [{"name": "s", "tokens": 10, "sources": [{"path": "rows.jsonl"}]}]})


def test_every_family_of_the_issue_has_a_template() -> None:
    assert set(TEMPLATE_NAMES) == set(LAYOUTS) == {"llama3", "qwen2.5", "mistral", "gemma", "phi3"}


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_template_renders_the_familys_layout(tokenizer_dir: Path, name: str) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    hf.chat_template = BUILTIN_TEMPLATES[name].jinja
    assert hf.apply_chat_template(CHAT, tokenize=False) == LAYOUTS[name]
    # the prompt a model answers: the layout up to the last answer, generation prompt included
    prompt = hf.apply_chat_template(CHAT[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt == LAYOUTS[name][:LAYOUTS[name].rindex("fine thanks")]


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_chat_rows_train_on_the_answers_only_through_the_template(tokenizer_dir: Path, name: str) -> None:
    tokenizer = tokenizer_for(_task(tokenizer_dir), "tiny", 64, template=name)
    ids, labels = render_example({"messages": CHAT}, "chat", tokenizer)
    vocab = {i: w for w, i in json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"].items()}
    trained = [vocab[token] for token, label in zip(ids, labels) if label != IGNORE]
    assert all(label in (IGNORE, token) for token, label in zip(ids, labels))
    assert trained == ["hello", END_OF_TURN[name], "fine", "thanks", END_OF_TURN[name]]


def test_a_template_needs_its_special_tokens_and_a_known_name(tmp_path: Path) -> None:
    folder = _tokenizer(tmp_path, specials=["<|im_start|>", "<|im_end|>"])
    ids, _ = render_example({"messages": CHAT}, "chat", tokenizer_for(_task(folder), "tiny", 64, template="qwen2.5"))
    assert ids
    with pytest.raises(UsageError, match=r"--template llama3: tokenizer .* has no single token for <\|begin_of_text"):
        render_example({"messages": CHAT}, "chat", tokenizer_for(_task(folder), "tiny", 64, template="llama3"))
    with pytest.raises(UsageError, match="--template chatml: choose one of llama3, qwen2.5, mistral, gemma, phi3"):
        tokenizer_for(_task(folder), "tiny", 64, template="chatml")


def test_train_with_a_builtin_template_on_chat_rows(tmp_path: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    # a Qwen2 config saved by transformers (its layer_types too), the tokenizer in a folder of its own
    AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, eos_token_id=1,
                         pad_token_id=0).save_pretrained(tmp_path / "model")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(12)))
    (tmp_path / "task.yaml").write_text(json.dumps({
        "name": "chat", "data": {"tokenizer": str(tokenizer_dir)},
        "stages": [{"name": "s", "steps": 2, "warmup_steps": 0, "sources": [{"path": "chat.jsonl"}]}]}))
    plan = tmp_path / "plan.yaml"
    made = runner.invoke(app, ["plan", "--model", str(tmp_path / "model"), "--task", str(tmp_path / "task.yaml"),
                               "--hardware", "cpu", "--gpus-per-node", "1", "--seq-len", "32", "--global-batch", "2",
                               "--method", "lora", "--fix", "zero=0,mbs=2,gas=1", "--top", "1", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    run, train = tmp_path / "run", ["train", str(plan), "--exact-match-prompts", "0"]
    refused = runner.invoke(app, [*train, "--out", str(tmp_path / "refused")])
    assert refused.exit_code == 2 and "has no chat template" in refused.stderr and "--template" in refused.stderr
    trained = runner.invoke(app, [*train, "--template", "qwen2.5", "--out", str(run)])
    assert trained.exit_code == 0, trained.output
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    # the rows the loop trained on: per conversation (five turns, each opened by <|im_start|>), the
    # two answers' three words and their two <|im_end|>, nothing else
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    cached = [np.load(path) for path in (run / "data_cache").glob("*.npz")]
    ids = np.concatenate([c["ids"].ravel() for c in cached])
    labels = np.concatenate([c["labels"].ravel() for c in cached])
    conversations = int((ids == hf.convert_tokens_to_ids("<|im_start|>")).sum()) // 5
    trained_words = sorted(hf.convert_ids_to_tokens([int(t) for t in labels[labels != IGNORE]]))
    assert conversations >= 2
    assert trained_words == sorted(["hello", "fine", "thanks", "<|im_end|>", "<|im_end|>"] * conversations)
    saved = AutoTokenizer.from_pretrained(run / "stages" / "s" / "model")
    assert saved.chat_template == BUILTIN_TEMPLATES["qwen2.5"].jinja  # inference renders chats as training did


def test_a_template_is_part_of_the_runs_identity(tmp_path: Path) -> None:
    """--resume with another template would train other tokens from the same files: refused as
    another run's data; everything else about the run's identity stays as it was."""
    from specs.plan_file import load_plan
    from test_trainer import make_plan_file
    from trainer.file_digests import FileDigests
    from trainer.options import TrainOptions
    from trainer.run_identity import fingerprint

    plan = load_plan(make_plan_file(tmp_path))

    def identity(template: str | None) -> dict:
        return fingerprint(plan, plan.chosen.layout, TrainOptions(template=template), None, None, FileDigests())

    plain, gemma, phi3 = identity(None), identity("gemma"), identity("phi3")
    assert identity(None) == plain
    assert gemma["template"] != plain["template"] != phi3["template"] != gemma["template"]
    assert {k: v for k, v in gemma.items() if k != "template"} == {k: v for k, v in plain.items() if k != "template"}
