"""The trainer's operations: TensorBoard scalars equal to metrics.jsonl, runtime out-of-memory
fallback to the plan's next layout, training from prepared (length-bucketed) shards with exact
resume, and two launchers simulating two nodes on this machine."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specs.errors import UsageError
from specs.plan_file import load_plan
from specs.core import ModelSpec
from presets import load_task
from planner.plan import PlanOptions, make_plan
from presets import load_hardware
from test_trainer import CONFIG, _free_port, make_plan_file, read_jsonl, write_task
from trainer.loop import TrainOptions, train
from trainer.oom import OOMInjector, next_layout

QUIET = TrainOptions(show_progress=False)


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_tensorboard_matches(run: Path) -> None:
    metrics = read_jsonl(run / "metrics.jsonl")
    logged = scalars(run / "tensorboard")
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_s"):
        assert [s for s, _ in logged[f"train/{key}"]] == [m["step"] for m in metrics]
        assert [v for _, v in logged[f"train/{key}"]] == pytest.approx([m[key] for m in metrics], rel=1e-6)
    for event in (e for e in read_jsonl(run / "events.jsonl") if e["event"] == "eval"):
        for name, loss in event["losses"].items():
            assert (event["step"], pytest.approx(loss, rel=1e-6)) in logged[f"eval/{name}"]


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path) -> None:
    plan = load_plan(make_plan_file(tmp_path, steps=4))
    train(plan, tmp_path / "run", resume=False, options=QUIET)
    assert_tensorboard_matches(tmp_path / "run")


# -- out-of-memory fallback ----------------------------------------------------------------------

def test_injected_oom_falls_back_to_the_next_layout_and_matches_a_run_planned_with_it(tmp_path, monkeypatch) -> None:
    plan_path = make_plan_file(tmp_path, steps=4)
    plan = load_plan(plan_path)
    assert plan.chosen.layout.mbs == 4 and [a.layout.mbs for a in plan.alternatives][:1] == [2]
    monkeypatch.setenv("ADVISOR_INJECT_OOM", "tokens=64")  # a micro-batch of 4 x 32 tokens does not fit
    summary = train(plan, tmp_path / "run", resume=False, options=QUIET)
    fallbacks = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "oom_fallback"]
    assert len(fallbacks) == 1 and "mbs=4,gas=1" in fallbacks[0]["failed"]
    assert "mbs=2,gas=2" in fallbacks[0]["replacement"] and fallbacks[0]["from"] == "step-00000000"
    assert summary["finished"] and summary["oom_fallbacks"] == 1 and "mbs=2,gas=2" in summary["layout_used"]
    assert_tensorboard_matches(tmp_path / "run")  # the purged attempt left no scalars behind

    monkeypatch.delenv("ADVISOR_INJECT_OOM")
    plan.chosen = plan.alternatives[0]  # the truth: planned with the replacement from the start
    train(plan, tmp_path / "direct", resume=False, options=QUIET)
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert losses == [m["loss"] for m in read_jsonl(tmp_path / "direct" / "metrics.jsonl")]


def test_oom_in_mid_stage_resumes_from_the_last_checkpoint_and_resume_keeps_the_fallback(tmp_path,
                                                                                        monkeypatch) -> None:
    plan = load_plan(make_plan_file(tmp_path, steps=4, checkpoint_every=2))
    monkeypatch.setenv("ADVISOR_INJECT_OOM", "step=4")
    train(plan, tmp_path / "run", resume=False, options=QUIET)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    fallback = next(e for e in events if e["event"] == "oom_fallback")
    assert fallback["step"] == 4 and fallback["from"] == "step-00000002"
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == list(range(1, 9))
    trainer_json = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1] / "trainer.json"
    assert json.loads(trainer_json.read_text())["layout"]["mbs"] == 2  # a resume keeps the fallback


def test_oom_with_no_fallback_left_stops_with_a_clear_error(tmp_path, monkeypatch) -> None:
    plan = load_plan(make_plan_file(tmp_path, steps=2))
    monkeypatch.setenv("ADVISOR_INJECT_OOM", "tokens=16")  # even one sequence of 32 tokens does not fit
    with pytest.raises(UsageError, match="out of memory at step 1 .*no fallback left"):
        train(plan, tmp_path / "run", resume=False, options=QUIET)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["replacement"] for e in events if e["event"] == "oom_fallback"][-1] is None
    assert events[-1]["event"] == "stop"


def test_fallback_skips_layouts_that_need_another_world_size(tmp_path) -> None:
    plan = load_plan(make_plan_file(tmp_path, steps=2))
    wide = plan.alternatives[0].model_copy(update={"layout": plan.chosen.layout.model_copy(
        update={"dp": 2, "mbs": 2, "gas": 1})})
    plan.alternatives.insert(0, wide)
    chosen, skipped = next_layout(plan, [plan.chosen.layout])
    assert chosen == plan.alternatives[1].layout
    assert len(skipped) == 1 and "needs 2 processes" in skipped[0]
    with pytest.raises(UsageError, match="ADVISOR_INJECT_OOM"):
        OOMInjector("step=x")


# -- prepared data -------------------------------------------------------------------------------

VOCAB = 2048  # the shipped demo-tiny tokenizer's


def prepared_plan(root: Path, steps: int = 4, checkpoint_every: int | None = None) -> tuple[Path, Path]:
    from trainer.data.prepare import prepare

    task_file = write_task(root, steps)
    tokenizer = Path(__file__).resolve().parent.parent / "presets" / "tokenizers" / "demo-tiny"
    text = task_file.read_text().replace(
        "name: tiny\n", f"name: tiny\ndata: {{tokenizer: {tokenizer}, buckets: {{micro_batch_tokens: 64}}}}\n")
    task_file.write_text(text)
    folder, _ = prepare(load_task(str(task_file)), root / "prepared")
    task = load_task(str(task_file))
    plan = make_plan(PlanOptions(model=ModelSpec(name="tiny", hf_config={**CONFIG, "vocab_size": VOCAB}),
                                 hardware=load_hardware("cpu"), gpus_per_node=1, task=task,
                                 min_compute_fraction=0.0))
    plan.chosen = next(a for a in [plan.chosen, *plan.alternatives] if a.layout.mbs == 2)  # 2 micro-batches
    for stage in plan.stages:
        stage.steps = steps
        stage.checkpoint_every_steps = checkpoint_every or stage.checkpoint_every_steps
    plan.write(root / "plan.yaml")
    return root / "plan.yaml", folder


def test_padding_marked_minus_one_adds_no_loss() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.prepared import PAD, mask_padding

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG), attn_implementation="sdpa")
    sample = torch.tensor([[5, 9, 2, 7, 11]])
    plain = model(input_ids=sample, labels=sample).loss
    mask_padding(model)
    padded = torch.tensor([[5, 9, 2, 7, 11, PAD, PAD, PAD]])
    assert float(model(input_ids=padded, labels=padded).loss) == pytest.approx(float(plain), abs=1e-6)


def test_prepared_shards_train_in_length_buckets_and_report_the_padding_saved(tmp_path) -> None:
    plan_path, folder = prepared_plan(tmp_path)
    summary = train(load_plan(plan_path), tmp_path / "run", resume=False, options=QUIET)  # found: the task's data.out
    assert summary["data"]["source"] == "prepared" and summary["data"]["dir"] == str(folder)
    padding = summary["data"]["padding"]
    assert all(p["tokens"] > 0 and p["padding_fraction"] <= p["padding_fraction_unbucketed"] for p in padding.values())
    tokens, slots, unbucketed = (sum(p[k] for p in padding.values()) for k in ("tokens", "slots", "slots_unbucketed"))
    assert 1 - tokens / slots < (1 - tokens / unbucketed) / 2  # buckets + packing at least halve the padding
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert {e["stage"] for e in events if e["event"] == "data_padding"} == {"language", "math"}
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == 8 and all(m["loss"] == m["loss"] for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]


def test_prepared_shards_resume_exactly(tmp_path, monkeypatch) -> None:
    from trainer.spike import SpikeGuard

    plan_path, folder = prepared_plan(tmp_path, steps=4, checkpoint_every=2)
    plan = load_plan(plan_path)
    options = TrainOptions(show_progress=False, data=str(folder))
    train(plan, tmp_path / "whole", resume=False, options=options)

    calls = {"n": 0}
    original = SpikeGuard.check

    def crash_at_step_6(self, loss, grad_norm):
        calls["n"] += 1
        if calls["n"] == 6:
            raise KeyboardInterrupt  # the process dies between checkpoints (step 4 is the last)
        return original(self, loss, grad_norm)

    monkeypatch.setattr(SpikeGuard, "check", crash_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        train(plan, tmp_path / "cut", resume=False, options=options)
    monkeypatch.setattr(SpikeGuard, "check", original)
    train(plan, tmp_path / "cut", resume=True, options=options)
    whole = read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    cut = read_jsonl(tmp_path / "cut" / "metrics.jsonl")
    assert [m["loss"] for m in cut] == [m["loss"] for m in whole]
    assert [m["tokens_per_s"] > 0 for m in cut] == [True] * len(whole)
    assert (json.loads((tmp_path / "cut" / "summary.json").read_text())["data"]["padding"]
            == json.loads((tmp_path / "whole" / "summary.json").read_text())["data"]["padding"])


def test_a_missing_prepared_folder_is_a_one_line_error(tmp_path) -> None:
    plan = load_plan(make_plan_file(tmp_path, steps=2))
    with pytest.raises(UsageError, match="no manifest.json"):
        train(plan, tmp_path / "run", resume=False, options=TrainOptions(show_progress=False,
                                                                          data=str(tmp_path / "nowhere")))


# -- two nodes on one machine ----------------------------------------------------------------------

def _launch(plan: Path, out: Path, port: int, nnodes: int, node_rank: int, *extra: str,
            env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(out), "--nnodes", str(nnodes),
               "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port), *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _two_nodes(plan: Path, out: Path, *extra: str, env: dict | None = None) -> list[int]:
    port = _free_port()
    nodes = [_launch(plan, out, port, 2, rank, *extra, env=env) for rank in (0, 1)]
    return [node.wait(timeout=600) for node in nodes]


@pytest.mark.slow
def test_two_launchers_as_two_nodes_train_and_resume_like_one_launcher(tmp_path) -> None:
    plan = make_plan_file(tmp_path, steps=4, checkpoint_every=2, layout_fields={"dp": 2, "mbs": 1, "gas": 2, "zero": 0})
    reference = _launch(plan, tmp_path / "one", _free_port(), 1, 0)
    assert reference.wait(timeout=600) == 0, reference.stderr.read().decode()[-2000:]

    # both nodes fail at step 4, after the checkpoint of step 2 (an OOM on every rank: a clean stop)
    assert _two_nodes(plan, tmp_path / "two", env={"ADVISOR_INJECT_OOM": "step=4"}) == [2, 2]
    metrics = tmp_path / "two" / "metrics.jsonl"
    assert [m["step"] for m in read_jsonl(metrics)] == [1, 2, 3]
    assert _two_nodes(plan, tmp_path / "two", "--resume") == [0, 0]

    one = read_jsonl(tmp_path / "one" / "metrics.jsonl")
    two = read_jsonl(metrics)
    assert [m["step"] for m in two] == [m["step"] for m in one] == list(range(1, 9))
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], abs=1e-6)
    events = read_jsonl(tmp_path / "two" / "events.jsonl")
    assert [e["from"] for e in events if e["event"] == "resume"] == ["step-00000002"]
    assert next(e for e in events if e["event"] == "stop")["reason"].startswith("out of memory")
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_oom_in_two_ranks_restarts_them_with_the_next_layout(tmp_path, monkeypatch) -> None:
    plan_path = make_plan_file(tmp_path, steps=2, layout_fields={"dp": 2, "mbs": 2, "gas": 1, "zero": 0})
    plan = load_plan(plan_path)
    smaller = plan.chosen.layout.model_copy(update={"mbs": 1, "gas": 2})
    other_world = plan.chosen.layout.model_copy(update={"dp": 1, "mbs": 2, "gas": 2})
    plan.alternatives = [plan.chosen.model_copy(update={"layout": layout}) for layout in (other_world, smaller)]
    plan.write(plan_path)
    # 2 x 32 token slots per micro-batch do not fit, 32 do
    run = _launch(plan_path, tmp_path / "run", _free_port(), 1, 0, env={"ADVISOR_INJECT_OOM": "tokens=32"})
    assert run.wait(timeout=600) == 0, run.stderr.read().decode()[-2000:]
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    fallback = next(e for e in events if e["event"] == "oom_fallback")
    assert fallback["relaunch"] and "mbs=1,gas=2" in fallback["replacement"]
    assert "needs 1 processes" in fallback["skipped"][0]
    assert [e["from"] for e in events if e["event"] == "resume"] == ["step-00000000"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "mbs=1,gas=2" in summary["layout_used"] and summary["oom_fallbacks"] == 1

    # the truth: one rank with the same sequences per step (dp x gas = 4 micro-batches of one)
    truth = load_plan(plan_path)
    truth.chosen.layout = truth.chosen.layout.model_copy(update={"dp": 1, "mbs": 1, "gas": 4})
    monkeypatch.delenv("ADVISOR_INJECT_OOM", raising=False)
    train(truth, tmp_path / "truth", resume=False, options=QUIET)
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert losses == pytest.approx([m["loss"] for m in read_jsonl(tmp_path / "truth" / "metrics.jsonl")], abs=1e-5)
