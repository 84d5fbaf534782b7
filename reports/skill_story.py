"""What a staged run did to each skill: learned in its own stage, forgotten in the later ones, healed
by the closing mixed stage, in exact match and eval loss.

The trainer evaluates every skill seen so far at each stage end (a skill is named after the stage
that brings its eval data). For each skill this reads: the scores after its own stage; the worst
after a later stage before the closing one (the lowest exact match, else the highest loss); the
scores at the end. Forgetting is how much the worst fell below its own stage's (exact match, points)
or rose above it (loss); healed is how much the closing mixed stage gave back of that. A closing
mixed stage is a last stage that brings no skill of its own (the source article's shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Scores:
    stage: str
    exact_match: float | None  # share of held-out answers right; None: not scored
    loss: float | None


@dataclass
class SkillStory:
    skill: str
    own: Scores  # after its own stage
    worst: Scores | None  # after the later stage (before a closing mixed stage) where it was worst
    end: Scores  # after the last stage
    mixed: str | None  # the closing mixed stage, when the run has one

    def forgetting(self) -> Scores | None:
        """The drop from its own stage to the worst later one: exact match lost (points of 1), loss gained."""
        if self.worst is None:
            return None
        return Scores(self.worst.stage, _minus(self.own.exact_match, self.worst.exact_match),
                      _minus(self.worst.loss, self.own.loss))

    def healed(self) -> Scores | None:
        """What the closing mixed stage gave back from the worst: exact match regained, loss fallen."""
        if self.worst is None or self.mixed is None:
            return None
        return Scores(self.mixed, _minus(self.end.exact_match, self.worst.exact_match),
                      _minus(self.worst.loss, self.end.loss))


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def stage_scores(stages: list[dict[str, Any]]) -> list[tuple[str, dict[str, Scores]]]:
    """Per stage end, in order: each skill's scores, from summary.json's `stages` entries (`name`,
    `eval`: losses, `exact_match`)."""
    out = []
    for stage in stages:
        losses, exact = stage.get("eval") or {}, stage.get("exact_match") or {}
        skills = list(dict.fromkeys([*losses, *exact]))
        out.append((str(stage["name"]), {skill: Scores(str(stage["name"]), _number(exact.get(skill)),
                                                       _number(losses.get(skill))) for skill in skills}))
    return out


def _worse(a: Scores, b: Scores) -> bool:
    """Whether `a` is worse than `b`: lower exact match where both have one, else higher loss."""
    if a.exact_match is not None and b.exact_match is not None and a.exact_match != b.exact_match:
        return a.exact_match < b.exact_match
    return a.loss is not None and b.loss is not None and a.loss > b.loss


def skill_stories(stages: list[dict[str, Any]]) -> list[SkillStory]:
    """One story per skill whose own stage is not the last (a skill trained last has nothing after it)."""
    ordered = stage_scores(stages)
    names = [name for name, _ in ordered]
    if len(ordered) < 2:
        return []
    mixed = names[-1] if names[-1] not in ordered[-1][1] else None
    stories = []
    for index, (name, scores) in enumerate(ordered[:-1]):
        if name not in scores:
            continue  # a stage without eval data of its own
        later = [s[name] for _, s in ordered[index + 1:len(ordered) - (mixed is not None)] if name in s]
        worst = None
        for candidate in later:
            worst = candidate if worst is None or _worse(candidate, worst) else worst
        end = ordered[-1][1].get(name)
        if end is not None:
            stories.append(SkillStory(name, scores[name], worst, end, mixed))
    return stories


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def story_line(story: SkillStory) -> str:
    """One console line: the skill after its stage, at its worst later, and at the end."""
    def both(s: Scores) -> str:
        shown = [f"exact match {percent(s.exact_match)}"] if s.exact_match is not None else []
        shown += [f"loss {s.loss:.3f}"] if s.loss is not None else []
        return f"{', '.join(shown) or 'n/a'} after {s.stage}"

    parts = [f"{story.skill}: {both(story.own)}"]
    forgot, healed = story.forgetting(), story.healed()
    if story.worst is not None and forgot is not None:
        drop = f"-{100 * forgot.exact_match:.1f} points" if forgot.exact_match is not None else \
            f"loss +{forgot.loss:.3f}" if forgot.loss is not None else "n/a"
        parts.append(f"forgot to {both(story.worst)} ({drop})")
    if healed is not None:
        back = f"+{100 * healed.exact_match:.1f} points" if healed.exact_match is not None else \
            f"loss -{healed.loss:.3f}" if healed.loss is not None else "n/a"
        parts.append(f"healed to {both(story.end)} ({back})")
    elif story.worst is None or story.end.stage != story.worst.stage:
        parts.append(f"ended at {both(story.end)}")
    return "; ".join(parts)
