"""A plan made without `--task` trains as one stage over `advisor train --data PATH`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

from advisor.cli import app
from trainer.data.tokenizer import TextTokenizer, resolve_tokenizer_path

runner = CliRunner()
SEQ, BATCH = 32, 4
WORDS = "the cat sat on a mat while dogs ran in the park and birds sang over old trees".split()


def _texts(count: int, offset: int = 0) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12 + i % 5)) for i in range(offset, offset + count)]


def _plan(tmp_path: Path) -> Path:
    out = tmp_path / "plan.yaml"
    made = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                               "--seq-len", str(SEQ), "--global-batch", str(BATCH), "--top", "1", "--out", str(out)])
    assert made.exit_code == 0, made.output
    return out


def _train(plan: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(out), *extra]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_plan_without_task_trains_one_pass_over_a_jsonl_file(tmp_path: Path) -> None:
    data = tmp_path / "some.jsonl"
    texts = _texts(40)
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    done = _train(_plan(tmp_path), tmp_path / "run", "--data", str(data))
    assert done.returncode == 0, done.stderr
    # one pass, counted independently: documents closed by end-of-text, packed into full sequences
    tokenizer = TextTokenizer(resolve_tokenizer_path(None, "demo-tiny", tmp_path))
    tokens = sum(len(ids) + 1 for ids in tokenizer.encode(texts))
    steps = math.ceil(tokens // SEQ / BATCH)
    metrics = _metrics(tmp_path / "run")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert {m["stage"] for m in metrics} == {"train"} and all(math.isfinite(m["loss"]) for m in metrics)
    run_plan = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert [s["steps"] for s in run_plan["stages"]] == [steps]
    assert run_plan["task"]["stages"][0]["sources"][0]["path"] == str(data.resolve())


@pytest.mark.slow
def test_plan_without_task_trains_a_folder_of_parquet_for_the_tokens_asked(tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    for part in range(2):
        pq.write_table(pa.table({"text": _texts(30, offset=30 * part)}), folder / f"part-{part}.parquet")
    tokens = 3 * SEQ * BATCH - 5  # rounds up to 3 whole steps
    done = _train(_plan(tmp_path), tmp_path / "run", "--data", str(folder), "--tokens", str(tokens))
    assert done.returncode == 0, done.stderr
    assert [m["step"] for m in _metrics(tmp_path / "run")] == [1, 2, 3]


def test_plan_without_task_needs_data(tmp_path: Path) -> None:
    result = runner.invoke(app, ["train", str(_plan(tmp_path)), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2
    assert "this plan has no task: give the data to train on with --data" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_steps_and_tokens_belong_to_plans_without_a_task(tmp_path: Path) -> None:
    plan = tmp_path / "task_plan.yaml"
    made = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                               "--task", "demo", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    result = runner.invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--steps", "3"])
    assert result.exit_code == 2
    assert "--steps and --tokens size a plan made without --task" in result.stderr
    result = runner.invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--lr-schedule", "constant"])
    assert result.exit_code == 2 and "this plan's task sets its own (its lr_schedule)" in result.stderr
    result = runner.invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--lr-schedule", "flat"])
    assert result.exit_code == 2 and "--lr-schedule flat: choose rewarm_cosine, wsd, constant" in result.stderr


def test_data_of_mixed_kinds_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    (folder / "b.txt").write_text("y\n")
    result = runner.invoke(app, ["train", str(_plan(tmp_path)), "--out", str(tmp_path / "run"), "--data", str(folder)])
    assert result.exit_code == 2
    assert "mixes jsonl and text files" in result.stderr


@pytest.mark.slow
def test_plan_without_task_trains_a_prepared_folder_as_one_bucketed_stage(tmp_path: Path) -> None:
    prepared = tmp_path / "prepared"
    made = runner.invoke(app, ["data", "prepare", "--task", "demo", "--out", str(prepared)])
    assert made.exit_code == 0, made.output
    plan = tmp_path / "plan.yaml"
    made = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                               "--seq-len", "256", "--global-batch", str(BATCH), "--top", "1", "--out", str(plan)])
    assert made.exit_code == 0, made.output
    done = _train(plan, tmp_path / "run", "--data", str(prepared), "--max-steps-per-stage", "2")
    assert done.returncode == 0, done.stderr
    # one pass: every stage's prepared train tokens, in whole steps of the plan's batch
    manifest = json.loads((prepared / "manifest.json").read_text())
    tokens = sum(stage["train"]["tokens"] for stage in manifest["stages"])
    run_plan = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert run_plan["stages"][0]["steps"] == math.ceil(tokens / (BATCH * 256))
    assert len(_metrics(tmp_path / "run")) == 2
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "data" and e["source"] == "prepared" for e in events)
