"""`advisor train` as the launcher's workers meet it: every option crosses the process boundary intact."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

import trainer.launch
from advisor.cli import app
from advisor.plan_file import load_plan
from trainer.data.chat_templates import TEMPLATE_NAMES
from trainer.launch import launch_command
from trainer.options import TrainOptions, train_argv

runner = CliRunner()


CHOICES = {"template": TEMPLATE_NAMES[-1]}  # string options that take one of a few names, not a path


def _other_value(field: dataclasses.Field, root: Path):
    """A value of the field's type that is not its default (a path, resolved, for the string fields:
    `--data` is resolved by the verb)."""
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


@pytest.mark.parametrize("values", ["others", "defaults"])  # the defaults: a `--no-x` flag the verb must know
def test_every_train_option_round_trips_through_a_launched_worker_argv(tmp_path, monkeypatch, values) -> None:
    plan_path = tmp_path / "plan.yaml"
    made = runner.invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                               "--out", str(plan_path)])
    assert made.exit_code == 0, made.output
    sent = TrainOptions(**{f.name: _other_value(f, tmp_path) for f in dataclasses.fields(TrainOptions)})
    assert all(getattr(sent, f.name) != f.default for f in dataclasses.fields(TrainOptions))
    sent = sent if values == "others" else TrainOptions()
    plan = load_plan(plan_path).model_copy(update={"engine": "fsdp2"})
    command = launch_command(plan, plan_path, tmp_path / "run", False, sent, 2, 1, 0, "127.0.0.1", 29513)
    received = {}

    def worker(plan, plan_file, out, resume, options, launched, *rest):
        received.update(plan=plan, options=options, launched=launched)

    monkeypatch.setattr(trainer.launch, "run", worker)
    result = runner.invoke(app, command[command.index("advisor.cli") + 1:])
    assert result.exit_code == 0, result.output
    assert received["launched"] and received["plan"].engine == "fsdp2"
    assert received["options"] == sent


def test_verification_trials_tell_their_workers_to_evaluate_one_sequence() -> None:
    argv = train_argv(TrainOptions(max_steps_per_stage=4, show_progress=False, eval_sequences=1))
    assert argv[argv.index("--eval-sequences") + 1] == "1" and "--no-show-progress" in argv
