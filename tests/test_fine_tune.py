"""Fine-tuning defaults that learn (issue 32): a plan made without `--task`, trained from `--weights`
over `--data`, takes fine-tuning's learning rate and a schedule sized to the run; its flags override
them; held-out rows, packing and the rows cut at the sequence length are the user's to see.

The learning check builds its own small "pretrained" base: a tiny Llama trained here, in a few
seconds, on plain sentences of a small language (questions about fruit, facts about their colours,
some noise), never on the chat task. The LoRA run then teaches it to answer the questions in a chat
template; the answer loss on held-out conversations is measured here, from the logits of the base
and of `PeftModel.from_pretrained(base, RUN/model)`, independently of the trainer.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from advisor.cli import app
from specs.errors import UsageError
from specs.core import Layout
from specs.task import AdapterSpec, DataSource, StageSpec, TaskSpec
from trainer.batch import IGNORE
from trainer.corpus import ByteTokenizer, load_rows, read_answer_pairs
from trainer.fine_tune import FineTuneFlags, fine_tune_task
from trainer.stream import pack_examples

runner = CliRunner()
EOS = "<|endoftext|>"
NAMES = "ann bob cid dan eve fay gus hal ivy jon kim lea max ned oli pam".split()
COLOURS = {"apple": "red", "banana": "yellow", "cherry": "red", "grape": "purple", "lemon": "yellow",
           "lime": "green", "plum": "purple", "peach": "orange"}
WORDS = ["<pad>", EOS, "user", "assistant", "?", ".", ":", "what", "colour", "is", "the", "asks", "long", *NAMES,
         *COLOURS, *sorted(set(COLOURS.values()))]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <|endoftext|> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")
SEQ, BATCH, STEPS = 64, 16, 40
CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": len(WORDS),
          "max_position_embeddings": SEQ, "tie_word_embeddings": False}


# -- the schedule's settings ------------------------------------------------------------------------


def _task() -> TaskSpec:
    return TaskSpec(name="t", stages=[StageSpec(name="train", steps=1, sources=[DataSource(path="d.jsonl")])])


@pytest.mark.parametrize("method, lr", [("lora", 2e-4), ("qlora", 2e-4), ("full", 1e-5)])
def test_a_fine_tune_takes_fine_tuning_rates_and_a_warm_up_share(method: str, lr: float) -> None:
    stage = fine_tune_task(_task(), Layout(method=method), "base", FineTuneFlags()).stages[0]
    assert (stage.lr, stage.warmup_ratio) == (lr, 0.1)
    # a share of the steps as finally sized, rounded up, never all of them
    assert [stage.warmup_for(steps) for steps in (1, 2, 10, 40, 41, 1000)] == [0, 1, 1, 4, 5, 100]


def test_without_weights_the_task_defaults_stay_and_flags_override_both() -> None:
    stage = fine_tune_task(_task(), Layout(method="lora"), None, FineTuneFlags()).stages[0]
    assert (stage.lr, stage.warmup_ratio, stage.warmup_steps) == (3e-4, None, 20)
    assert stage.warmup_for(10) == 9  # pre-training's fixed warm-up, clamped to the stage as before
    flags = FineTuneFlags(lr=5e-5, warmup_ratio=0.25, lora_alpha=8, lora_targets=["q_proj"], packing=False)
    task = fine_tune_task(_task(), Layout(method="lora"), "base", flags)
    assert (task.stages[0].lr, task.stages[0].warmup_for(40)) == (5e-5, 10)
    assert task.adapter == AdapterSpec(alpha=8, targets=["q_proj"]) and task.packing is False
    held = fine_tune_task(_task(), Layout(method="lora"), None, FineTuneFlags(val_size=5)).stages[0]
    assert [(s.path, s.val_size, s.split) for s in held.sources] == [("d.jsonl", 5, "train")]
    assert [(s.path, s.val_size, s.split) for s in held.eval_sources] == [("d.jsonl", 5, "val")]


def test_a_lora_rank_other_than_the_plans_is_refused() -> None:
    fine_tune_task(_task(), Layout(method="lora", lora_rank=8), None, FineTuneFlags(lora_rank=8))
    with pytest.raises(UsageError, match="the plan priced LoRA rank 8; plan again with `advisor plan --lora-rank 4`"):
        fine_tune_task(_task(), Layout(method="lora", lora_rank=8), None, FineTuneFlags(lora_rank=4))
    with pytest.raises(UsageError, match="method full"):
        fine_tune_task(_task(), Layout(method="full"), None, FineTuneFlags(lora_alpha=16))


def test_lora_alpha_and_targets_reach_the_adapters() -> None:
    from trainer.model import build_model
    from specs.core import ModelSpec

    spec, layout = ModelSpec(name="tiny", hf_config=CONFIG), Layout(method="lora", lora_rank=4, dtype="fp32")
    model = build_model(spec, layout, 0, adapter=AdapterSpec(alpha=12, targets=["q_proj", "v_proj"]))
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, set(config.target_modules)) == (4, 12, {"q_proj", "v_proj"})
    adapted = {name.split(".")[-4] for name, p in model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "v_proj"}
    everywhere = build_model(spec, layout, 0)  # the default: alpha 2r, every linear of the decoder
    assert everywhere.peft_config["default"].lora_alpha == 8
    assert {name.split(".")[-4] for name, p in everywhere.named_parameters() if p.requires_grad} == \
        {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with pytest.raises(UsageError, match="LoRA targets nope"):
        build_model(spec, layout, 0, adapter=AdapterSpec(targets=["nope"]))


# -- packing, truncation, held-out rows ---------------------------------------------------------------


def _example(prompt: int, answer: int, token: int) -> tuple[list[int], list[int]]:
    return [token] * (prompt + answer), [IGNORE] * prompt + [token] * answer


def test_examples_cut_or_dropped_at_the_sequence_length_are_counted_and_packing_can_be_off() -> None:
    examples = [_example(3, 2, 1), _example(2, 1, 2), _example(10, 2, 3), _example(2, 10, 4)]
    packed = pack_examples(examples, 8)
    # 10+2 and 2+10 exceed 8 tokens: both cut; the first of them keeps no answer token and is dropped
    assert (packed.truncated, packed.dropped) == (2, 1)
    assert len(packed) == 2 and sorted(set(packed.ids[0]) - {0}) == [1, 2]  # 5 + 3 tokens share a row
    alone = pack_examples(examples, 8, packing=False)
    assert (alone.truncated, alone.dropped) == (2, 1)
    assert [sorted(set(row) - {0}) for row in alone.ids] == [[1], [2], [4]]  # one example per row


def test_val_size_holds_out_the_same_rows_for_loss_and_exact_match_and_trains_on_the_rest(tmp_path) -> None:
    rows = [{"prompt": f"q{i:02d}", "completion": f"a{i:02d}"} for i in range(20)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = TaskSpec(name="t", base_dir=str(tmp_path), packing=False,
                    stages=[StageSpec(name="s", steps=1, sources=[DataSource(path="d.jsonl")])])
    tokenizer = ByteTokenizer()

    def prompts(split: str, val_size: float) -> list[str]:
        source = DataSource(path="d.jsonl", format="prompt_completion", val_size=val_size, split=split)
        packed = load_rows(source, task, tokenizer, 16, None)
        trained = [bytes(int(t) for t in row[:3]).decode() for row in packed.ids]
        if split == "val":  # exact match reads the same held-out rows
            asked = [bytes(p).decode() for p, _ in read_answer_pairs(source, tmp_path, tokenizer, 100)]
            assert sorted(asked) == sorted(trained)
        return trained

    for val_size, held in ((0.2, 4), (5, 5)):
        train, val = prompts("train", val_size), prompts("val", val_size)
        assert len(val) == held and len(train) == 20 - held
        assert sorted(train + val) == [r["prompt"] for r in rows]
        assert prompts("val", val_size) == val  # a fixed draw
    with pytest.raises(UsageError, match="leave at least one row on each side"):
        prompts("val", 20)


# -- the command line -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_plan(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan") / "plan.yaml"
    made = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                               "--method", "lora", "--seq-len", "32", "--global-batch", "4",
                               "--fix", "dtype=fp32,tp=1,pp=1,mbs=4,gas=1,zero=0", "--top", "1", "--out", str(out)])
    assert made.exit_code == 0, made.output
    return out


@pytest.mark.parametrize("flags, message", [
    (["--lora-rank", "8"], "--lora-rank 8: the plan priced LoRA rank 16; plan again with `advisor plan --lora-rank 8`"),
    (["--warmup-ratio", "1"], "--warmup-ratio 1: must be <= 0.99"),
    (["--lr", "0"], "--lr 0: must be > 0"),
    (["--val-size", "2.5"], "--val-size 2.5: a count of rows is a whole number"),
    (["--lora-targets", ","], "--lora-targets: name at least one module"),
])
def test_bad_fine_tune_flags_are_one_line_and_exit_2(tmp_path, lora_plan: Path, flags: list[str],
                                                     message: str) -> None:
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "the cat sat"}) + "\n")
    result = runner.invoke(app, ["train", str(lora_plan), "--out", str(tmp_path / "run"), "--data",
                                 str(tmp_path / "d.jsonl"), *flags])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_lora_rank_is_planned_priced_and_checked_by_train(tmp_path) -> None:
    """The rank is a layout key: `advisor plan --lora-rank` prices it (wider adapters, more memory),
    `advisor train --lora-rank` checks it (test_bad_fine_tune_flags_are_one_line_and_exit_2)."""
    def plan(*flags: str) -> dict:
        made = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                                   "--seq-len", "32", "--global-batch", "4", "--fix", "dtype=fp32,tp=1,pp=1,mbs=4",
                                   "--top", "1", "--json", *flags])
        assert made.exit_code == 0, made.output
        return json.loads(made.stdout)["plans"][0]

    default, wide = plan("--method", "lora"), plan("--method", "lora", "--lora-rank", "64")
    assert (default["layout"]["lora_rank"], wide["layout"]["lora_rank"]) == (16, 64)
    assert wide["estimate"]["memory"]["peak"] > default["estimate"]["memory"]["peak"]
    refused = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--lora-rank", "8"])
    assert refused.exit_code == 2 and "--lora-rank sets LoRA adapters; --method full" in refused.stderr


def test_a_task_plan_refuses_the_flags_its_task_file_sets(tmp_path) -> None:
    plan = tmp_path / "plan.yaml"
    made = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                               "--task", "demo", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    result = runner.invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--lr", "1e-4", "--no-packing"])
    assert result.exit_code == 2
    assert "--lr, --no-packing set a plan made without --task" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# -- a 40-step LoRA run with the defaults learns ---------------------------------------------------------


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token=EOS, pad_token="<pad>")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)


def _sentence(rng: random.Random) -> str:
    """The base's pre-training text: questions, facts, and a fifth of word salad (a real corpus's
    variety, which keeps any word possible anywhere); never a chat, never an answer to a question."""
    if rng.random() < 0.2:
        return " ".join(rng.choice(WORDS[2:]) for _ in range(rng.randint(3, 12)))
    name, other, fruit = rng.choice(NAMES), rng.choice(NAMES), rng.choice(list(COLOURS))
    return rng.choice([f"{name} asks : what colour is the {fruit} ?", f"{name} asks {other} .",
                       f"the {fruit} is {COLOURS[fruit]} ."])


def _pretrained_base(folder: Path, rng: random.Random) -> None:
    """A tiny Llama trained on `_sentence` text for 200 steps (about 5 s on one thread)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _tokenizer(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG))
    ids = [WORDS.index(w) for _ in range(3000) for w in _sentence(rng).split() + [EOS]]
    data = torch.tensor(ids[: len(ids) // 32 * 32]).view(-1, 32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(200):
        batch = data[torch.randint(len(data), (16,))]
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)


def _conversation(rng: random.Random, prompt_words: int = 0, answer_words: int = 0) -> dict:
    name, fruit = rng.choice(NAMES), rng.choice(list(COLOURS))
    question = f"{name} asks : what colour is the {fruit} ?" + " long" * prompt_words
    return {"messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": f"the {fruit} is {COLOURS[fruit]} ." + " long" * answer_words}]}


