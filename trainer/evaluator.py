"""The stage-end evaluation: eval loss of every skill seen so far, and the greedy exact match of their
held-out answers. Forgetting shows here. Keeps what this launch measured, per stage, for the summary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specs.core import Layout
from specs.run_dir import EvalEvent
from specs.task import TaskSpec
from trainer.batch import MicroBatch
from trainer.corpus import load_rows
from trainer.engines import Engine
from trainer.eval_shards import EvalShard
from trainer.exact_match import NOT_SCORED_PIPELINE, stage_exact_match
from trainer.options import TrainOptions
from trainer.run_context import RunContext
from trainer.stream import Source


class Evaluator:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.evals: dict[str, dict[str, float]] = {}  # stage -> skill -> eval loss
        self.exact: dict[str, dict[str, float | None]] = {}  # stage -> skill -> greedy exact match (None: no answers)

    def evaluate(self, index: int, engine: Engine, layout: Layout, step: int) -> None:
        """At the end of stage `index`: every skill of stages 0..index, logged and kept."""
        ctx = self.ctx
        name = ctx.task.stages[index].name
        shard = EvalShard(getattr(engine, "data_rank", 0), layout.dp)
        self.evals[name] = _evaluate_stages(engine.model, ctx.task, index, ctx.tokenizer, layout, ctx.files.cache,
                                            ctx.options, ctx.dev, shard)
        record = EvalEvent(stage=name, step=step, losses=self.evals[name])
        exact = stage_exact_match(engine.model, ctx.task, index, ctx.tokenizer, layout.mbs,
                                  ctx.options.exact_match_prompts, ctx.dev, seq=layout.seq, shard=shard)
        if exact is None:
            record.exact_match_note = NOT_SCORED_PIPELINE
        else:
            self.exact[name] = record.exact_match = exact
        ctx.files.events.write(record)
        ctx.files.scalars.evals(step, self.evals[name])


def evaluate_sources(model: torch.nn.Module, sources: list[Source], count: int, mbs: int,
                     dev: torch.device, shard: EvalShard = EvalShard()) -> dict[str, float]:
    """Mean token loss per eval source (first `count` sequences, in order), no gradients.

    In micro-batches of the layout's `mbs`: without gradients a micro-batch holds less than a
    training micro-step does, so the stage-end evaluation is never what runs out of memory. The
    model returns each micro-batch's mean over its trained tokens; weighted by their counts, the
    micro-batches' means give the mean over all trained tokens. Each data-parallel replica takes its
    `shard` of the sequences (trainer/eval_shards.py) and the sums are added over the replicas."""
    sums: list[float] = []
    model.eval()
    with torch.no_grad():
        for source in sources:
            rows = min(count, len(source.sequences))
            lo, hi = shard.bounds(rows, mbs)
            total, tokens = 0.0, 0
            for slot in range(shard.slots(rows, mbs)):
                start = lo + slot * mbs
                padding = start >= hi  # a shorter share's turn in the collective forwards: run and dropped
                picked = source.rows(np.arange(0, 1) if padding else np.arange(start, min(start + mbs, hi)))
                batch = MicroBatch.from_arrays(picked.ids, picked.labels, picked.positions).to(dev)
                trained = 0 if padding else batch.trained_tokens()
                if trained or shard.replicas > 1:  # split, every rank enters every forward
                    loss = model(**batch.model_inputs()).loss
                    if trained:
                        total += float(loss) * trained
                        tokens += trained
                del batch
            sums += [total, tokens]
    model.train()
    sums = shard.total(sums, dev)
    return {source.name: sums[2 * k] / sums[2 * k + 1] if sums[2 * k + 1] else float("nan")
            for k, source in enumerate(sources)}


def _evaluate_stages(model, task: TaskSpec, upto: int, tokenizer, layout: Layout, cache: Path,
                     options: TrainOptions, dev: torch.device, shard: EvalShard) -> dict[str, float]:
    """Eval loss per stage (skill) with eval data, for stages 0..upto, in micro-batches of the layout's."""
    sources = []
    for stage in task.stages[: upto + 1]:
        for src in stage.eval_sources:
            rows = load_rows(src, task, tokenizer, layout.seq, cache)
            if len(rows):
                sources.append(Source.of(stage.name, rows, 1.0))
    module = getattr(model, "module", model)
    return evaluate_sources(module, sources, options.eval_sequences, layout.mbs, dev, shard)
