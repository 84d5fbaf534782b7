"""How several datasets of one stage mix, as LLaMA-Factory's `mix_strategy` and `datasets`'
`interleave_datasets` mean it.

- `concat` (the default, what LLaMA-Factory and Axolotl do): every row of every dataset once per
  pass; each dataset weighed by the sequences it packs into, so the shuffled stream draws them in
  proportion. One pass: all their sequences.
- `interleave` (`interleave_under`): each sequence comes from dataset i with probability p_i
  (`--mix-probs`, default equal); one pass ends when the first dataset runs out, after
  min_i(n_i / p_i) sequences.
- `interleave_over`: the same draws; one pass ends when the last dataset runs out, after
  max_i(n_i / p_i) sequences (the smaller datasets repeat, in a new order each time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specs.errors import UsageError

MIXES = ("concat", "interleave", "interleave_under", "interleave_over")
PROBABILITY_SUM_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Reading:
    """How a one-stage run reads raw datasets (`advisor train`'s flags): how several mix and which
    tokens train, on top of what each source says (trainer/one_stage.py applies it)."""

    mix: str = "concat"
    mix_probs: tuple[float, ...] | None = None
    train_on_prompt: bool = False
    mask_history: bool = False


def parse_probabilities(text: str | None) -> list[float] | None:
    """`--mix-probs 0.7,0.3` as numbers, each in (0, 1]."""
    if text is None:
        return None
    try:
        probs = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--mix-probs {text}: give numbers separated by commas, e.g. 0.7,0.3") from None
    if not probs or any(not (0 < p <= 1) for p in probs):
        raise UsageError(f"--mix-probs {text}: each probability must be in (0, 1]")
    return probs


def check_mix(mix: str, probs: list[float] | None, epochs: float | None) -> None:
    """A mix the stage can honour, before any data is read."""
    if mix not in MIXES:
        raise UsageError(f"--mix {mix}: choose {', '.join(MIXES)}")
    if probs is not None and mix == "concat":
        raise UsageError("--mix-probs goes with --mix interleave (concatenated datasets are drawn by their size)")
    if probs is not None and abs(sum(probs) - 1) > PROBABILITY_SUM_TOLERANCE:
        raise UsageError(f"--mix-probs sum to {sum(probs):g}, not 1")
    if epochs is not None and mix != "concat":
        raise UsageError("--epochs counts passes over concatenated datasets; an interleaved mix is sized by "
                         "--steps or --tokens, or by default runs until its first (interleave_over: last) "
                         "dataset runs out")


def mixture(mix: str, probs: list[float] | None, counts: list[int]) -> tuple[list[float], int]:
    """Each dataset's weight in the stage and the sequences of one pass, from the sequences each packs into."""
    if mix == "concat":
        return [float(n) for n in counts], sum(counts)
    probs = probs if probs is not None else [1 / len(counts)] * len(counts)
    if len(probs) != len(counts):
        raise UsageError(f"--mix-probs gives {len(probs)} probabilities for {len(counts)} datasets")
    passes = [n / p for n, p in zip(counts, probs)]
    return list(probs), math.ceil(max(passes) if mix == "interleave_over" else min(passes))
