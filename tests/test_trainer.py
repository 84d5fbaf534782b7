"""The staged trainer against its promises: exact resume after kill -9, spike rollback, stage
checkpoints and learning-rate re-warm-up, and data parallelism equal to accumulation."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from specs.plan_file import load_plan
from planner.plan import PlanOptions, make_plan
from specs.core import ModelSpec
from presets import load_task
from presets import load_hardware
from trainer.loop import TrainOptions, train
from trainer.schedule import stage_lr

CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 272, "max_position_embeddings": 128}
WORDS = "the cat sat on a mat and dog ran to big red house with green tree".split()


def write_task(root: Path, steps: int = 6, checkpoint_every: int | None = None, repetitive: bool = False) -> Path:
    rng = random.Random(0)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)

    def jsonl(name: str, rows: int, make) -> None:
        with open(data / name, "w") as f:
            for _ in range(rows):
                f.write(json.dumps({"text": make()}) + "\n")

    if repetitive:  # learnable to a low loss in a few dozen steps: a noise batch then stands out clearly
        jsonl("lang.jsonl", 200, lambda: "the cat sat on the mat. " * 6)
    else:
        jsonl("lang.jsonl", 200, lambda: " ".join(rng.choice(WORDS) for _ in range(30)))
    jsonl("lang_eval.jsonl", 20, lambda: " ".join(rng.choice(WORDS) for _ in range(30)))
    jsonl("math.jsonl", 200, lambda: " ".join(f"{a}+{b}={a + b}" for a, b in
                                              ((rng.randint(0, 9), rng.randint(0, 9)) for _ in range(8))))
    jsonl("math_eval.jsonl", 20, lambda: "1+1=2 2+2=4 3+3=6")
    tokens = steps * 4 * 32
    (root / "task.yaml").write_text(f"""
name: tiny
seq_len: 32
global_batch: 4
stages:
  - {{name: language, sources: [{{path: data/lang.jsonl}}], tokens: {tokens}, lr: 3.0e-3, warmup_steps: 2,
      eval_sources: [{{path: data/lang_eval.jsonl}}]}}
  - {{name: math, sources: [{{path: data/math.jsonl}}], replay: {{language: 0.3}}, tokens: {tokens}, lr: 2.0e-3,
      warmup_steps: 2, eval_sources: [{{path: data/math_eval.jsonl}}]}}
