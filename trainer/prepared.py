"""Length-bucketed, resumable micro-batches from the shards of `advisor data prepare`.

Where the raw path (trainer/corpus.py) concatenates documents and cuts full sequences, prepared
data keeps each sample whole (documents longer than seq_len were cut into pieces by `prepare`) and
batches it with samples of similar length: a micro-batch comes from one length bucket of edge e
and holds at most mbs*seq token slots, i.e. max(1, mbs*seq // e) rows; short samples are packed
first-fit into a row while they fit, and the rows are trimmed to the longest one. The rest is
padding, marked -1 in the shards' rows: it becomes token 0 with label -100 (no loss), and the samples
sharing a row are kept apart by position ids that restart at each (trainer/batch.py). Right padding
needs no attention mask under causal attention.

Determinism: each source's micro-batches are laid out once from a seeded shuffle; the k-th
micro-batch of a stage picks its source by weight and that source's next micro-batch in its
per-epoch permutation, from (seed, stage, k) alone, as trainer/stream.py does for sequences. A resume that knows the
stage's position continues with exactly the next micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from specs.errors import UsageError
from specs.task import TaskSpec
from trainer.data.manifest import default_out_dir, read_manifest, task_fingerprint
from trainer.batch import MicroBatch
from trainer.data.shards import stage_shards
from trainer.stream import EpochOrder

PAD = -1


def prepared_dir(task: TaskSpec, explicit: str | None, seq: int, vocab_size: int) -> Path | None:
    """The prepared-data folder to train from: `explicit` (`advisor train --data DIR`), else the
    task's `data.out` when a fresh manifest is there (the one `advisor plan --task` sized the
    stages from), else None (train from the raw sources)."""
    folder = Path(explicit) if explicit else default_out_dir(task)
    if not explicit and not (folder / "manifest.json").is_file():
        return None
    manifest = read_manifest(folder)  # explicit and missing: a one-line UsageError
    problem = None
    if manifest.get("fingerprint") != task_fingerprint(task):
        problem = ("is stale (the task's data settings or source files changed): "
                   f"run `advisor data prepare --task TASK --out {folder}` again")
    elif int(manifest["seq_len"]) != seq:
        problem = f"has seq_len {manifest['seq_len']}, the plan {seq}"
    elif int(manifest["tokenizer"]["vocab_size"]) > vocab_size:
        problem = f"uses {manifest['tokenizer']['vocab_size']} token ids, the model has {vocab_size}"
    if problem is None:
        return folder
    if explicit:
        raise UsageError(f"prepared data in {folder} {problem}")
    return None  # not asked for: train from the raw sources, as the plan did


def mask_padding(model: torch.nn.Module) -> Any:
    """A forward pre-hook: ids < 0 become token 0 with label -100. The engines call
    model(input_ids=x, labels=x); the hook keeps them unaware of padding and leaves the state dict
    (checkpoints) untouched."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ids = kwargs.get("input_ids")
        if ids is not None:
            pad = ids < 0
            kwargs["labels"] = ids.masked_fill(pad, -100)
            kwargs["input_ids"] = ids.masked_fill(pad, 0)
        return args, kwargs

    return model.register_forward_pre_hook(hook, with_kwargs=True)


@dataclass
class Samples:
    """The samples of one shard: token ids flat, with offsets (an Arrow list column as numpy)."""

    values: np.ndarray
    offsets: np.ndarray
    edge: int

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.values[self.offsets[index]:self.offsets[index + 1]]


def read_shard(path: str, edge: int) -> Samples:
    with pa.OSFile(path, "rb") as f:
        column = pa.ipc.open_stream(f).read_all().column("input_ids").combine_chunks()
    offsets = np.asarray(column.offsets, dtype=np.int64)
    values = np.asarray(column.values, dtype=np.int64)
    return Samples(values[offsets[0]:], offsets - offsets[0], edge)


