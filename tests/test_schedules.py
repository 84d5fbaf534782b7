"""Schedules that give staging its best chance: warmup-stable-decay across stages, and data
mixtures that ramp from one stage to the next, each against its definition computed directly."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml

from specs.plan_file import load_plan
from test_trainer import make_plan_file, read_jsonl
from trainer.loop import TrainOptions, train
from trainer.schedule import wsd_lr
from trainer.stream import BLOCK, Source, StageStream


def test_wsd_warms_up_once_holds_each_stage_rate_and_decays_linearly_over_the_last_steps() -> None:
    run_steps, warmup, decay, floor = 40, 3, 8, 0.1
    peaks = [1e-3] * 20 + [5e-4] * 20  # two stages, each its own rate
    rates = [wsd_lr(g, run_steps, peaks[g], warmup, decay, floor) for g in range(run_steps)]
    # written out from the definition: (g+1)/(w+1) of the peak while warming, the peak while stable,
    # then a straight line from the peak down to floor*peak at the last step
    assert rates[:3] == pytest.approx([1e-3 * (g + 1) / 4 for g in range(3)])
    assert rates[3:20] == pytest.approx([1e-3] * 17) and rates[20:32] == pytest.approx([5e-4] * 12)
    assert rates[32:] == pytest.approx([5e-4 * (1 - 0.9 * k / 8) for k in range(1, 9)])
    assert rates[-1] == pytest.approx(5e-4 * floor)


def test_a_training_run_follows_wsd_across_its_stages(tmp_path) -> None:
    path = make_plan_file(tmp_path, steps=5)
    plan = load_plan(path)
    stages = [plan.task.stages[0], plan.task.stages[1].model_copy(update={"ramp_steps": 2})]
    plan.task = plan.task.model_copy(update={"lr_schedule": "wsd", "wsd_decay_fraction": 0.3, "stages": stages})
    train(plan, tmp_path / "run", resume=False, options=TrainOptions(show_progress=False))
    # the second stage's mixture starts from the first stage's own data, ramping to its own + replay
    from trainer.corpus import stage_sources, tokenizer_for

    sources = stage_sources(plan.task, 1, tokenizer_for(plan.task, "tiny", 272), 32, None)
    first = plan.task.stages[0].name
    assert {s.name.split(":")[0]: s.start_weight for s in sources} == {first: 1.0, plan.task.stages[1].name: 0.0}
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [s.steps for s in plan.stages]
    run_steps = sum(steps)
    decay = round(0.3 * run_steps)
    warmup = plan.task.stages[0].warmup_steps
    expected = []
    for index, spec in enumerate(plan.task.stages):
        for k in range(steps[index]):
            g = sum(steps[:index]) + k
            if g < warmup:
                expected.append(spec.lr * (g + 1) / (warmup + 1))
            elif g < run_steps - decay:
                expected.append(spec.lr)
            else:
                expected.append(spec.lr * (1 - (1 - spec.min_lr_ratio) * (g - (run_steps - decay) + 1) / decay))
    assert [m["lr"] for m in metrics] == pytest.approx(expected)


def _stream(ramp_sequences: int) -> StageStream:
    def source(name: str, weight: float, start: float) -> Source:
        token = {"old": 1, "new": 2, "replayed": 3}[name]
        return Source(name, np.full((10, 4), token, dtype=np.int64), weight, start)

    # the previous stage's data ("old") ramps out; this stage's own data and a replayed stage ramp in
    return StageStream([source("old", 0.0, 1.0), source("new", 0.7, 0.0), source("replayed", 0.3, 0.0)],
                       seed=0, stage_index=1, ramp_sequences=ramp_sequences)


def test_a_ramped_mixture_moves_linearly_from_the_previous_stage_to_this_ones_mix() -> None:
    ramp = 6000  # sequences: crosses a block boundary
    stream = _stream(ramp)
    tokens = stream.sequences(0, 2 * BLOCK + 1000)[:, 0]
    for start, stop in ((0, 600), (2000, 2600), (4000, 4600), (5400, 6000), (7000, 9000)):
        t = np.minimum((np.arange(start, stop) + 1) / ramp, 1.0)
        expected = {1: (1 - t).mean(), 2: (0.7 * t).mean(), 3: (0.3 * t).mean()}  # start + t (target - start)
        n = stop - start
        for token, share in expected.items():
            measured = float(np.mean(tokens[start:stop] == token))
            sigma = math.sqrt(max(share * (1 - share), 1e-9) / n)
            assert abs(measured - share) <= 4 * sigma + 1e-9, (start, token, measured, share)
    # the same positions draw the same sequences on a resume (a fresh stream)
    assert np.array_equal(_stream(ramp).sequences(4100, 50), stream.sequences(4100, 50))


def test_without_a_ramp_the_stage_switches_at_once() -> None:
    tokens = _stream(0).sequences(0, 3000)[:, 0]
    assert not np.any(tokens == 1)
    assert abs(float(np.mean(tokens == 2)) - 0.7) < 4 * math.sqrt(0.21 / 3000)


def test_the_task_schema_takes_the_schedule_and_the_ramp(tmp_path) -> None:
    from presets import load_task
    from test_trainer import write_task

    path = write_task(tmp_path)
    data = yaml.safe_load(path.read_text())
    data.update(lr_schedule="wsd", wsd_decay_fraction=0.2)
    data["stages"][1]["ramp_steps"] = 3
    path.write_text(yaml.safe_dump(data))
    task = load_task(str(path))
    assert task.lr_schedule == "wsd" and task.stages[1].ramp_steps == 3
    data["lr_schedule"] = "linear"
    path.write_text(yaml.safe_dump(data))
    from specs.errors import UsageError

    with pytest.raises(UsageError, match="lr_schedule"):
        load_task(str(path))
    assert json.dumps(task.model_dump(mode="json"))  # the plan file carries it


def test_which_trained_steps_a_longer_run_leaves_at_their_rates() -> None:
    """What makes a resume that extends bitwise (issue 32): every step already trained keeps its rate.
    Written out: WSD's stable phase does (a run stopped before its decay, lengthened: the decay moves
    later), its decay does not; cosine re-warm-up decays over the stage, so a longer stage changes
    the rate from the first step after the warm-up; constant holds the rate whatever the length."""
    from specs.task import StageSpec, TaskSpec
    from trainer.schedule import first_changed_rate

    def task(schedule: str) -> TaskSpec:
        stage = StageSpec(name="s", steps=1, lr=1e-3, warmup_steps=2, min_lr_ratio=0.1)
        return TaskSpec(name="t", stages=[stage], lr_schedule=schedule, wsd_decay_fraction=0.25)

    short, long = ([40], [40]), ([80], [80])  # the stage's steps, and the steps WSD counts
    assert first_changed_rate(task("wsd"), [30], short, long) is None  # stable until step 30 of 40
    # a finished 40-step WSD run decayed from step 31: at 80 steps that step is still stable
    assert first_changed_rate(task("wsd"), [40], short, long) == (31, pytest.approx(1e-3 * (1 - 0.9 / 10)), 1e-3)
    step, had, now = first_changed_rate(task("rewarm_cosine"), [40], short, long)
    assert step == 4 and had < now < 1e-3  # the cosine of 80 steps falls more slowly
    assert first_changed_rate(task("rewarm_cosine"), [2], short, long) is None  # still warming up
    assert first_changed_rate(task("constant"), [40], short, long) is None
