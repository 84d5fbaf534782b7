"""The embedded demo's data: deterministic, correct answers, sized to demo.yaml, and its tokenizer.

Truths: Python itself recomputes every arithmetic answer and every instruction's response; the
token budgets come from presets/tasks/demo.yaml; demo-tiny's vocab_size from its preset.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from advisor.cli import app
from presets import load_task
from presets import load_model
from trainer.data.demo_corpus import DEMO_FILES, generate_demo_corpus, iter_documents
from trainer.data.tokenizer import TOKENIZERS_DIR, load_demo_tokenizer, train_demo_tokenizer

SCALE = 0.25


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("demo")
    result = CliRunner().invoke(app, ["data", "generate-demo", "--out", str(folder), "--scale", str(SCALE)])
    assert result.exit_code == 0, result.output
    return folder


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_path_of_the_demo_task_is_generated(demo_dir: Path) -> None:
    task = load_task(str(demo_dir / "task.yaml"))
    assert [s.name for s in task.stages] == ["language", "reasoning", "instructions", "mixed"]
    for stage in task.stages:
        for source in [*stage.sources, *stage.eval_sources]:
            assert (demo_dir / source.path).is_file(), source.path


def test_generation_is_deterministic_in_the_seed(tmp_path: Path, demo_dir: Path) -> None:
    generate_demo_corpus(tmp_path / "again", seed=0, scale=SCALE, write_task=False)
    generate_demo_corpus(tmp_path / "other", seed=1, scale=SCALE, write_task=False)
    for name in DEMO_FILES:
        same = (tmp_path / "again" / "data" / name).read_bytes()
        assert same == (demo_dir / "data" / name).read_bytes()
        assert same != (tmp_path / "other" / "data" / name).read_bytes()


def test_arithmetic_answers_and_bands_are_right(demo_dir: Path) -> None:
    rows = read(demo_dir / "data" / "arithmetic.jsonl")
    assert {r["carry"] for r in rows} == {0, 1}
    for row in rows:
        a, op, b, answer = re.fullmatch(r"Q: (\d)([+-])(\d)=\? A: (\d+)", row["text"]).groups()
        assert (row["prompt"], row["completion"]) == (f"Q: {a}{op}{b}=? A:", f" {answer}")  # scored by exact match
        truth = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert int(answer) == truth >= 0 and row["carry"] == (truth > 9)


def test_instruction_responses_are_right(demo_dir: Path) -> None:
    from trainer.data.demo_corpus import NOUNS

    opposite = {"big": "small", "old": "new", "happy": "sad", "bright": "dark", "warm": "cold", "quick": "slow",
                "loud": "quiet", "hard": "soft", "tall": "short", "heavy": "light", "wild": "calm", "sweet": "sharp"}
    opposite.update({b: a for a, b in list(opposite.items())})
    rows = read(demo_dir / "data" / "instructions.jsonl") + read(demo_dir / "data" / "mixed.jsonl")
    assert {r["kind"] for r in rows} == {"opposite", "repeat", "next"}
    for row in rows:
        instruction, response = re.fullmatch(r"Instruction: (.+)\nResponse: (.*)", row["text"]).groups()
        assert (row["prompt"], row["completion"]) == (f"Instruction: {instruction}\nResponse:", f" {response}")
        word = re.fullmatch(r"(?:give the opposite of|repeat the word|count on from) (\w+)\.", instruction).group(1)
        if row["kind"] == "opposite":
            assert response == opposite[word]
        elif row["kind"] == "repeat":
            assert response == word and word in NOUNS
        else:
            assert int(response) == int(word) + 1


def test_train_files_hold_about_the_stage_budgets(demo_dir: Path) -> None:
    """One pass over each stage's own data is its budget (mixed: 40% of it, replay brings the rest)."""
    tok = load_demo_tokenizer()
    task = load_task(str(demo_dir / "task.yaml"))
    for stage in task.stages:
        texts = [r["text"] for s in stage.sources for r in read(demo_dir / s.path)]
        tokens = sum(len(ids) + 1 for ids in tok(texts, add_special_tokens=False)["input_ids"])
        expected = stage.tokens * (1 - sum(stage.replay.values())) * SCALE
        assert tokens == pytest.approx(expected, rel=0.15), stage.name
        for source in stage.eval_sources:
            eval_texts = [r["text"] for r in read(demo_dir / source.path)]
            eval_tokens = sum(len(ids) + 1 for ids in tok(eval_texts, add_special_tokens=False)["input_ids"])
            assert eval_tokens >= stage.eval_tokens * SCALE


def test_demo_tokenizer_fits_demo_tiny_and_round_trips() -> None:
    tok = load_demo_tokenizer()
    assert len(tok) == load_model("demo-tiny").hf_config["vocab_size"] == 2048
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id is not None
    samples = [next(iter_documents(name))["text"] for name in DEMO_FILES] + ["naïve café, 日本語 🙂\t\n  x"]
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert max(ids) < 2048 and tok.decode(ids) == text
    language = next(iter_documents("language.jsonl"))["text"]
    assert len(tok(language)["input_ids"]) < len(language.encode()) / 3  # BPE merges: far fewer ids than bytes


def test_shipped_tokenizer_is_what_the_code_trains(tmp_path: Path) -> None:
    train_demo_tokenizer(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (TOKENIZERS_DIR / "demo-tiny" / "tokenizer.json").read_bytes()


def test_every_held_out_prompt_is_scorable_and_answered_by_its_stage_data(demo_dir: Path) -> None:
    """What exact match reads (the scorer's own pairs) is what training saw, token for token, and each
    held-out prompt's one right answer is in its stage's training file: a model that learnt the skill
    from its stage can score 100%."""
    from trainer.corpus import read_answer_pairs

    tok = load_demo_tokenizer()
    task = load_task(str(demo_dir / "task.yaml"))
    scored = {}
    for stage in task.stages:
        trained = {r["prompt"]: r["completion"] for s in stage.sources for r in read(demo_dir / s.path) if "prompt" in r}
        for source in stage.eval_sources:
            rows = read(demo_dir / source.path)
            pairs = read_answer_pairs(source, demo_dir, tok, len(rows))
            if source.format == "text":
                assert pairs == []  # language has nothing to match
                continue
            assert len(pairs) == len(rows)
            for row, (prompt, answer) in zip(rows, pairs):
                as_trained = tok(row["text"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                assert [*prompt, *answer] == as_trained
                assert tok.decode(answer[:-1]) == row["completion"] == trained[row["prompt"]]
            scored[stage.name] = len(rows)
    assert set(scored) == {"reasoning", "instructions"} and min(scored.values()) >= 64  # --exact-match-prompts
