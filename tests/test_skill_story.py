"""A staged run's story per skill (reports/skill_story.py), on the console (advisor/cli/render.py) and
in the run report: the numbers are the stage-end evaluations' own, worked out by hand below."""

from __future__ import annotations

import pytest

from advisor.cli.render import stage_results_lines
from reports.skill_story import skill_stories

# a curriculum's stage ends: reasoning learned (60%), forgotten under instructions (10%), healed by
# the mixed stage (55%); instructions learned last; language scored by loss only
STAGES = [
    {"name": "language", "eval": {"language": 3.0}, "exact_match": {"language": None}},
    {"name": "reasoning", "eval": {"language": 3.4, "reasoning": 1.0},
     "exact_match": {"language": None, "reasoning": 0.6}},
    {"name": "instructions", "eval": {"language": 3.6, "reasoning": 2.0, "instructions": 0.5},
     "exact_match": {"language": None, "reasoning": 0.1, "instructions": 0.8}},
    {"name": "mixed", "eval": {"language": 3.1, "reasoning": 1.1, "instructions": 0.6},
     "exact_match": {"language": None, "reasoning": 0.55, "instructions": 0.75}},
]


def test_each_skill_is_read_after_its_stage_at_its_worst_and_at_the_end() -> None:
    stories = {s.skill: s for s in skill_stories(STAGES)}
    assert set(stories) == {"language", "reasoning", "instructions"}
    reasoning = stories["reasoning"]
    assert (reasoning.own.exact_match, reasoning.own.loss) == (0.6, 1.0)
    assert (reasoning.worst.stage, reasoning.worst.exact_match, reasoning.worst.loss) == ("instructions", 0.1, 2.0)
    assert reasoning.mixed == "mixed" and (reasoning.end.exact_match, reasoning.end.loss) == (0.55, 1.1)
    forgot, healed = reasoning.forgetting(), reasoning.healed()
    assert forgot.exact_match == pytest.approx(0.5) and forgot.loss == pytest.approx(1.0)
    assert healed.exact_match == pytest.approx(0.45) and healed.loss == pytest.approx(0.9)
    # language has no exact match: its worst is by loss (3.6 after instructions, not 3.4)
    language = stories["language"]
    assert language.worst.stage == "instructions" and language.forgetting().exact_match is None
    assert language.forgetting().loss == pytest.approx(0.6) and language.healed().loss == pytest.approx(0.5)
    # trained last before the mixed stage: nothing between, so nothing forgotten or healed
    assert stories["instructions"].worst is None and stories["instructions"].healed() is None


def test_without_a_closing_mixed_stage_the_end_counts_as_later() -> None:
    stories = {s.skill: s for s in skill_stories(STAGES[:3])}
    assert set(stories) == {"language", "reasoning"}
    assert stories["reasoning"].mixed is None and stories["reasoning"].healed() is None
    assert stories["reasoning"].forgetting().exact_match == pytest.approx(0.5)


def test_the_console_shows_exact_match_loss_forgetting_and_healing_per_stage() -> None:
    lines = stage_results_lines({"stages": STAGES})
    assert lines[1] == "after reasoning: exact match language n/a, reasoning 60.0%; eval loss language 3.400, " \
                       "reasoning 1.000"
    story = next(line for line in lines if line.startswith("reasoning:"))
    assert "exact match 60.0%, loss 1.000 after reasoning" in story
    assert "forgot to exact match 10.0%, loss 2.000 after instructions (-50.0 points)" in story
    assert "healed to exact match 55.0%, loss 1.100 after mixed (+45.0 points)" in story
