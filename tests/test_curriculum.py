"""Curriculum comparison and per-stage sequence lengths.

* A stage with its own `seq_len` gets its own layout at the plan's tokens per step, and trains at it.
* The variants of `advisor curriculum compare` train at equal tokens; one-pot's pooled mixture
  weights each file by the tokens the task as written draws from it.
* The recommendation holds in both directions: a clear winner is recommended, overlapping spreads
  say the choice does not matter.
* `advisor curriculum compare` on a 2-stage toy task (a few steps, 2 seeds) writes the table and the JSON.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trainer.stage_runner
from specs.plan_file import stage_segments
from specs.core import ModelSpec
from planner.plan import PlanOptions, make_plan
from presets import load_hardware, load_task
from reports.curriculum import Stat, forgetting, RunResult, recommend
from reports.curriculum_variants import COMPARISON_GUARD, pooled_mixture, task_steps, variant_tasks
from test_trainer import CONFIG, write_task
from trainer.launch import run
from trainer.options import TrainOptions
from trainer.spike import SpikeGuard


def _two_seq_plan(root: Path):
    task = load_task(str(write_task(root, steps=4)))
    task.stages[1] = task.stages[1].model_copy(update={"seq_len": 64})
    return make_plan(PlanOptions(model=ModelSpec(name="tiny", hf_config=CONFIG), hardware=load_hardware("cpu"),
                                 gpus_per_node=1, task=task, min_compute_fraction=0.0))


def test_a_stage_with_its_own_seq_len_gets_its_own_layout_and_trains_at_it(tmp_path, monkeypatch) -> None:
    plan = _two_seq_plan(tmp_path)
    first, second = (s.layout for s in plan.stages)
    assert (first.seq, second.seq) == (32, 64)
    # the task's 4 sequences of 32 tokens per step: the 64-token stage takes 2 (equal tokens per step)
    assert (first.global_batch, second.global_batch) == (4, 2)
    assert [(s.first, s.end) for s in stage_segments(plan)] == [(0, 1), (1, 2)]
    assert [s.steps for s in plan.stages] == [4, 4]

    seen: list[tuple[int, ...]] = []
    real_step = trainer.stage_runner.optimizer_step

    def recording_step(engine, micro_batches, lr):
        batches = list(micro_batches)
        seen.append(tuple(b.shape[1] for b in batches) + (sum(b.shape[0] for b in batches),))
        return real_step(engine, batches, lr)

    monkeypatch.setattr(trainer.stage_runner, "optimizer_step", recording_step)
    summary = run(plan, tmp_path / "run", False, TrainOptions(show_progress=False), None, 0, "127.0.0.1", 29513)
    assert summary["finished"]
    per_stage = [seen[:4], seen[4:]]
    assert len(seen) == 8
    for steps, layout in zip(per_stage, (first, second)):
        for shapes in steps:  # every micro-batch at the stage's length, the step's sequences = its batch
            assert set(shapes[:-1]) == {layout.seq} and shapes[-1] == layout.global_batch


def test_variants_train_at_equal_tokens_and_one_pot_pools_by_tokens_drawn() -> None:
    task = load_task("demo")
    variants = variant_tasks(task)
    steps = {name: task_steps(spec) for name, spec in variants.items()}
    assert set(steps.values()) == {task_steps(task)}, steps
    # drawn by the task as written: language 32k + 30% of mixed's 48k; arithmetic 320k + 30% of 48k;
    # instructions 320k; mixed's own 40% of 48k
    expected = {"language": 46_400, "arithmetic": 334_400, "instructions": 320_000, "mixed": 19_200}
    pooled = {Path(src.path).stem: src.weight for src in pooled_mixture(task)}
    assert pooled == pytest.approx({k: v / 720_000 for k, v in expected.items()})
    assert [s.name for s in variants["staged"].stages] == ["language", "reasoning", "instructions"]
    assert all(not s.replay and not s.ramp_steps for s in variants["staged"].stages)
    # the fair protocol: every variant under WSD, every stage at one peak rate with one warm-up and floor
    for spec in variants.values():
        assert spec.lr_schedule == "wsd"
        assert {(s.lr, s.warmup_steps, s.min_lr_ratio) for s in spec.stages} == {(2e-3, 10, 0.1)}
    as_written = variants["staged+replay+mixed"].stages
    assert [(s.name, s.sources, s.replay, s.tokens) for s in as_written] == \
        [(s.name, s.sources, s.replay, s.tokens) for s in task.stages]
    # late-mix: 32 + 313 + 313 + 47 = 705 steps of 4 x 256 tokens, 70 of decay (10%, rounded): the pooled
    # mixture for 635, then the later skills' data (reasoning 320k, instructions 320k, mixed's own 40%
    # of 48k) with 30% replay of the pool
    assert task_steps(task) == 705
    late = variants["late-mix"].stages
    assert [s.name for s in late] == ["language", "reasoning", "instructions", "mixed", "late-mix"]
    assert late[-1].tokens == 70 * 4 * 256 and late[-1].replay == {"mixed": 0.3} and not late[-1].eval_sources
    assert {Path(src.path).stem: src.weight for src in late[-1].sources} == pytest.approx(
        {"arithmetic": 320 / 659.2, "instructions": 320 / 659.2, "mixed": 19.2 / 659.2})
    assert all(s.sources == variants["one-pot"].stages[0].sources for s in late[:-1])


def test_a_clear_winner_is_recommended() -> None:
    stats = {"one-pot": Stat(3.00, 0.02, 3), "staged": Stat(3.20, 0.03, 3), "late-mix": Stat(3.10, 0.05, 3)}
    rec = recommend(stats)
    assert rec.winner == "one-pot" and rec.tied == []
    assert "use one-pot" in rec.text
    # higher is better (exact match): the same rule, mirrored
    assert recommend({"a": Stat(0.9, 0.01, 2), "b": Stat(0.5, 0.01, 2)}, lower_is_better=False).winner == "a"


def test_overlapping_spreads_mean_the_choice_does_not_matter() -> None:
    # best by 0.04, but the runner-up's spread is 0.05: not beyond it
    stats = {"one-pot": Stat(3.00, 0.02, 3), "staged": Stat(3.04, 0.05, 3), "late-mix": Stat(3.50, 0.01, 3)}
    rec = recommend(stats)
    assert rec.winner is None and rec.best == "one-pot" and rec.tied == ["staged"]
    assert "does not matter" in rec.text
    # one seed: no spread to judge by, so no recommendation however large the gap
    lone = recommend({"a": Stat(1.0, math.nan, 1), "b": Stat(5.0, math.nan, 1)})
    assert lone.winner is None and lone.best == "a" and lone.tied == [] and "one seed" in lone.text


def test_forgetting_is_the_rise_after_its_stage_and_recovery_the_share_the_mixed_stage_took_back() -> None:
    stages = [{"name": "language", "eval": {"language": 3.0}},
              {"name": "reasoning", "eval": {"language": 3.4}},
              {"name": "instructions", "eval": {"language": 3.5}},
              {"name": "mixed", "eval": {"language": 3.2}}]
    result = forgetting(RunResult("staged+replay+mixed", 0, stages, 0, 0.0), "language", "mixed")
    assert result["forgetting"] == pytest.approx(0.5) and result["recovered"] == pytest.approx(0.3 / 0.5)


def test_curriculum_compare_on_a_toy_task_writes_the_table_and_the_json(tmp_path) -> None:
    task = write_task(tmp_path, steps=4)
    model = tmp_path / "tiny" / "config.json"
    model.parent.mkdir()
    model.write_text(json.dumps(CONFIG))
    out = tmp_path / "compare"
    command = [sys.executable, "-m", "advisor.cli", "curriculum", "compare", "--task", str(task), "--model", str(model),
               "--seeds", "2", "--variants", "one-pot,staged", "--scale", "0.5", "--lr-grid", "0.5,1", "--out", str(out),
               "--json"]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout.strip().splitlines()[-1])
    written = json.loads((out / "compare.json").read_text())
    assert written["complete"] and printed["variants"].keys() == written["variants"].keys() == {"one-pot", "staged"}
    assert written["skills"] == ["language", "math"]
    assert written["lr_grid"] == pytest.approx([1.5e-3, 3e-3]) and written["runs_done"] == 2 * (2 + 1)
    for entry in written["variants"].values():
        assert entry["tokens"] == 4 * 32 * 4  # half the toy's 2 x 4 steps, at 4 x 32 tokens each
        # seed 0 at both rates; the rate with the lower final mean eval loss is kept for seed 1
        tried = {point["lr"]: point["mean_eval_loss"] for point in entry["lr"]["grid"]}
        assert tried.keys() == {1.5e-3, 3e-3} and entry["lr"]["chosen"] == min(tried, key=tried.get)
        assert sorted((r["seed"], r["lr"]) for r in entry["runs"]) == [(0, entry["lr"]["chosen"]), (1, entry["lr"]["chosen"])]
        losses = [[r["stages"][-1]["eval"][skill] for r in entry["runs"]] for skill in written["skills"]]
        for skill, values in zip(written["skills"], losses):  # the JSON's mean and spread are the runs'
            assert entry["eval"]["skills"][skill]["mean"] == pytest.approx(sum(values) / 2)
            assert entry["eval"]["skills"][skill]["spread"] == pytest.approx(abs(values[0] - values[1]) / math.sqrt(2))
    table = (out / "compare.md").read_text()
    assert "| one-pot |" in table and "| staged |" in table and "Recommendation" in table
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_a_measured_finding_about_the_task_reaches_the_plan(tmp_path, monkeypatch) -> None:
    import presets

    demo, cpu, model = load_task("demo"), load_hardware("cpu"), presets.load_model("demo-tiny")
    (tmp_path / "findings").mkdir()
    (tmp_path / "findings" / "demo.json").write_text(json.dumps({"task": "demo", "finding": "measured: one-pot wins"}))
    monkeypatch.setattr(presets, "PRESETS_DIR", tmp_path)
    assert presets.task_finding("demo") == "measured: one-pot wins" and presets.task_finding("other") is None
    plan = make_plan(PlanOptions(model=model, hardware=cpu, gpus_per_node=1, task=demo,
                                 min_compute_fraction=0.0))
    assert "measured: one-pot wins" in plan.notes


def test_an_unknown_variant_is_one_line_and_exit_2(tmp_path) -> None:
    from typer.testing import CliRunner

    from advisor.cli import app

    result = CliRunner().invoke(app, ["curriculum", "compare", "--task", "demo", "--variants", "one-pot,twice",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown variant(s) twice" in result.output
    assert "Traceback" not in result.output
    for grid in ("0.5,x", "0,1", "nan", ","):
        result = CliRunner().invoke(app, ["curriculum", "compare", "--task", "demo", "--lr-grid", grid,
                                          "--out", str(tmp_path)])
        assert result.exit_code == 2 and "--lr-grid" in result.output and "Traceback" not in result.output, grid
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_the_finding_is_stated_only_when_no_staged_variant_matches_one_pot_on_every_skill() -> None:
    from reports.curriculum import one_pot_finding

    def entry(language: float, reasoning: float, n: int = 3) -> dict:
        return {"eval": {"skills": {"language": {"mean": language, "spread": 0.01, "n": n},
                                    "reasoning": {"mean": reasoning, "spread": 0.01, "n": n}}}}

    skills = ["language", "reasoning"]
    pot = entry(1.0, 1.0)
    # each staged variant loses one skill beyond the spread: no variant matches on every skill
    assert one_pot_finding({"one-pot": pot, "staged": entry(1.5, 0.9), "late-mix": entry(0.9, 1.5)}, skills)
    # within the spread on one, better on the other: it matches
    assert one_pot_finding({"one-pot": pot, "staged": entry(1.01, 0.5), "late-mix": entry(2, 2)}, skills) is None
    # one seed: no spread, no finding
    assert one_pot_finding({"one-pot": pot, "staged": entry(1.5, 1.5, n=1)}, skills) is None


def _toy_variant_runs(root: Path) -> dict[str, tuple[object, list[dict]]]:
    """Every variant of the toy two-stage task (10 steps, 3 of them decay), trained by the trainer:
    its plan and its metrics.jsonl."""
    from reports.curriculum import plan_variant
    from trainer.loop import train

    task = load_task(str(write_task(root, steps=5))).model_copy(update={"wsd_decay_fraction": 0.3})
    out = {}
    for name, spec in variant_tasks(task, peak_lr=2e-3).items():
        plan = plan_variant(spec, ModelSpec(name="tiny", hf_config=CONFIG), load_hardware("cpu"))
        train(plan, root / name, resume=False, options=TrainOptions(show_progress=False, eval_sequences=2))
        out[name] = (plan, [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()])
    return out


def test_every_variant_trains_one_wsd_schedule_at_equal_tokens_and_late_mix_switches_at_the_decay(tmp_path) -> None:
    runs = _toy_variant_runs(tmp_path)
    # the definition, written out: 2 warm-up steps rising to the peak, the peak, then a straight line
    # over the last 3 of 10 steps down to 10% of the peak at the last step
    peak, warmup, run_steps, decay, floor = 2e-3, 2, 10, 3, 0.1
    expected = [peak * (g + 1) / (warmup + 1) if g < warmup else peak if g < run_steps - decay
                else peak * (1 - (1 - floor) * (g - (run_steps - decay) + 1) / decay) for g in range(run_steps)]
    tokens = {}
    for name, (plan, metrics) in runs.items():
        assert [m["lr"] for m in metrics] == pytest.approx(expected), name
        per_stage = {s.name: s.layout.tokens_per_step for s in plan.stages}
        tokens[name] = sum(per_stage[m["stage"]] for m in metrics)
        micro_batch_tokens = plan.chosen.layout.mbs * plan.chosen.layout.seq
    assert max(tokens.values()) - min(tokens.values()) <= micro_batch_tokens, tokens
    # late-mix: the pooled mixture until the decay, its own mix from the decay's first step on
    stages = [m["stage"] for m in runs["late-mix"][1]]
    assert stages.index("late-mix") == run_steps - decay and set(stages[run_steps - decay:]) == {"late-mix"}
    plan = runs["late-mix"][0]
    assert plan.task.stages[-1].sources != plan.task.stages[0].sources


def test_every_variant_runs_under_the_comparisons_guard_which_lets_a_mixed_batch_pass() -> None:
    """The 10x bench's one-pot runs stopped after 3 rollbacks: a pooled batch's loss (0.88 against a
    running mean of 0.42 on the demo proxy, measured) crossed the demo's loss margins. Every variant
    gets the comparison's guard, which lets such a batch pass and still catches a NaN."""
    demo = load_task("demo")
    assert all(v.spike_guard == COMPARISON_GUARD for v in variant_tasks(demo).values())

    def first_spike(spec) -> str | None:
        guard = SpikeGuard.for_task(spec, warmup_steps=20)
        reasons = [guard.check(loss, 1.0) for loss in [0.42, 0.41] * 15 + [0.88, float("nan")]]
        return next((r for r in reasons if r), None)

    assert first_spike(demo.spike_guard).startswith("loss 0.88 above")
    assert first_spike(COMPARISON_GUARD).startswith("non-finite loss nan")


def test_a_killed_comparison_leaves_no_worker_training(tmp_path) -> None:
    """SIGKILL the process that runs a comparison's pool while a worker trains: the worker (spawned, so
    out of its signal path) goes with it instead of training on (they were found orphaned, training)."""
    script, started = tmp_path / "pool.py", tmp_path / "started"
    script.write_text("import os, sys, time\nfrom pathlib import Path\nfrom reports.curriculum import _in_parallel\n"
                      "def work(marker):\n    Path(marker).write_text(str(os.getpid()))\n    time.sleep(120)\n"
                      "if __name__ == '__main__':\n    list(_in_parallel([(sys.argv[1],)], 1, 0, work))\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    parent = subprocess.Popen([sys.executable, str(script), str(started)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        worker = int(started.read_text())
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), f"worker {worker} outlived its comparison"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
