"""A planted low-quality set is filtered by the task file's thresholds, and only it.

The truth is a plain per-character recount in this file (str.isalpha and friends), checked in the
order the thresholds are listed; the stage-level override turns one threshold off.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import yaml

from specs.task import QualityFilters
from presets import load_task
from trainer.data.prepare import prepare
from trainer.data.quality import CHECKS, document_stats, merge_filters
from trainer.data.dedup import words
from trainer.data.shards import load_shard
from trainer.data.tokenizer import load_demo_tokenizer

FILTERS = {"min_chars": 20, "max_chars": 600, "min_tokens": 8, "min_alpha_ratio": 0.7, "max_digit_ratio": 0.2,
           "max_bad_char_ratio": 0.0, "max_top_word_ratio": 0.3}


def corpus(seed: int = 11) -> list[str]:
    rng = random.Random(seed)
    vocab = ["river", "stone", "garden", "quiet", "morning", "letter", "window", "yellow", "castle", "market",
             "teacher", "bright", "travel", "summer", "forest", "silver", "harbour", "village", "gentle", "paper"]

    def good() -> str:
        return " ".join(rng.sample(vocab, rng.randint(6, 14))).capitalize() + "."

    docs = [good() for _ in range(80)]
    docs += ["Too short.", "Tiny one"]                                    # min_chars
    docs += [" ".join(rng.choice(vocab) for _ in range(120))]             # max_chars (and repetitive)
    docs += ["%%% ### @@@ !!! river ??? *** ^^^ stone &&& $$$"]           # letters share
    docs += ["Garden market village."]                                    # min_tokens (known words: few tokens)
    docs += ["Invoice number 2023 for the garden market totals 882134"]   # digits share
    docs += ["Broken \ufffd text with a replacement character inside"]    # bad characters
    docs += ["Control \x07 bell character in the middle of text here"]
    docs += ["spam spam spam spam spam buy now spam spam spam"]           # repetition
    rng.shuffle(docs)
    return docs


def expected_reason(text: str, tokens: int, filters: dict) -> str | None:
    """Recount by hand; the first failing threshold in CHECKS order names the drop."""
    stripped = text.strip()
    non_space = [c for c in text if not c.isspace()]
    alpha = sum(c.isalpha() for c in non_space) / len(non_space)
    digit = sum(c.isdecimal() for c in non_space) / len(non_space)
    bad = sum(c == "\ufffd" or (ord(c) < 32 and c not in "\t\n\r") or 127 <= ord(c) < 160 for c in text) / len(text)
    ws = [w.lower() for w in __import__("re").findall(r"\w+", text)]
    top = max(Counter(ws).values()) / len(ws)
    checks = {"min_chars": len(stripped) < filters.get("min_chars", -1),
              "max_chars": len(stripped) > filters.get("max_chars", 10**9),
              "min_tokens": tokens < filters.get("min_tokens", -1),
              "max_tokens": tokens > filters.get("max_tokens", 10**9),
              "min_alpha_ratio": "min_alpha_ratio" in filters and alpha < filters["min_alpha_ratio"],
              "max_digit_ratio": "max_digit_ratio" in filters and digit > filters["max_digit_ratio"],
              "max_bad_char_ratio": "max_bad_char_ratio" in filters and bad > filters["max_bad_char_ratio"],
              "max_top_word_ratio": "max_top_word_ratio" in filters and top > filters["max_top_word_ratio"]}
    return next((f"quality:{name}" for name in CHECKS if checks[name]), None)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("quality")
    docs = corpus()
    (tmp / "mixed.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    relaxed = {"max_digit_ratio": None}  # the second stage lets digit-heavy documents through
    task = {"name": "quality", "model": "demo-tiny", "seq_len": 1024,
            "data": {"filters": FILTERS, "dedup": {"exact": False, "near": False}},
            "stages": [{"name": "strict", "tokens": 1000, "sources": [{"path": "mixed.jsonl"}]},
                       {"name": "relaxed", "tokens": 1000, "sources": [{"path": "mixed.jsonl", "filters": relaxed}]}]}
    (tmp / "task.yaml").write_text(yaml.safe_dump(task))
    out, manifest = prepare(load_task(str(tmp / "task.yaml")))
    tok = load_demo_tokenizer()
    tokens = [len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in docs]  # + end of text
    return out, manifest, docs, tokens


@pytest.mark.parametrize("stage_index,overrides", [(0, {}), (1, {"max_digit_ratio": None})])
def test_planted_low_quality_documents_are_dropped_by_the_thresholds(run, stage_index, overrides) -> None:
    out, manifest, docs, tokens = run
    filters = {k: v for k, v in {**FILTERS, **overrides}.items() if v is not None}
    reasons = [expected_reason(t, n, filters) for t, n in zip(docs, tokens)]
    stage = manifest["stages"][stage_index]
    assert stage["train"]["dropped"] == dict(sorted(Counter(r for r in reasons if r).items()))
    kept = set()
    for shard in stage["train"]["shards"]:
        kept |= set(load_shard(out / shard["path"])["row"])
    assert kept == {i for i, r in enumerate(reasons) if r is None}
    assert len(set(reasons) - {None}) >= 6  # the planted set exercises most thresholds


def test_character_statistics_match_a_plain_recount() -> None:
    texts = ["Hello, world 42!", "", "   ", "naïve café ½ ٣", "tab\tok\x00", "日本語のテキスト 🙂 x"]
    stats = document_stats(texts, [words(t) for t in texts])
    for i, text in enumerate(texts):
        non_space = [c for c in text if not c.isspace()]
        n = len(non_space) or 1
        assert stats["chars"][i] == len(text.strip())
        assert stats["alpha_ratio"][i] == pytest.approx(sum(c.isalpha() for c in non_space) / n if non_space else 0)
        assert stats["digit_ratio"][i] == pytest.approx(sum(c.isdecimal() for c in non_space) / n if non_space else 0)
    assert stats["bad_ratio"][4] == pytest.approx(1 / 7)


def test_stage_and_source_overrides_change_only_the_keys_they_name() -> None:
    task_wide = QualityFilters(min_chars=10, max_digit_ratio=0.2)
    stage = QualityFilters.model_validate({"min_chars": 50})
    source = QualityFilters.model_validate({"max_digit_ratio": None})
    merged = merge_filters(task_wide, stage, source)
    assert (merged.min_chars, merged.max_digit_ratio, merged.min_tokens) == (50, None, task_wide.min_tokens)