def _answer_loss(model, tokenizer, conversations: list[dict]) -> float:
    """Mean cross-entropy of the assistant's tokens (its answer and end of text), from the logits:
    the answer is what the full conversation adds to the prompt with its generation prompt."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in conversations:
            prompt = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
            full = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
            assert full[:len(prompt)] == prompt
            ids = torch.tensor([full])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt):], reduction="sum"))
            count += len(full) - len(prompt)
    return total / count


def _expected_lr(step: int, peak: float, warmup: int, floor: float) -> float:
    """Linear warm-up to the peak over `warmup` steps, then cosine to `floor` at the run's last step."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    progress = (step - warmup) / (STEPS - 1 - warmup)
    return floor + (peak - floor) * (1 + math.cos(math.pi * progress)) / 2


@pytest.mark.slow
def test_a_40_step_lora_run_with_default_settings_learns_the_held_out_answers(tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)  # the machine's cores are shared: threads would fight
    rng = random.Random(0)
    base = tmp_path / "base"
    _pretrained_base(base, rng)
    data = tmp_path / "chat.jsonl"
    # over-long rows: prompts that fill the sequence (dropped) and answers cut at its end (truncated)
    rows = [_conversation(rng) for _ in range(960)] + [_conversation(rng, prompt_words=60) for _ in range(3)] + \
        [_conversation(rng, answer_words=50) for _ in range(2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = [_conversation(rng) for _ in range(40)]
    plan = tmp_path / "plan.yaml"
    made = runner.invoke(app, ["plan", "--model", str(base), "--hardware", "cpu", "--gpus-per-node", "1",
                               "--method", "lora", "--seq-len", str(SEQ), "--global-batch", str(BATCH),
                               "--fix", f"dtype=fp32,tp=1,pp=1,mbs={BATCH},gas=1,zero=0", "--top", "1",
                               "--out", str(plan)])
    assert made.exit_code == 0, made.output
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(run), "--data",
                           str(data), "--weights", str(base), "--steps", str(STEPS), "--exact-match-prompts", "0"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr

    tokenizer = AutoTokenizer.from_pretrained(base)
    before = _answer_loss(AutoModelForCausalLM.from_pretrained(base), tokenizer, held_out)
    after = _answer_loss(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), run / "model"),
                         tokenizer, held_out)
    assert after <= 0.7 * before, (before, after)

    lrs = [m["lr"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]
    peak, warmup = 2e-4, math.ceil(0.1 * STEPS)
    assert lrs == pytest.approx([_expected_lr(step, peak, warmup, 0.1 * peak) for step in range(STEPS)])
    assert lrs[warmup] == pytest.approx(peak) and lrs[-1] == pytest.approx(0.1 * peak)  # warmed up, decayed
    start = next(e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines())
                 if e["event"] == "stage_start")
    assert start["warmup_steps"] == warmup and start["lr"] == peak

    summary = json.loads((run / "summary.json").read_text())
    assert (summary["data"]["truncated"], summary["data"]["dropped"]) == (5, 3)
    assert summary["stages"][0]["rows"] == {"truncated": 5, "dropped": 3}
    assert "train: 5 rows truncated at the sequence length, 3 rows dropped" in done.stdout
