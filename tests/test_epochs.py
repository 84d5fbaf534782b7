"""Epochs, not draws: each source is read in a seeded permutation per epoch, so one pass visits every
example exactly once, and any position (a resume, a skipped window) continues the same order."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.prepared import BucketStream
from trainer.stream import BLOCK, Source, StageStream


def _numbered(name: str, n: int, weight: float = 1.0, offset: int = 0) -> Source:
    """A source whose row i is the sequence [offset + i, offset + i]: a batch names the rows it holds."""
    ids = offset + np.arange(n, dtype=np.int64)
    return Source(name, np.stack([ids, ids], axis=1), weight)


def test_one_epoch_of_a_1000_example_source_visits_each_example_exactly_once() -> None:
    stream = StageStream([_numbered("s:a", 1000)], seed=3, stage_index=0)
    first = stream.sequences(0, 1000)[:, 0]
    assert sorted(first.tolist()) == list(range(1000))
    second = stream.sequences(1000, 1000)[:, 0]
    assert sorted(second.tolist()) == list(range(1000))
    assert not np.array_equal(first, second)  # a fresh permutation per epoch
    assert first.tolist() != list(range(1000))  # shuffled, not file order
    assert stream.epochs(1000) == {"s:a": 1.0}
    assert stream.epochs(1500) == {"s:a": 1.5}


def test_resume_mid_epoch_continues_the_same_permutation() -> None:
    whole = StageStream([_numbered("s:a", 1000)], seed=3, stage_index=0).sequences(0, 2000)
    resumed = StageStream([_numbered("s:a", 1000)], seed=3, stage_index=0)  # a fresh process
    assert np.array_equal(resumed.sequences(437, 700), whole[437:1137])  # across the epoch boundary
    # as the loop reads it: step by step, micro-batch by micro-batch, dp ranks interleaved
    dp, mbs, gas = 2, 3, 2
    step = dp * mbs * gas
    again = StageStream([_numbered("s:a", 1000)], seed=3, stage_index=0)
    for position in range(444, 444 + 5 * step, step):
        for micro in range(gas):
            for rank in range(dp):
                first = position + (micro * dp + rank) * mbs
                assert np.array_equal(again.global_batch(position, dp, mbs, gas, rank, micro).input_ids.numpy(),
                                      whole[first:first + mbs])


def test_a_weighted_mixture_reads_each_source_in_its_own_epochs_across_blocks() -> None:
    sources = [_numbered("s:a", 700, weight=0.7), _numbered("s:b", 300, weight=0.3, offset=10_000)]
    stream = StageStream(sources, seed=1, stage_index=2)
    count = 3 * BLOCK + 123
    ids = stream.sequences(0, count)[:, 0]
    for offset, n in ((0, 700), (10_000, 300)):
        drawn = ids[(ids >= offset) & (ids < offset + n)] - offset
        for epoch in range(len(drawn) // n):  # every full epoch of the source is a permutation
            assert sorted(drawn[epoch * n:(epoch + 1) * n].tolist()) == list(range(n))
        assert stream.epochs(count)[f"s:{'a' if offset == 0 else 'b'}"] == pytest.approx(len(drawn) / n)
    assert abs(float(np.mean(ids < 10_000)) - 0.7) < 0.03  # the mixture stays weighted
    # a fresh stream resumed in the third block draws what the continuous one drew
    resumed = StageStream(sources, seed=1, stage_index=2)
    assert np.array_equal(resumed.sequences(2 * BLOCK + 50, 400)[:, 0], ids[2 * BLOCK + 50:2 * BLOCK + 450])
    # a skipped window's rows are not counted as consumed
    skipped = stream.epochs(2000, [(100, 300)])
    full = stream.epochs(2000)
    window = ids[100:300]
    assert skipped["s:a"] == pytest.approx(full["s:a"] - float(np.sum(window < 10_000)) / 700)


def test_an_epochs_budget_is_its_own_rows_over_their_share() -> None:
    stream = StageStream([_numbered("own:x", 600, weight=0.75), _numbered("early:y", 100, weight=0.25)],
                         seed=0, stage_index=1)
    assert stream.positions_for(2, "own") == 1600  # 2 x 600 rows, at 75% of the mixture


class _Batches:
    """A stand-in for a prepared source: micro-batch m is [[m]]."""

    def __init__(self, name: str, n: int):
        self.name, self.n = name, n

    def __len__(self) -> int:
        return self.n

    def micro_batch(self, m: int) -> np.ndarray:
        return np.array([[m]])


def test_prepared_micro_batches_are_read_in_epochs_too() -> None:
    stream = BucketStream([(_Batches("only", 50), 1.0)], seed=0, stage_index=0, mbs=4)
    seen = [int(stream.global_batch(k * 4, 1, 4, 1, 0, 0)[0, 0]) for k in range(100)]
    assert sorted(seen[:50]) == list(range(50)) and sorted(seen[50:]) == list(range(50))
    assert stream.epochs(100 * 4) == {"only": 2.0}


def test_a_stage_takes_exactly_one_budget_and_epochs_is_one() -> None:
    from pydantic import ValidationError

    from specs.task import StageSpec

    assert StageSpec(name="chat", epochs=2).epochs == 2
    for budgets in ({"epochs": 2, "tokens": 100}, {"epochs": 1, "steps": 3}, {}):
        with pytest.raises(ValidationError, match="exactly one of tokens, steps or epochs"):
            StageSpec(name="chat", **budgets)


def test_the_planner_sizes_an_epochs_stage_from_its_data_when_it_can_read_it(tmp_path) -> None:
    import json

    from advisor.cli.common import stage_tokens
    from specs.core import ModelSpec
    from planner.plan import PlanOptions, make_plan
    from presets import load_hardware, load_task
    from trainer.corpus import ByteTokenizer, load_source

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "own.jsonl").write_text("".join(json.dumps({"text": f"row {i} " * 5}) + "\n" for i in range(90)))
    (tmp_path / "task.yaml").write_text("""
