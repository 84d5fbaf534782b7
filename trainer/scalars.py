"""TensorBoard scalars of a run, next to metrics.jsonl: `tensorboard --logdir RUN_DIR/tensorboard`.

Rank 0 writes `train/{loss,lr,grad_norm,tokens_per_s,step_s}` per optimizer step and `eval/<stage>`
per evaluation. Steps redone after a resume, a spike rollback or an OOM fallback must replace the
ones logged before: each (re)open passes `purge_step`, which makes TensorBoard drop the earlier
events at and after that step, as `JsonLines.truncate_after` does for metrics.jsonl.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TRAIN_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "step_s")


class ScalarLog:
    """A SummaryWriter opened lazily on rank 0; a no-op elsewhere (or without tensorboard)."""

    def __init__(self, log_dir: Path, enabled: bool, purge_after: int | None = None):
        self.log_dir, self.enabled = log_dir, enabled
        self._purge_step = purge_after + 1 if purge_after is not None else None
        self._writer: Any = None

    def _open(self) -> Any:
        if self._writer is None and self.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is a dependency; a trimmed install still trains
                self.enabled = False
                return None
            self._writer = SummaryWriter(str(self.log_dir), purge_step=self._purge_step, flush_secs=30)
        return self._writer

    def _write(self, values: dict[str, float], step: int) -> None:
        """One event holding all values: a fifth of the cost of one add_scalar call per value,
        which matters on the per-step path (docs/notes-cpu-stack.md: small models are overhead-bound)."""
        writer = self._open()
        if writer is not None and values:
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
            writer.file_writer.add_summary(summary, step)

    def metrics(self, record: dict[str, Any]) -> None:
        self._write({f"train/{key}": record[key] for key in TRAIN_KEYS if record.get(key) is not None},
                    record["step"])

    def evals(self, step: int, losses: dict[str, float]) -> None:
        self._write({f"eval/{name}": loss for name, loss in losses.items()}, step)

    def truncate_after(self, step: int) -> None:
        """Steps after `step` will be redone: close this file, purge them when the next opens."""
        self.close()
        self._purge_step = step + 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "ScalarLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
