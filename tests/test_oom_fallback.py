"""Out-of-memory fallback: the loop rebuilds only after the failed step's tensors are gone, only onto
a layout the trainer runs; stage-end evaluation runs in micro-batches of the layout's size, so it is
never the thing that runs out of memory."""

from __future__ import annotations

import weakref

import pytest
import torch

import trainer.evaluator as evaluator
import trainer.recovery as recovery
from specs.capabilities import config_shape, runnable_problem
from specs.plan_file import load_plan
from specs.core import Layout, ModelSpec
from test_trainer import CONFIG, make_plan_file, read_jsonl
from trainer.loop import TrainOptions, train
from trainer.model import build_filled_model
from trainer.oom import next_layout
from trainer.stream import Source

QUIET = TrainOptions(show_progress=False)
BIG = 2 ** 24  # float32 elements: 64 MiB, an activation of the step that runs out of memory


def _with_unrunnable_first_alternative(plan):
    """The plan with, ahead of its alternatives, one the processes could switch to but the trainer
    does not run (the plain engine offloads nothing: offload runs through DeepSpeed)."""
    runnable = plan.alternatives[0]
    offloaded = runnable.model_copy(update={"layout": runnable.layout.model_copy(update={"offload": "optimizer"})})
    plan.alternatives.insert(0, offloaded)
    return plan, runnable.layout, offloaded.layout


def test_fallback_takes_only_layouts_the_trainer_runs(tmp_path) -> None:
    plan, runnable, offloaded = _with_unrunnable_first_alternative(load_plan(make_plan_file(tmp_path, steps=2)))
    shape = config_shape(plan.model.hf_config)
    assert runnable_problem(offloaded, shape, "cpu", plan.engine) is not None
    chosen, skipped = next_layout(plan, [plan.chosen.layout], "cpu")
    assert chosen == runnable and runnable_problem(chosen, shape, "cpu", plan.engine) is None
    assert len(skipped) == 1 and "not runnable here" in skipped[0] and "offload=optimizer" in skipped[0]


def test_oom_rebuilds_after_the_failed_steps_tensors_are_freed_onto_a_runnable_layout(tmp_path, monkeypatch) -> None:
    plan, runnable, _ = _with_unrunnable_first_alternative(load_plan(make_plan_file(tmp_path, steps=2)))
    activations: list[weakref.ref] = []  # the failed step's big tensor, watched without holding it
    builds: list[tuple[Layout, list[bool]]] = []  # each engine build: its layout, and which watched tensors were dead
    evaluated_mbs: list[int] = []
    real_build, real_evaluate = recovery.build_engine, evaluator.evaluate_sources

    def build(model, layout, *args, **kwargs):
        builds.append((layout, [ref() is None for ref in activations]))
        engine = real_build(model, layout, *args, **kwargs)
        if len(builds) == 1:
            def out_of_memory(input_ids):  # the first engine runs out of memory holding an activation
                held = torch.ones(BIG)
                activations.append(weakref.ref(held))
                raise torch.OutOfMemoryError("out of memory (test)")

            engine.micro_step = out_of_memory
        return engine

    def evaluate(model, sources, count, mbs, dev, shard):
        evaluated_mbs.append(mbs)
        return real_evaluate(model, sources, count, mbs, dev, shard)

    monkeypatch.setattr(recovery, "build_engine", build)
    monkeypatch.setattr(evaluator, "evaluate_sources", evaluate)
    summary = train(plan, tmp_path / "run", resume=False, options=QUIET)

    assert len(activations) == 1 and len(builds) == 2
    rebuilt_with, dead_at_rebuild = builds[1]
    assert dead_at_rebuild == [True]  # the traceback no longer held the failed step's frames
    assert rebuilt_with == runnable
    assert runnable_problem(rebuilt_with, config_shape(plan.model.hf_config), "cpu", plan.engine) is None
    fallback = next(e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "oom_fallback")
    assert "not runnable here" in fallback["skipped"][0]
    assert summary["finished"] and summary["oom_fallbacks"] == 1
    assert evaluated_mbs and set(evaluated_mbs) == {runnable.mbs}  # the stage-end evals, at the layout's mbs


def test_evaluation_runs_in_micro_batches_and_equals_one_batch() -> None:
    """Five sequences at mbs 2: three forwards of at most 2 sequences, and the mean token loss of
    one forward over all five (the truth) within fp32 rounding."""
    layout = Layout(mbs=2, seq=16, dtype="fp32")
    model = build_filled_model(ModelSpec(name="tiny", hf_config=CONFIG), layout, 0)
    sequences = torch.randint(0, CONFIG["vocab_size"], (5, 16), generator=torch.Generator().manual_seed(1)).numpy()
    batch_sizes = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: batch_sizes.append(len(kwargs["input_ids"])),
                                           with_kwargs=True)
    losses = evaluator.evaluate_sources(model, [Source("skill", sequences, 1.0)], 16, layout.mbs, torch.device("cpu"))
    hook.remove()
    assert batch_sizes == [2, 2, 1]
    whole = torch.from_numpy(sequences)
    with torch.no_grad():
        truth = float(model(input_ids=whole, labels=whole).loss)
    assert losses["skill"] == pytest.approx(truth, abs=1e-6)