name: epochs
seq_len: 32
global_batch: 4
stages:
  - {name: first, sources: [{path: data/own.jsonl}], steps: 3}
  - {name: second, sources: [{path: data/own.jsonl}], epochs: 3, replay: {first: 0.25}}
  - {name: third, sources: [{path: data/missing.jsonl}], epochs: 1}
""")
    task = load_task(str(tmp_path / "task.yaml"))
    model = ModelSpec(name="tiny", hf_config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                              "num_hidden_layers": 2, "num_attention_heads": 2,
                                              "num_key_value_heads": 2, "vocab_size": 272})
    counts = stage_tokens(task, model, 32)
    rows = len(load_source(task.stages[1].sources[0], task, ByteTokenizer(), 32, None))
    assert counts == {"second": round(rows * 32 / 0.75)}  # one pass, replay on top; `third` is unreadable
    plan = make_plan(PlanOptions(model=model, hardware=load_hardware("cpu"), gpus_per_node=1, task=task,
                                 stage_tokens=counts, min_compute_fraction=0.0))
    second, third = plan.stages[1], plan.stages[2]
    assert second.tokens == -(-3 * counts["second"] // 1) and not any("run time" in f for f in second.flags)
    assert third.steps == 1 and third.flags[0].startswith("sized at run time: 1 epochs")
    assert plan.task.stages[1].epochs == 3  # the trainer still sizes it from the rows it reads


def test_train_epochs_without_a_task_is_one_stage_of_that_many_passes(tmp_path) -> None:
    import json

    from specs.errors import UsageError
    from specs.core import ModelSpec
    from planner.plan import PlanOptions, make_plan
    from presets import load_hardware
    from trainer.one_stage import one_stage_plan

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i} " * 6}) + "\n" for i in range(60)))
    model = ModelSpec(name="tiny", hf_config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                                              "num_hidden_layers": 2, "num_attention_heads": 2,
                                              "num_key_value_heads": 2, "vocab_size": 272})
    plan = make_plan(PlanOptions(model=model, hardware=load_hardware("cpu"), gpus_per_node=1, seq=32, global_batch=4,
                                 min_compute_fraction=0.0))
    one_pass, _ = one_stage_plan(plan, str(data), tmp_path / "a", None, None)
    twice, _ = one_stage_plan(plan, str(data), tmp_path / "b", None, None, epochs=2)
    assert twice.task.stages[0].epochs == 2 and twice.task.stages[0].steps is None
    from trainer.corpus import ByteTokenizer, load_source

    rows = len(load_source(twice.task.stages[0].sources[0], twice.task, ByteTokenizer(), 32, None))
    assert twice.stages[0].tokens == 2 * rows * 32  # planned from one pass; the trainer sizes it from the rows
    assert one_pass.stages[0].steps == -(-rows // 4)
    with pytest.raises(UsageError, match="one of --steps, --tokens or --epochs"):
        one_stage_plan(plan, str(data), tmp_path / "c", 3, None, epochs=2)
