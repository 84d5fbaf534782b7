"""Per-stage layouts: a curriculum stage runs its own devices, method and degrees.

The first stage fine-tunes fully on 2 data-parallel ranks, the second trains LoRA on 1 rank, in one
`advisor train` call. At the boundary the full weights are handed on (trainer/handoff.py); the
losses of both stages equal those of the same curriculum run on 1 process throughout (the
unsplit reference: the same handoff, no data parallelism) within 1e-5, and a kill -9 in the
second stage followed by --resume continues bit-identically.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specs.plan_file import load_plan, stage_segments
from specs.core import Layout, ModelSpec
from planner.plan import PlanOptions, make_plan
from presets import load_hardware, load_task
from test_trainer import CONFIG, write_task

FULL_ON_TWO = Layout(dp=2, mbs=1, gas=2, dtype="fp32", seq=32)
FULL_ON_ONE = Layout(dp=1, mbs=1, gas=4, dtype="fp32", seq=32)
LORA_ON_ONE = Layout(dp=1, mbs=1, gas=4, method="lora", lora_rank=4, dtype="fp32", seq=32)
STEPS = 4


def write_plan(root: Path, first: Layout, second: Layout) -> Path:
    task = load_task(str(write_task(root, steps=STEPS)))
    task.stages[1].method = second.method
    plan = make_plan(PlanOptions(model=ModelSpec(name="tiny", hf_config=CONFIG), hardware=load_hardware("cpu"),
                                 gpus_per_node=2, task=task, min_compute_fraction=0.0))
    for stage, layout in zip(plan.stages, (first, second)):
        stage.layout, stage.devices, stage.steps, stage.method = layout, layout.devices, STEPS, layout.method
        stage.checkpoint_every_steps = 1
    plan.chosen.layout = first
    path = root / "plan.yaml"
    plan.write(path)
    return path


def train(plan: Path, out: Path, *extra: str, wait: bool = True) -> subprocess.Popen:
    command = [sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(out), *extra]
    proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    if wait:
        output = proc.communicate(timeout=900)[0].decode()
        assert proc.returncode == 0, output[-3000:]
    return proc


def losses(run: Path) -> list[tuple[str, float]]:
    return [(m["stage"], m["loss"]) for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_stages_with_equal_layouts_form_one_segment_and_a_new_method_starts_another(tmp_path) -> None:
    plan = load_plan(write_plan(tmp_path, FULL_ON_TWO, LORA_ON_ONE))
    assert [(s.first, s.end, s.layout.devices, s.layout.method) for s in stage_segments(plan)] == [
        (0, 1, 2, "full"), (1, 2, 1, "lora")]
    plan.stages[1].layout = FULL_ON_TWO
    assert [(s.first, s.end) for s in stage_segments(plan)] == [(0, 2)]


@pytest.mark.slow
def test_full_on_two_ranks_then_lora_on_one_matches_one_process_and_resumes_bit_identically(tmp_path) -> None:
    reference_plan = write_plan(tmp_path / "reference", FULL_ON_ONE, LORA_ON_ONE)
    train(reference_plan, tmp_path / "reference" / "run")
    expected = losses(tmp_path / "reference" / "run")
    assert [s for s, _ in expected] == ["language"] * STEPS + ["math"] * STEPS

    plan = write_plan(tmp_path / "split", FULL_ON_TWO, LORA_ON_ONE)
    run = tmp_path / "split" / "run"
    train(plan, run)
    measured = losses(run)
    assert [s for s, _ in measured] == [s for s, _ in expected]
    assert [v for _, v in measured] == pytest.approx([v for _, v in expected], abs=1e-5)  # no jump at the boundary
    summary = json.loads((run / "summary.json").read_text())
    assert summary["finished"] and set(summary["stages"][1]["eval"]) == {"language", "math"}

    # the LoRA stage starts from the first stage's weights: its adapters start at zero, so its first
    # loss is the fully fine-tuned model's, as in a run that never changes layout (no handoff)
    unchanged = write_plan(tmp_path / "one-layout", FULL_ON_ONE, FULL_ON_ONE)
    train(unchanged, tmp_path / "one-layout" / "run")
    never_handed_on = losses(tmp_path / "one-layout" / "run")
    assert [v for _, v in never_handed_on[:STEPS]] == pytest.approx([v for _, v in measured[:STEPS]], abs=1e-5)
    assert never_handed_on[STEPS][1] == pytest.approx(measured[STEPS][1], abs=1e-5)

    # kill -9 in the second (LoRA, 1-rank) stage, then --resume: the same losses, bit for bit
    killed = tmp_path / "split" / "killed"
    victim = train(plan, killed, wait=False)
    deadline = time.time() + 600
    while time.time() < deadline and victim.poll() is None:
        done = losses(killed) if (killed / "metrics.jsonl").is_file() else []
        if sum(stage == "math" for stage, _ in done) >= 2:
            break
        time.sleep(0.05)
    assert victim.poll() is None, "the run ended before it could be killed in its second stage"
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    train(plan, killed, "--resume")
    assert losses(killed) == measured