""")
    return root / "task.yaml"


def make_plan_file(root: Path, devices: int = 1, steps: int = 6, checkpoint_every: int | None = None,
                   layout_fields: dict | None = None, repetitive: bool = False, config: dict = CONFIG) -> Path:
    task = load_task(str(write_task(root, steps, repetitive=repetitive)))
    plan = make_plan(PlanOptions(model=ModelSpec(name="tiny", hf_config=config), hardware=load_hardware("cpu"),
                                 gpus_per_node=devices, task=task, min_compute_fraction=0.0))
    if layout_fields:
        layout = plan.chosen.layout.model_copy(update=layout_fields)
        plan.chosen.layout = layout
        for stage in plan.stages:
            stage.layout = layout
            stage.steps = steps * 4 // layout.global_batch if layout.global_batch != 4 else stage.steps
    if checkpoint_every:
        for stage in plan.stages:
            stage.checkpoint_every_steps = checkpoint_every
    path = root / "plan.yaml"
    plan.write(path)
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_stage_ends_checkpoint_and_learning_rate_rewarms(tmp_path) -> None:
    plan = load_plan(make_plan_file(tmp_path))
    train(plan, tmp_path / "run", resume=False, options=TrainOptions(show_progress=False))
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    ends = [e["step"] for e in events if e["event"] == "stage_end"]
    saved = {e["step"] for e in events if e["event"] == "checkpoint"}
    assert ends and set(ends) <= saved
    assert all((tmp_path / "run" / "checkpoints" / f"step-{s:08d}").is_dir() for s in ends[-3:])
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    for stage in plan.task.stages:
        lrs = [m["lr"] for m in metrics if m["stage"] == stage.name]
        steps = len(lrs)
        assert lrs[0] == pytest.approx(stage.lr / 3)  # warm-up of 2 steps restarts at peak/3
        assert lrs[:3] == pytest.approx([stage_lr(i, steps, stage.lr, 2, stage.min_lr_ratio) for i in range(3)])
        assert lrs[2] == pytest.approx(stage.lr) and lrs[-1] < lrs[2]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == len(metrics) and summary["nan"] is False
    assert set(summary["stages"][1]["eval"]) == {"language", "math"}  # forgetting is measured
    # the measured peak is tensor memory (the allocator counter), which the cost model predicts;
    # the process's RSS (hundreds of MB of libraries here) would be a hundred times larger
    measured, predicted = summary["measured"], summary["predicted"]
    assert measured["peak_source"].startswith("CPU allocator counter")
    assert predicted["peak_bytes"] / measured["peak_bytes"] == pytest.approx(1.0, abs=0.1)


def test_poisoned_batch_rolls_back_skips_and_finishes(tmp_path, monkeypatch) -> None:
    import trainer.stream as stream

    plan = load_plan(make_plan_file(tmp_path, steps=30, checkpoint_every=5, repetitive=True))
    poisoned_step = 27  # optimizer step (1-based) of the first stage whose batch is noise
    original = stream.StageStream.global_batch
    per_step = plan.chosen.layout.global_batch

    def poisoned(self, position, dp, mbs, gas, rank, micro):
        batch = original(self, position, dp, mbs, gas, rank, micro)
        if self.stage_index == 0 and position == (poisoned_step - 1) * per_step:
            return np.random.default_rng(1).integers(0, 256, size=batch.shape)
        return batch

    monkeypatch.setattr(stream.StageStream, "global_batch", poisoned)
    summary = train(plan, tmp_path / "run", resume=False,
                    options=TrainOptions(show_progress=False, spike_warmup_steps=4))
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    spikes = [e for e in events if e["event"] == "spike"]
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert [e["step"] for e in spikes] == [poisoned_step]
    assert rollbacks[0]["to"] == "step-00000025"
    assert rollbacks[0]["skipped"] == [26 * per_step, 27 * per_step]
    assert rollbacks[0]["lr_scale"] == 0.5
    assert summary["finished"] and summary["rollbacks"] == 1
    steps = [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1))  # the redone steps replace the rolled-back ones


def test_summary_says_nan_when_a_step_had_a_non_finite_loss(tmp_path, monkeypatch) -> None:
    import trainer.stage_runner as stage_runner

    plan = load_plan(make_plan_file(tmp_path, steps=4))
    all_reduce, calls = stage_runner.sum_across_ranks, []

    def nan_loss_at_step_3(values):  # the step's loss as the loop sees it, after the all-reduce
        summed = all_reduce(values)
        if len(values) == 1:  # the step's trained-token count, before its micro-batches run
            return summed
        calls.append(values)
        return [float("nan"), *summed[1:]] if len(calls) == 3 else summed

    monkeypatch.setattr(stage_runner, "sum_across_ranks", nan_loss_at_step_3)
    summary = train(plan, tmp_path / "run", resume=False, options=TrainOptions(show_progress=False))
    assert summary["finished"] and summary["rollbacks"] == 1  # the guard rolled the step back
    assert all(m["loss"] == m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["nan"] is True


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_cli(plan: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(out),
               "--master-port", str(_free_port()), *extra]
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_kill_dash_nine_then_resume_reproduces_the_uninterrupted_run(tmp_path) -> None:
    plan = make_plan_file(tmp_path, steps=8, checkpoint_every=3)
    assert _train_cli(plan, tmp_path / "whole").wait(timeout=600) == 0

    victim = _train_cli(plan, tmp_path / "killed")
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and (not metrics.is_file() or len(metrics.read_text().splitlines()) < 5):
        time.sleep(0.05)  # polling the run's own progress: it is another process
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert _train_cli(plan, tmp_path / "killed", "--resume").wait(timeout=600) == 0

    whole = read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    resumed = read_jsonl(metrics)
    assert [m["step"] for m in resumed] == [m["step"] for m in whole]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole]  # bit-identical on CPU
    final = "step-00000016/engine.pt"
    a = torch.load(tmp_path / "whole" / "checkpoints" / final, weights_only=True)["model"]
    b = torch.load(tmp_path / "killed" / "checkpoints" / final, weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(e["event"] == "resume" for e in read_jsonl(tmp_path / "killed" / "events.jsonl"))


@pytest.fixture(scope="module")
def one_rank_losses(tmp_path_factory) -> list[float]:
    root = tmp_path_factory.mktemp("one-rank")
    plan = make_plan_file(root, layout_fields={"dp": 1, "mbs": 1, "gas": 4, "zero": 0})
    assert _train_cli(plan, root / "run").wait(timeout=600) == 0
    return [m["loss"] for m in read_jsonl(root / "run" / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2, 3], ids=["ddp", "zero2", "zero3"])
def test_two_ranks_match_one_rank_with_twice_the_accumulation(tmp_path, one_rank_losses, zero) -> None:
    # 2 ranks x 2 micro-batches and 1 rank x 4 see the same sequences per optimizer step
    plan = make_plan_file(tmp_path, layout_fields={"dp": 2, "mbs": 1, "gas": 2, "zero": zero})
    proc = _train_cli(plan, tmp_path / "run")
    assert proc.wait(timeout=900) == 0, proc.stderr.read().decode()[-2000:]
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == len(one_rank_losses) > 0
    assert losses == pytest.approx(one_rank_losses, abs=1e-5)
