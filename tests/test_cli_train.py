"""`advisor train`'s workers: every option reaches them intact through the launch file the launcher
writes (trainer/launch_file.py), and the train verb has no options for workers (they never re-enter it)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

import trainer.launch
import trainer.worker
from advisor.cli import app
from specs.plan_file import load_plan
from test_trainer import make_plan_file
from trainer.data.chat_templates import TEMPLATE_NAMES
from trainer.launch_file import LaunchFile, launch_file_path, read_launch_file, write_launch_file
from trainer.options import TrainOptions

runner = CliRunner()


CHOICES = {"template": TEMPLATE_NAMES[-1]}  # string options that take one of a few names, not a path


def _other_value(field: dataclasses.Field, root: Path):
    """A value of the field's type that is not its default (a path for the string fields)."""
    default = field.default
    if field.name in CHOICES:
        return CHOICES[field.name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 2
    if isinstance(default, float):
        return default / 4 + 0.125
    if field.type == "int | None":
        return 7
    if field.type == "float | None":
        return 1.5
    if field.type == "str | None":
        return str(root.resolve() / field.name)
    raise AssertionError(f"TrainOptions.{field.name}: teach this test a value of type {field.type}")


def _every_option_changed(root: Path) -> TrainOptions:
    """TrainOptions with every field, found by introspection, away from its default: a field the
    launch file dropped would arrive as its default and fail the comparison."""
    sent = TrainOptions(**{f.name: _other_value(f, root) for f in dataclasses.fields(TrainOptions)})
    assert all(getattr(sent, f.name) != f.default for f in dataclasses.fields(TrainOptions))
    return sent


def test_every_train_option_round_trips_through_the_launch_file(tmp_path) -> None:
    plan = load_plan(make_plan_file(tmp_path, devices=2, steps=2)).model_copy(update={"engine": "fsdp2"})
    sent = _every_option_changed(tmp_path)
    path = write_launch_file(launch_file_path(tmp_path / "run"), LaunchFile(plan=plan, out=tmp_path / "run",
                                                                           resume=True, options=sent))
    assert path == tmp_path / "run" / "launch.json" and [p.name for p in path.parent.iterdir()] == ["launch.json"]
    received = read_launch_file(path)
    assert isinstance(received.options, TrainOptions) and received.options == sent
    assert received.plan == plan and received.plan.engine == "fsdp2"
    assert received.out == tmp_path / "run" and received.resume is True
    assert launch_file_path(tmp_path, node_rank=3).name == "launch.node3.json"  # nodes may share the run dir


def test_the_launcher_starts_workers_on_its_launch_file_and_they_train_what_it_says(tmp_path, monkeypatch) -> None:
    """trainer.launch.run -> torchrun's command -> trainer.worker, with the process starts replaced by
    calls: the command names the worker module (never the CLI) on a launch file that holds the plan
    and every option, and the worker trains exactly those; the file is gone after the launch."""
    plan = load_plan(make_plan_file(tmp_path, devices=2, steps=2)).model_copy(update={"engine": "deepspeed"})
    assert plan.chosen.layout.devices == 2
    sent = _every_option_changed(tmp_path)
    commands: list[list[str]] = []
    trained: dict = {}

    def torchrun(command, env, check):  # what torchrun's ranks would do: run the worker on its argument
        commands.append(command)
        assert trainer.worker.run_worker(Path(command[-1])) == {}
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", torchrun)
    monkeypatch.setattr(trainer.launch, "_cuda", lambda: False)
    monkeypatch.setattr(trainer.launch, "train_rank", lambda plan, out, resume, options, distributed:
                        trained.update(plan=plan, out=out, resume=resume, options=options,
                                       distributed=distributed) or {})
    run = tmp_path / "run"
    trainer.launch.run(plan, run, False, sent, None, 0, "127.0.0.1", 29999)
    [command] = commands
    assert command[-3:] == ["-m", "trainer.worker", str(launch_file_path(run))] and "advisor.cli" not in command
    assert trained == {"plan": plan, "out": run, "resume": False, "options": sent, "distributed": True}
    assert not launch_file_path(run).exists()


def test_a_worker_without_a_launch_file_says_so_in_one_line(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-m", "trainer.worker", str(tmp_path / "launch.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: launch file not found: {tmp_path / 'launch.json'} (workers are started by `advisor train`)"]
    (tmp_path / "launch.json").write_text('{"version": 1, "out": "run"}')
    broken = subprocess.run([sys.executable, "-m", "trainer.worker", str(tmp_path / "launch.json")],
                            capture_output=True, text=True, timeout=120)
    assert broken.returncode == 2 and broken.stderr.startswith(f"error: launch file {tmp_path / 'launch.json'}: ")
    assert len(broken.stderr.strip().splitlines()) == 1


def test_advisor_train_has_no_options_for_workers(tmp_path) -> None:
    plan = make_plan_file(tmp_path, devices=2, steps=2)
    refused = runner.invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--launched"])
    assert refused.exit_code == 2 and "No such option" in refused.output
    assert not (tmp_path / "run").exists()
