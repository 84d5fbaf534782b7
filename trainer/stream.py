"""Deterministic, resumable batches for one curriculum stage.

Each source is a packed array of token sequences (n, seq). A stage mixes its own sources by weight
and replays earlier stages by share. Which source the i-th sequence of the stage comes from, and
which of that source's sequences it is, depends only on (seed, stage, i): a resume that knows how
many sequences the stage consumed continues with exactly the next batch, and a rollback can skip a
window of data by moving the position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BLOCK = 4096  # sequences whose sources are drawn in one vectorised call


@dataclass
class Source:
    name: str
    sequences: np.ndarray  # (n, seq) int64 token ids
    weight: float
    start_weight: float = 0.0  # a ramped stage's mixture at its first sequence (the previous stage's data)


def _normalised(weights: list[float]) -> np.ndarray:
    total = sum(weights)
    return np.array([w / total for w in weights]) if total > 0 else np.zeros(len(weights))


class StageStream:
    """With `ramp_sequences` R > 0, sequence i of the stage is drawn from the mixture
    start + min((i + 1) / R, 1) * (target - start): the previous stage's data turns into this
    stage's mix over its first R sequences instead of switching at once."""

    def __init__(self, sources: list[Source], seed: int, stage_index: int, ramp_sequences: int = 0):
        if not sources or any(len(s.sequences) == 0 for s in sources):
            empty = [s.name for s in sources if len(s.sequences) == 0] or ["(no sources)"]
            raise ValueError(f"stage {stage_index} has no data in {', '.join(empty)}")
        self.sources = sources
        self.probs = _normalised([s.weight for s in sources])
        self.start_probs = _normalised([s.start_weight for s in sources])
        self.ramp = ramp_sequences if self.start_probs.any() else 0
        self.seed = seed
        self.stage_index = stage_index
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None

    def mixture(self, positions: np.ndarray) -> np.ndarray:
        """(len(positions), sources): each sequence's source probabilities."""
        ramped = np.minimum((positions + 1) / self.ramp, 1.0) if self.ramp else np.ones(len(positions))
        return self.start_probs + ramped[:, None] * (self.probs - self.start_probs)

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        if self._cached is None or self._cached[0] != block:  # successive steps share a block
            rng = np.random.default_rng([self.seed, self.stage_index, block])
            if self.ramp and block * BLOCK < self.ramp:
                cumulative = self.mixture(np.arange(block * BLOCK, (block + 1) * BLOCK)).cumsum(axis=1)
                which = np.minimum((rng.random(BLOCK)[:, None] >= cumulative).sum(axis=1), len(self.sources) - 1)
            else:
                which = rng.choice(len(self.sources), size=BLOCK, p=self.probs)
            draws = rng.random(BLOCK)
            self._cached = (block, which, draws)
        return self._cached[1], self._cached[2]

    def sequences(self, start: int, count: int) -> np.ndarray:
        """Sequences start .. start+count-1 of this stage's infinite, reproducible order."""
        out = np.empty((count, self.sources[0].sequences.shape[1]), dtype=self.sources[0].sequences.dtype)
        position, filled = start, 0
        while filled < count:
            block, offset = divmod(position, BLOCK)
            which, draws = self._block(block)
            take = min(BLOCK - offset, count - filled)
            which, draws = which[offset:offset + take], draws[offset:offset + take]
            for number, source in enumerate(self.sources):
                rows = np.flatnonzero(which == number)
                # sampled with replacement: any position is computable without the ones before
                out[filled + rows] = source.sequences[(draws[rows] * len(source.sequences)).astype(np.int64)]
            position += take
            filled += take
        return out

    def global_batch(self, position: int, dp: int, mbs: int, gas: int, rank: int, micro: int) -> np.ndarray:
        """The micro-batch `micro` of data-parallel rank `rank` for the optimizer step whose data
        starts at `position`; the step consumes dp*mbs*gas sequences. Laid out so that one rank
        with dp x gas accumulation sees the same sequences per step as dp ranks."""
        first = position + (micro * dp + rank) * mbs
        return self.sequences(first, mbs)


def pack(token_lists: list[list[int]], seq: int, eos: int) -> np.ndarray:
    """Concatenate documents (each closed by `eos`) and cut into full sequences of `seq` tokens;
    packing wastes no compute on padding. The tail that does not fill a sequence is dropped."""
    flat: list[int] = []
    for tokens in token_lists:
        flat.extend(tokens)
        flat.append(eos)
    usable = len(flat) // seq * seq
    return np.asarray(flat[:usable], dtype=np.int64).reshape(-1, seq)
