"""A task preset whose data is generated (the demo) works as the README writes it: its data is made
on first use into the cache, the same bytes for every process, and a missing source's error names
the file, and the command that writes it when there is one.

Truths: the bytes `advisor data generate-demo` writes into a folder of its own; the files the error
names exist after running the command it gives; a task's own data is never "generated".
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from advisor.cli import app
from advisor.cli.data import DATA_EXTRA
from advisor.cli.run_chain import RunOptions, _task_ref
from specs.errors import UsageError
from presets import cache_dir, generated_data_dir, load_task
from trainer.corpus import ByteTokenizer, load_source
from trainer.data.demo_corpus import DEMO_FILES, STAMP_NAME, ensure_generated_data, generate_demo_corpus

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ADVISOR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _ensure_in_child(cache: str) -> None:
    os.environ["ADVISOR_CACHE"] = cache
    ensure_generated_data(load_task("demo"))


def test_the_demo_preset_generates_its_data_once_into_the_cache(fresh_cache: Path, tmp_path: Path) -> None:
    task = load_task("demo")
    assert Path(task.base_dir) == generated_data_dir("demo") == fresh_cache / "tasks" / "demo"
    assert ensure_generated_data(task) == Path(task.base_dir)
    reference = tmp_path / "reference"
    assert CliRunner().invoke(app, ["data", "generate-demo", "--out", str(reference)]).exit_code == 0
    for name in DEMO_FILES:
        assert (Path(task.base_dir) / "data" / name).read_bytes() == (reference / "data" / name).read_bytes()
    for stage in task.stages:
        for source in [*stage.sources, *stage.eval_sources]:
            assert (Path(task.base_dir) / source.path).is_file()
    assert ensure_generated_data(task) is None  # second use: nothing rewritten
    (Path(task.base_dir) / "data" / "mixed.jsonl").unlink()
    assert ensure_generated_data(task) is not None
    assert (Path(task.base_dir) / "data" / "mixed.jsonl").read_bytes() == (reference / "data" / "mixed.jsonl").read_bytes()
    (Path(task.base_dir) / STAMP_NAME).write_text("{")  # torn stamp: regenerate, never crash
    assert ensure_generated_data(task) is not None


def test_concurrent_first_uses_agree(fresh_cache: Path, tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    children = [context.Process(target=_ensure_in_child, args=(str(fresh_cache),)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    generate_demo_corpus(tmp_path / "reference", write_task=False)
    data = generated_data_dir("demo") / "data"
    assert sorted(p.name for p in data.iterdir()) == sorted(DEMO_FILES)  # no temporary file left behind
    for name in DEMO_FILES:
        assert (data / name).read_bytes() == (tmp_path / "reference" / "data" / name).read_bytes()


def test_a_task_of_ones_own_is_never_generated(fresh_cache: Path, tmp_path: Path) -> None:
    (tmp_path / "task.yaml").write_text("name: demo\nstages: [{name: a, sources: [{path: data/language.jsonl}], "
                                        "tokens: 1000}]\n")
    task = load_task(str(tmp_path / "task.yaml"))  # named like the preset, but its data is its own
    assert ensure_generated_data(task) is None
    assert not (tmp_path / "data").exists() and not cache_dir().exists()
    with pytest.raises(UsageError) as error:
        load_source(task.stages[0].sources[0], task, ByteTokenizer(), 64, None)
    assert str(error.value) == f"data source not found: {tmp_path / 'data' / 'language.jsonl'}"


def test_a_missing_generated_source_names_the_command_that_writes_it(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    generate_demo_corpus(folder, scale=0.01)
    (folder / "data" / "language.jsonl").unlink()
    task = load_task(str(folder / "task.yaml"))
    with pytest.raises(UsageError) as error:
        load_source(task.stages[0].sources[0], task, ByteTokenizer(), 64, None)
    message = str(error.value)
    assert message.startswith(f"data source not found: {folder / 'data' / 'language.jsonl'}")
    command = message.split("`")[1]
    assert command.split()[:3] == ["advisor", "data", "generate-demo"]
    assert CliRunner().invoke(app, command.split()[1:]).exit_code == 0
    assert (folder / "data" / "language.jsonl").is_file()  # the named command makes the named file


def test_advisor_run_trains_the_preset_on_the_cached_data(fresh_cache: Path, tmp_path: Path) -> None:
    said: list[str] = []
    assert _task_ref(RunOptions(out=tmp_path / "run"), said.append) == "demo"
    assert (generated_data_dir("demo") / "data" / "language.jsonl").is_file()
    assert not (tmp_path / "run" / "data").exists()  # one copy of the demo data, in the cache
    assert said == [f"generated the demo curriculum into {generated_data_dir('demo')}/data"]
    said.clear()
    _task_ref(RunOptions(out=tmp_path / "other"), said.append)
    assert said == []


@pytest.mark.slow
def test_plan_then_train_the_demo_preset_in_a_fresh_home(tmp_path: Path) -> None:
    """The README's two commands, as written, in a fresh home (one step per stage), in every process
    as on an install without the `data` extra (the main job does not need it)."""
    home = tmp_path / "home"
    home.mkdir()
    without_extra = tmp_path / "without-data-extra"
    without_extra.mkdir()
    (without_extra / "sitecustomize.py").write_text(  # None in sys.modules: Python's mark of an absent module
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in DATA_EXTRA))
    env = {k: v for k, v in os.environ.items() if k != "ADVISOR_CACHE"}
    env.update(HOME=str(home), PYTHONPATH=f"{without_extra}{os.pathsep}{ROOT}")
    for args in (["plan", "--model", "demo-tiny", "--hardware", "cpu", "--task", "demo", "--out", "plan.yaml"],
                 ["train", "plan.yaml", "--max-steps-per-stage", "1"]):
        done = subprocess.run([sys.executable, "-m", "advisor.cli", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"advisor {' '.join(args)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert (home / ".cache" / "advisor" / "tasks" / "demo" / "data" / "language.jsonl").is_file()
    assert "generated the demo task's data" in done.stdout
    assert (tmp_path / "runs" / "latest" / "metrics.jsonl").is_file()
    # exact match per skill after each stage: the arithmetic and instruction answers are scored,
    # language has none (n/a); one step per stage is far from answering, so only the shape is pinned
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    scored = [stage["exact_match"] for stage in summary["stages"]]
    assert [list(s) for s in scored] == [["language"], ["language", "reasoning"],
                                         ["language", "reasoning", "instructions"],
                                         ["language", "reasoning", "instructions"]]
    assert all(s["language"] is None for s in scored)
    assert all(0.0 <= s[skill] <= 1.0 for s in scored for skill in s if skill != "language")
    assert "after reasoning: exact match language n/a, reasoning " in done.stdout
