"""Deterministic, resumable batches for one curriculum stage.

Each source is a packed array of token sequences (n, seq). A stage mixes its own sources by weight
and replays earlier stages by share. Which source the i-th sequence of the stage comes from depends
only on (seed, stage, i); each source is read in epochs, a seeded permutation of its rows per
epoch (seed, stage, source, epoch), so that one pass over a source visits every row exactly once.
The k-th draw of a source of n rows is row perm_{k // n}[k mod n], and k is the number of earlier
positions that chose the source: a resume that knows how many sequences the stage consumed
continues with exactly the next batch, and a rollback can skip a window of data by moving the
position.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from trainer.batch import IGNORE, MicroBatch

BLOCK = 4096  # sequences whose sources are drawn in one vectorised call


@dataclass
class Packed:
    """Rows of `seq` tokens: ids, labels (-100: not trained) and positions (restarting at 0 for every
    document in a row), all (n, seq) int64; row i of each array belongs together."""

    ids: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    truncated: int = 0  # examples cut to the sequence length (their end is not trained)
    dropped: int = 0  # examples left without a trained token by that cut (an over-long prompt): not read

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def empty(cls, count: int, seq: int) -> "Packed":
        return cls(*(np.empty((count, seq), dtype=np.int64) for _ in range(3)))


@dataclass
class Source:
    name: str
    sequences: np.ndarray  # (n, seq) int64 token ids
    weight: float
    start_weight: float = 0.0  # a ramped stage's mixture at its first sequence (the previous stage's data)
    labels: np.ndarray | None = None  # (n, seq); None: every token trained
    positions: np.ndarray | None = None  # (n, seq); None: 0..seq-1 in every row
    truncated: int = 0  # examples of the source cut to the sequence length (Packed.truncated)
    dropped: int = 0  # examples of the source dropped with nothing left to train (Packed.dropped)

    @classmethod
    def of(cls, name: str, packed: Packed, weight: float) -> "Source":
        return cls(name, packed.ids, weight, labels=packed.labels, positions=packed.positions,
                   truncated=packed.truncated, dropped=packed.dropped)

    def rows(self, index: np.ndarray) -> Packed:
        """Rows `index` of ids, labels and positions (the same rows of each)."""
        ids = self.sequences[index]
        labels = self.labels[index] if self.labels is not None else ids.copy()
        positions = self.positions[index] if self.positions is not None else \
            np.broadcast_to(np.arange(ids.shape[1]), ids.shape).copy()
        return Packed(ids, labels, positions)


def _normalised(weights: list[float]) -> np.ndarray:
    total = sum(weights)
    return np.array([w / total for w in weights]) if total > 0 else np.zeros(len(weights))


class EpochOrder:
    """The row order of a stage: per position, the source (drawn by weight) and its row (the
    source's next draw, in its per-epoch permutation). With `ramp` R > 0, position i draws its source
    from the mixture start + min((i + 1) / R, 1) * (target - start): the previous stage's data turns
    into this stage's mix over its first R positions instead of switching at once.

    Both the raw sequences (StageStream) and prepared micro-batches (trainer/prepared.py) read
    their rows here, so every array indexed by a source's row (tokens, labels, positions) follows
    the same choice."""

    def __init__(self, sizes: list[int], weights: list[float], start_weights: list[float], seed: int,
                 stage_index: int, ramp: int = 0):
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.probs = _normalised(weights)
        self.start_probs = _normalised(start_weights)
        self.ramp = ramp if self.start_probs.any() else 0
        self.seed, self.stage_index = seed, stage_index
        self._which: tuple[int, np.ndarray] | None = None
        self._prefix = [np.zeros(len(sizes), dtype=np.int64)]  # draws per source before each block
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def mixture(self, positions: np.ndarray) -> np.ndarray:
        """(len(positions), sources): each position's source probabilities."""
        ramped = np.minimum((positions + 1) / self.ramp, 1.0) if self.ramp else np.ones(len(positions))
        return self.start_probs + ramped[:, None] * (self.probs - self.start_probs)

    def _block(self, block: int) -> np.ndarray:
        """The source of each position of `block` (successive steps share a block: cached)."""
        if self._which is None or self._which[0] != block:
            rng = np.random.default_rng([self.seed, self.stage_index, block])
            if self.ramp and block * BLOCK < self.ramp:
                cumulative = self.mixture(np.arange(block * BLOCK, (block + 1) * BLOCK)).cumsum(axis=1)
                which = np.minimum((rng.random(BLOCK)[:, None] >= cumulative).sum(axis=1), len(self.sizes) - 1)
            else:
                which = rng.choice(len(self.sizes), size=BLOCK, p=self.probs)
            self._which = (block, which)
        return self._which[1]

    def _draws_before_block(self, block: int) -> np.ndarray:
        """Draws per source in the blocks before `block`: counted once per block, then remembered,
        so a resume far into a stage costs one pass over the earlier blocks' source choices."""
        while len(self._prefix) <= block:
            done = len(self._prefix) - 1
            self._prefix.append(self._prefix[-1] + np.bincount(self._block(done), minlength=len(self.sizes)))
        return self._prefix[block]

    def draws_before(self, position: int) -> np.ndarray:
        """How many rows each source has given to positions 0 .. position-1."""
        block, offset = divmod(position, BLOCK)
        return self._draws_before_block(block) + np.bincount(self._block(block)[:offset], minlength=len(self.sizes))

    def permutation(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            if len(self._perms) >= 2 * len(self.sizes):  # a read spans at most two epochs of a source
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.default_rng([self.seed, self.stage_index, source, epoch, 1])
            self._perms[key] = rng.permutation(int(self.sizes[source]))
        return self._perms[key]

    def positions_for(self, epochs: float, own: list[bool]) -> int:
        """Positions over which the sources marked `own` give `epochs` times their rows, on average."""
        mine = np.asarray(own, dtype=bool)
        share = float(self.probs[mine].sum())
        if share <= 0:
            raise ValueError(f"stage {self.stage_index}: an epochs budget needs data of the stage's own")
        return max(1, math.ceil(epochs * int(self.sizes[mine].sum()) / share))

    def rows(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, row) of positions start .. start+count-1 of the stage's infinite order."""
        which_out = np.empty(count, dtype=np.int64)
        rows_out = np.empty(count, dtype=np.int64)
        position, filled = start, 0
        while filled < count:
            block, offset = divmod(position, BLOCK)
            take = min(BLOCK - offset, count - filled)
            which = self._block(block)[offset:offset + take]
            before = self.draws_before(position)
            which_out[filled:filled + take] = which
            for source, n in enumerate(self.sizes):
                at = np.flatnonzero(which == source)
                draws = before[source] + np.arange(len(at))
                epochs, within = np.divmod(draws, n)
                for epoch in np.unique(epochs):
                    mine = epochs == epoch
                    rows_out[filled + at[mine]] = self.permutation(source, int(epoch))[within[mine]]
            position += take
            filled += take
        return which_out, rows_out

    def consumed(self, position: int, skipped: list[tuple[int, int]] = ()) -> np.ndarray:
        """Rows each source gave to positions 0 .. position-1, less those in `skipped` [start, end)
        windows (data a spike rollback jumped over: never trained on)."""
        total = self.draws_before(position)
        for begin, end in skipped:
            begin, end = min(begin, position), min(end, position)
            if end > begin:
                total = total - (self.draws_before(end) - self.draws_before(begin))
        return total


class StageStream:
    """A stage's sequences in their reproducible order (EpochOrder), with `ramp_sequences` R the
    positions over which the previous stage's data turns into this stage's mix."""

    def __init__(self, sources: list[Source], seed: int, stage_index: int, ramp_sequences: int = 0):
        if not sources or any(len(s.sequences) == 0 for s in sources):
            empty = [s.name for s in sources if len(s.sequences) == 0] or ["(no sources)"]
            raise ValueError(f"stage {stage_index} has no data in {', '.join(empty)}")
        self.sources = sources
        self.seed, self.stage_index = seed, stage_index
        self.order = EpochOrder([len(s.sequences) for s in sources], [s.weight for s in sources],
                                [s.start_weight for s in sources], seed, stage_index, ramp_sequences)

    def sequences(self, start: int, count: int) -> np.ndarray:
        """Token ids of sequences start .. start+count-1 of this stage's infinite, reproducible order."""
        return self.rows(start, count).ids

    def rows(self, start: int, count: int) -> Packed:
        """Sequences start .. start+count-1 (ids, labels, positions) of this stage's infinite,
        reproducible order: the same rows of every array (EpochOrder picks them)."""
        which, rows = self.order.rows(start, count)
        out = Packed.empty(count, self.sources[0].sequences.shape[1])
        for number, source in enumerate(self.sources):
            mine = np.flatnonzero(which == number)
            picked = source.rows(rows[mine])
            out.ids[mine], out.labels[mine], out.positions[mine] = picked.ids, picked.labels, picked.positions
        return out

    def global_batch(self, position: int, dp: int, mbs: int, gas: int, rank: int, micro: int) -> MicroBatch:
        """The micro-batch `micro` of data-parallel rank `rank` for the optimizer step whose data
        starts at `position`; the step consumes dp*mbs*gas sequences. Laid out so that one rank
        with dp x gas accumulation sees the same sequences per step as dp ranks."""
        first = position + (micro * dp + rank) * mbs
        rows = self.rows(first, mbs)
        return MicroBatch.from_arrays(rows.ids, rows.labels, rows.positions)

    def epochs(self, position: int, skipped: list[tuple[int, int]] = ()) -> dict[str, float]:
        """Passes over each source that positions 0 .. position-1 made (skipped windows left out)."""
        consumed = self.order.consumed(position, skipped)
        return {s.name: float(c) / len(s.sequences) for s, c in zip(self.sources, consumed)}

    def positions_for(self, epochs: float, stage: str) -> int:
        """Positions (sequences) after which the stage's own sources have made `epochs` passes on
        average: their rows times `epochs`, over their share of the mixture (replay takes the rest)."""
        return self.order.positions_for(epochs, [_owned(s.name, stage) for s in self.sources])


def _owned(source_name: str, stage: str) -> bool:
    """Whether a source (named `stage:path`, or `stage` for prepared data) is the stage's own data."""
    return source_name == stage or source_name.startswith(stage + ":")


def pack_stream(documents: list[tuple[list[int], list[int]]], seq: int) -> Packed:
    """Continued pre-training (text rows): the documents concatenated and cut into full rows of
    `seq` tokens, no padding; the tail that does not fill a row is dropped. A document longer than
    the room left in its row is cut there and goes on at the start of the next row (each piece sees
    only itself). Positions restart at every document's first token and at every row's start, so
    that no document attends to another; a document's first token has no label (nothing of its own
    document predicts it)."""
    if not documents:
        return Packed.empty(0, seq)
    ids = np.fromiter((t for doc, _ in documents for t in doc), dtype=np.int64)
    labels = np.fromiter((t for _, lab in documents for t in lab), dtype=np.int64, count=len(ids))
    starts = np.zeros(len(ids), dtype=bool)
    starts[np.cumsum([0] + [len(doc) for doc, _ in documents[:-1]])] = True
    usable = len(ids) // seq * seq
    ids, labels, starts = ids[:usable], labels[:usable], starts[:usable]
    labels[starts] = IGNORE
    starts[::seq] = True  # rows start documents too (pieces of a cut one)
    index = np.arange(usable)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0))
    return Packed(ids.reshape(-1, seq), labels.reshape(-1, seq), positions.reshape(-1, seq))