class BucketedSource:
    """One stage's train shards laid out as micro-batches of at most `budget` token slots."""

    def __init__(self, name: str, shards: list[Samples], budget: int, seq: int, rng: np.random.Generator):
        self.name, self.shards, self.seq = name, shards, seq
        rows_of, shard_of, start_of, count_of = [], [], [], []
        order, row, col = [], [], []
        for s, shard in enumerate(shards):
            lengths = shard.lengths
            if not len(lengths):
                continue
            max_rows = max(1, budget // shard.edge)
            fill: list[int] = []
            first = len(order)
            for index in rng.permutation(len(lengths)):
                length = int(lengths[index])
                slot = next((r for r, used in enumerate(fill) if used + length <= shard.edge), None)
                if slot is None and len(fill) == max_rows:  # full: close this micro-batch
                    shard_of.append(s), start_of.append(first), count_of.append(len(order) - first)
                    rows_of.append(len(fill))
                    fill, first = [], len(order)
                if slot is None:
                    fill.append(0)
                    slot = len(fill) - 1
                order.append(index), row.append(slot), col.append(fill[slot])
                fill[slot] += length
            shard_of.append(s), start_of.append(first), count_of.append(len(order) - first)
            rows_of.append(len(fill))
        self.order, self.row, self.col = (np.asarray(a, dtype=np.int64) for a in (order, row, col))
        self.shard_of, self.start_of, self.count_of, self.rows_of = (
            np.asarray(a, dtype=np.int64) for a in (shard_of, start_of, count_of, rows_of))
        self.tokens_of = np.zeros(len(self.shard_of), dtype=np.int64)
        self.width_of = np.zeros(len(self.shard_of), dtype=np.int64)
        for m in range(len(self.shard_of)):
            shard = shards[self.shard_of[m]]
            members = slice(self.start_of[m], self.start_of[m] + self.count_of[m])
            ends = self.col[members] + shard.lengths[self.order[members]]
            self.tokens_of[m] = int(shard.lengths[self.order[members]].sum())
            self.width_of[m] = int(ends.max())

    def __len__(self) -> int:
        return len(self.shard_of)

    def micro_batch(self, m: int) -> MicroBatch:
        """The micro-batch's samples, kept apart in their rows: positions restart at every sample
        (and at the padding), a sample's first token has no label, padding (-1) none either."""
        shard = self.shards[self.shard_of[m]]
        shape = (self.rows_of[m], self.width_of[m])
        ids = np.full(shape, PAD, dtype=np.int64)
        starts = np.zeros(shape, dtype=bool)
        for j in range(self.start_of[m], self.start_of[m] + self.count_of[m]):
            sample = shard[self.order[j]]
            ids[self.row[j], self.col[j]:self.col[j] + len(sample)] = sample
            starts[self.row[j], self.col[j]] = True
        starts |= (ids < 0) & (np.arange(shape[1]) == np.argmax(ids < 0, axis=1)[:, None])  # padding: a segment
        index = np.broadcast_to(np.arange(shape[1]), shape)
        positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
        batch = MicroBatch.from_ids(ids)
        batch.labels[torch.from_numpy(starts)] = -100
        batch.position_ids = torch.from_numpy(positions)
        return batch

    def usage(self, m: int) -> tuple[int, int, int]:
        """(real tokens, token slots, token slots had each sample been padded to seq_len)."""
        return int(self.tokens_of[m]), int(self.rows_of[m] * self.width_of[m]), int(self.count_of[m] * self.seq)


class BucketStream:
    """A stage's micro-batches in a reproducible order; same interface as trainer.stream.StageStream,
    with the position counted in sequence slots (mbs per micro-batch). Each source's micro-batches
    are read in epochs, a seeded permutation per epoch (trainer.stream.EpochOrder), so one pass
    visits every micro-batch, hence every sample, once."""

    def __init__(self, sources: list[tuple[BucketedSource, float]], seed: int, stage_index: int, mbs: int):
        if not sources or any(len(s) == 0 for s, _ in sources):
            raise UsageError(f"stage {stage_index} has no prepared training samples")
        self.sources = [s for s, _ in sources]
        weights = [w for _, w in sources]
        self.order = EpochOrder([len(s) for s in self.sources], weights, [0.0] * len(weights), seed, stage_index)
        self.seed, self.stage_index, self.mbs = seed, stage_index, mbs

    def _pick(self, k: int) -> tuple[BucketedSource, int]:
        which, rows = self.order.rows(k, 1)
        return self.sources[int(which[0])], int(rows[0])

    def _index(self, position: int, dp: int, mbs: int, rank: int, micro: int) -> int:
        return position // mbs + micro * dp + rank

    def global_batch(self, position: int, dp: int, mbs: int, gas: int, rank: int, micro: int) -> MicroBatch:
        source, m = self._pick(self._index(position, dp, mbs, rank, micro))
        return source.micro_batch(m)

    def usage(self, position: int, dp: int, mbs: int, rank: int, micro: int) -> tuple[int, int, int]:
        source, m = self._pick(self._index(position, dp, mbs, rank, micro))
        return source.usage(m)

    def epochs(self, position: int, skipped: list[tuple[int, int]] = ()) -> dict[str, float]:
        """Passes over each source's micro-batches that positions 0 .. position-1 made."""
        consumed = self.order.consumed(position // self.mbs,
                                       [(a // self.mbs, b // self.mbs) for a, b in skipped])
        return {s.name: float(c) / len(s) for s, c in zip(self.sources, consumed)}

    def positions_for(self, epochs: float, stage: str) -> int:
        """Sequence slots after which the stage's own micro-batches have made `epochs` passes."""
        return self.order.positions_for(epochs, [s.name == stage for s in self.sources]) * self.mbs


def bucket_stream(folder: Path, task: TaskSpec, index: int, seq: int, mbs: int, seed: int) -> BucketStream:
    """The stage's own shards (weighted by their tokens: the prepared mixture) plus the replayed
    stages' shards by their share, as `stage_sources` mixes raw sources."""
    stage = task.stages[index]
    own_share = 1.0 - sum(stage.replay.values())
    budget = mbs * seq
    parts = [(stage.name, own_share), *stage.replay.items()]
    sources = []
    for number, (name, share) in enumerate(parts):
        shards = [read_shard(s["path"], int(s["bucket"])) for s in stage_shards(folder, name) if s["samples"]]
        if not shards:
            raise UsageError(f"stage '{name}' has no prepared training samples in {folder}")
        rng = np.random.default_rng([seed, index, number, 7])
        sources.append((BucketedSource(name, shards, budget, seq, rng), share))
    return BucketStream(sources, seed, index, mbs)
