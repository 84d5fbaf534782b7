"""The micro-batch every engine steps on: token ids, their labels, and the position ids of packed rows.

Labels follow transformers' convention: the model shifts them, so ``labels[t]`` is the target of the
prediction made at ``t - 1``; -100 is not trained (prompts, padding, the first token of a packed
document). ``position_ids`` restart at 0 for every document packed into a row; given them and no
attention mask, transformers' sdpa and eager attention keep the documents apart
(``transformers.masking_utils.find_packed_sequence_indices``). None means one document per row,
positions 0..seq-1, plain causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IGNORE = -100


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # (rows, seq) int64
    labels: torch.Tensor  # (rows, seq) int64, -100 where not trained
    position_ids: torch.Tensor | None = None  # (rows, seq) int64, restarting per packed document
    # The step's trained tokens over all its micro-batches and replicas, divided by dp x gas: given it,
    # the model's loss is this micro-batch's summed token loss over it (transformers'
    # `num_items_in_batch`), so that after the engines' division by gas and their mean over replicas
    # every trained token of the step weighs the same, whatever the split (mbs, gas, dp). None: the
    # micro-batch's own mean (evaluation, timing).
    num_items: float | None = None

    @classmethod
    def from_ids(cls, ids: torch.Tensor | np.ndarray) -> "MicroBatch":
        """Every token trained, but padding marked by ids < 0 (prepared data's -1): token 0, label -100."""
        ids = torch.as_tensor(ids)
        pad = ids < 0
        return cls(ids.masked_fill(pad, 0), ids.masked_fill(pad, IGNORE))

    @classmethod
    def from_arrays(cls, ids: np.ndarray, labels: np.ndarray | None, positions: np.ndarray | None) -> "MicroBatch":
        """From a stream's numpy rows (no copy); labels None: every token trained."""
        if labels is None:
            return cls.from_ids(torch.from_numpy(ids))
        return cls(torch.from_numpy(ids), torch.from_numpy(labels),
                   torch.from_numpy(positions) if positions is not None else None)

    def to(self, device: torch.device | str) -> "MicroBatch":
        return MicroBatch(self.input_ids.to(device), self.labels.to(device),
                          self.position_ids.to(device) if self.position_ids is not None else None, self.num_items)

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of an HF causal LM's forward (no attention mask: see the module doc).
        No cache: transformers reads packed position ids only without one (and training needs none)."""
        inputs = {"input_ids": self.input_ids, "labels": self.labels, "use_cache": False}
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        if self.num_items is not None:
            inputs["num_items_in_batch"] = self.num_items
        return inputs

    def trained_tokens(self) -> int:
        """Tokens that carry a loss (the model shifts the labels: the first column never does)."""
        return int((self.labels[:, 1:] != IGNORE).sum())

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def shape(self) -> torch.Size:
        """(rows, seq)."""
        return self.input_ids.shape


def as_micro_batch(batch: MicroBatch | torch.Tensor | np.ndarray) -> MicroBatch:
    """A micro-batch as such, or bare token ids (every token trained, ids < 0 padding)."""
    return batch if isinstance(batch, MicroBatch) else MicroBatch.from_ids(batch)


def concat(batches: list[MicroBatch]) -> MicroBatch:
    """The micro-batches as one (a pipeline step splits it back into its micro-batches)."""
    positions = [b.position_ids for b in batches]
    if any(p is not None for p in positions):
        positions = [p if p is not None else default_positions(b) for p, b in zip(positions, batches)]
    return MicroBatch(torch.cat([b.input_ids for b in batches]), torch.cat([b.labels for b in batches]),
                      torch.cat(positions) if positions[0] is not None else None,  # type: ignore[arg-type]
                      batches[0].num_items)


def default_positions(batch: MicroBatch) -> torch.Tensor:
    rows, seq = batch.input_ids.shape
    return torch.arange(seq, device=batch.input_ids.device).expand(rows, seq)