def pack_examples(examples: list[tuple[list[int], list[int]]], seq: int, pad_id: int = 0,
                  packing: bool = True) -> Packed:
    """Supervised examples (prompt and answer) kept whole in rows of `seq` tokens, right-padded
    (padding: `pad_id`, label -100). Several examples share a row, best fit in their order (each
    into the fullest row it still fits); without `packing`, each has a row of its own. Positions
    restart at every example, padding included (its own segment), so that no example attends to
    another; an example's first token has no label. An example longer than `seq` keeps its first
    `seq` tokens (the end of a long answer is lost); one left without any trained token is dropped.
    Both are counted (`Packed.truncated`, `Packed.dropped`)."""
    truncated = sum(len(ids) > seq for ids, _ in examples)
    cut = [(ids[:seq], labels[:seq]) for ids, labels in examples]
    examples = [(ids, [IGNORE] + labels[1:]) for ids, labels in cut if any(x != IGNORE for x in labels[1:])]
    rows: list[list[int]] = []  # example indices per row
    room: list[tuple[int, int]] = []  # (free tokens, row), sorted: the open rows
    for number, (ids, _) in enumerate(examples):
        slot = bisect.bisect_left(room, (len(ids), -1)) if packing else len(room)
        if slot < len(room):
            free, row = room.pop(slot)
        else:
            free, row = seq, len(rows)
            rows.append([])
        rows[row].append(number)
        if packing and free - len(ids) > 0:
            bisect.insort(room, (free - len(ids), row))
    out = Packed(np.full((len(rows), seq), pad_id, dtype=np.int64), np.full((len(rows), seq), IGNORE, dtype=np.int64),
                 np.zeros((len(rows), seq), dtype=np.int64), truncated, len(cut) - len(examples))
    for r, members in enumerate(rows):
        col = 0
        for number in members:
            ids, labels = examples[number]
            out.ids[r, col:col + len(ids)] = ids
            out.labels[r, col:col + len(ids)] = labels
            out.positions[r, col:col + len(ids)] = np.arange(len(ids))
            col += len(ids)
        out.positions[r, col:] = np.arange(seq - col)
    return out
