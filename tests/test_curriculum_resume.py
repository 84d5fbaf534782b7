"""`advisor curriculum compare` run again into the same --out, and the peak rate at the grid's edge.

* The same comparison again trains nothing: every run is read from its run dir (same fingerprint)
  and the result is the same, but for the count of reused runs.
* A changed input trains only the runs it changes: another seed trains that seed's runs; another
  --scale trains every run again, the stale ones moved aside (not deleted).
* A run dir whose run did not finish is trained again, its old contents moved aside; one stopped
  after a checkpoint is resumed from it.
* A variant whose chosen rate is the grid's lowest or highest is flagged in the JSON, the tuning
  table and the console.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import reports.curriculum as cc
from presets import load_hardware, load_task
from specs.core import ModelSpec
from test_trainer import CONFIG, write_task

STEPS = 2  # per stage of the toy task: a compare of two runs trains 2 x 4 steps


def _request(root: Path, **changes) -> cc.CompareRequest:
    task = load_task(str(root / "task.yaml")) if (root / "task.yaml").exists() else load_task(
        str(write_task(root, steps=STEPS)))
    fields = {"task": task, "model": ModelSpec(name="tiny", hf_config=CONFIG), "hardware": load_hardware("cpu"),
              "out": root / "compare", "seeds": 1, "variants": ("one-pot",), "eval_sequences": 2,
              "lr_factors": (1.0,), **changes}
    return cc.CompareRequest(**fields)


@pytest.fixture
def trained(monkeypatch) -> list[Path]:
    """Counts the runs `compare` trains (their run dirs), training them as it would."""
    calls: list[Path] = []
    real = cc.train_run

    def counting(plan, run_dir, *args):
        calls.append(run_dir)
        return real(plan, run_dir, *args)

    monkeypatch.setattr(cc, "train_run", counting)
    return calls


def _without_reuse_counts(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("runs_reused", "runs_resumed")}


def test_the_same_comparison_again_trains_nothing_and_gives_the_same_result(tmp_path, trained) -> None:
    first = cc.compare(_request(tmp_path, lr_factors=(0.5, 1.0)))
    assert len(trained) == 2 and first["runs_reused"] == 0 and first["complete"]
    written = (tmp_path / "compare" / "compare.json").read_text()
    trained.clear()
    shown: list[tuple[str, int]] = []  # what the progress bar is told: every reused run's steps, as done
    progress = cc.Progress(reused=lambda variant, seed, run_dir, steps: shown.append((run_dir.parent.name, steps)))
    again = cc.compare(_request(tmp_path, lr_factors=(0.5, 1.0)), progress=progress)
    assert trained == [] and again["runs_reused"] == 2 and again["runs_resumed"] == 0
    assert sorted(shown) == [("lr-0.0015", 2 * STEPS), ("lr-0.003", 2 * STEPS)]
    assert _without_reuse_counts(again) == _without_reuse_counts(first)
    # the wall times are the ones the first comparison measured, found again by run id
    assert _without_reuse_counts(json.loads((tmp_path / "compare" / "compare.json").read_text())) == \
        _without_reuse_counts(json.loads(written))
    assert {r["wall_s"] for r in again["run_index"]} == {r["wall_s"] for r in first["run_index"]} and \
        all(r["wall_s"] > 0 for r in first["run_index"])


def _without_walls(value):
    if isinstance(value, dict):
        return {k: _without_walls(v) for k, v in value.items() if k != "wall_s"}
    return [_without_walls(v) for v in value] if isinstance(value, list) else value


def test_runs_kept_in_the_benchs_archive_are_reused_by_a_comparison_on_another_machine(tmp_path, trained) -> None:
    """A machine that starts empty each session: the bench keeps each finished run's record
    (bench/curriculum_archive.py), and a comparison into a fresh --out, on data generated again
    elsewhere, restored from it trains nothing and gives the same result, wall times included."""
    from bench.curriculum_archive import keep_all, restore

    first = cc.compare(_request(tmp_path / "one", lr_factors=(0.5, 1.0)))
    archive = tmp_path / "archive"
    assert keep_all(tmp_path / "one" / "compare", archive) == 2
    assert keep_all(tmp_path / "one" / "compare", archive) == 0  # kept once
    trained.clear()
    assert restore(archive, tmp_path / "two" / "compare") == 2
    again = cc.compare(_request(tmp_path / "two", lr_factors=(0.5, 1.0)))
    assert trained == [] and again["runs_reused"] == 2
    # the wall times come back from the file times, to the microsecond
    assert [r["wall_s"] for r in again["run_index"]] == pytest.approx([r["wall_s"] for r in first["run_index"]],
                                                                       abs=1e-5)
    assert _without_walls(_without_reuse_counts(again)) == _without_walls(_without_reuse_counts(first))
    # another seed is a run the archive does not hold: trained, and only it
    more = cc.compare(_request(tmp_path / "two", lr_factors=(0.5, 1.0), seeds=2))
    assert len(trained) == 1 and trained[0].name == "seed-1" and more["runs_reused"] == 2


def test_a_changed_input_trains_only_the_runs_it_changes(tmp_path, trained) -> None:
    out = tmp_path / "compare"
    cc.compare(_request(tmp_path))
    seed0 = out / "runs" / "one-pot" / "lr-0.003" / "seed-0"
    run_id = json.loads((seed0 / "run.json").read_text())["run_id"]
    trained.clear()
    more = cc.compare(_request(tmp_path, seeds=2))  # seed 1 is new; seed 0 is as it was
    assert trained == [seed0.parent / "seed-1"] and more["runs_reused"] == 1 and more["runs_done"] == 2
    trained.clear()
    rescaled = cc.compare(_request(tmp_path, seeds=2, scale=0.5))  # every run's budget changed: none reused
    assert sorted(trained) == [seed0, seed0.parent / "seed-1"] and rescaled["runs_reused"] == 0
    assert rescaled["variants"]["one-pot"]["tokens"] == STEPS * 4 * 32  # half of the 2 x STEPS steps
    # the stale run is not deleted: it moved aside, whole
    aside = [p for p in seed0.glob("previous-*")]
    assert len(aside) == 1 and json.loads((aside[0] / "run.json").read_text())["run_id"] == run_id
    assert (aside[0] / "summary.json").is_file() and (aside[0] / "metrics.jsonl").is_file()


def test_an_unfinished_run_is_trained_again_and_its_old_contents_moved_aside(tmp_path, trained) -> None:
    out = tmp_path / "compare"
    first = cc.compare(_request(tmp_path))
    run_dir = out / "runs" / "one-pot" / "lr-0.003" / "seed-0"
    # as a comparison killed before the run finished leaves it: no summary, no checkpoint to go on from
    (run_dir / "summary.json").unlink()
    for checkpoint in (run_dir / "checkpoints").glob("step-*"):
        checkpoint.rename(tmp_path / checkpoint.name)
    metrics = (run_dir / "metrics.jsonl").read_text()
    trained.clear()
    again = cc.compare(_request(tmp_path))
    assert trained == [run_dir] and again["runs_reused"] == 0 and again["runs_resumed"] == 0
    aside = list(run_dir.glob("previous-*"))
    assert len(aside) == 1 and (aside[0] / "metrics.jsonl").read_text() == metrics
    assert json.loads((run_dir / "summary.json").read_text())["finished"]
    # the same data, seed and schedule: the run trained again scores as the first did
    assert again["variants"]["one-pot"]["eval"]["mean"]["mean"] == \
        pytest.approx(first["variants"]["one-pot"]["eval"]["mean"]["mean"], rel=1e-4)


def test_a_run_stopped_after_a_checkpoint_is_resumed_from_it(tmp_path, trained) -> None:
    out = tmp_path / "compare"
    cc.compare(_request(tmp_path))
    run_dir = out / "runs" / "one-pot" / "lr-0.003" / "seed-0"
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "finished": False}))
    trained.clear()
    again = cc.compare(_request(tmp_path))
    assert trained == [run_dir] and again["runs_resumed"] == 1 and again["runs_reused"] == 0
    # the same run went on (run.json kept), nothing moved aside
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == run_id
    assert not list(run_dir.glob("previous-*"))
    assert json.loads((run_dir / "summary.json").read_text())["finished"]


def _seed0_runs(losses: dict[float, float]) -> list[cc.RunResult]:
    return [cc.RunResult("v", 0, [{"name": "s", "eval": {"s": loss}}], 1, 1.0, [], lr) for lr, loss in losses.items()]


@pytest.mark.parametrize("losses, edge", [({1e-3: 2.0, 2e-3: 1.0, 4e-3: 1.5}, None),
                                          ({1e-3: 1.0, 2e-3: 1.5, 4e-3: 2.0}, "lowest"),
                                          ({1e-3: 2.0, 2e-3: 1.5, 4e-3: 1.0}, "highest")])
def test_a_chosen_rate_at_the_grids_edge_is_flagged(losses, edge) -> None:
    chosen = cc.chosen_lrs(_seed0_runs(losses), ["s"])["v"]
    assert chosen == min(losses, key=losses.get)
    assert cc.grid_edge(chosen, sorted(losses)) == edge
    assert cc.grid_edge(chosen, [chosen]) is None  # a grid of one rate has no edge to widen


def test_the_edge_reaches_the_json_the_tuning_table_and_the_console(tmp_path, capsys) -> None:
    from advisor.cli.curriculum import _render

    req = _request(tmp_path, variants=("one-pot", "staged"), lr_factors=(0.5, 1.0))
    plans = cc.plan_variants(req)
    # one-pot best at the grid's highest rate, staged at the lowest: both at the edge
    runs = [cc.RunResult(name, 0, [{"name": s, "eval": {"language": loss, "math": loss}} for s in ("language", "math")],
                         1, 1.0, [], lr)
            for name, losses in (("one-pot", {1.5e-3: 2.0, 3e-3: 1.0}), ("staged", {1.5e-3: 1.0, 3e-3: 2.0}))
            for lr, loss in losses.items()]
    result = {**cc.summarise(req, plans, runs), "complete": True, "runs_reused": 0, "runs_resumed": 0}
    assert {n: (e["lr"]["chosen"], e["lr"]["edge"]) for n, e in result["variants"].items()} == \
        {"one-pot": (3e-3, "highest"), "staged": (1.5e-3, "lowest")}
    assert all(e["lr"]["note"] == cc.EDGE_NOTE for e in result["variants"].values())
    assert "one-pot (chosen 0.003, the grid's highest)" in result["lr_edge"]
    assert "staged (chosen 0.0015, the grid's lowest)" in result["lr_edge"]
    table = cc.tuning_markdown(result)
    assert "| one-pot | 2.000 | 1.000 | 0.003 (edge) |" in table and cc.EDGE_NOTE in table
    _render(result)
    assert cc.EDGE_NOTE in " ".join(capsys.readouterr().out.split())
    # a grid of three with one-pot's best in the middle: not flagged, no sentence
    req3 = _request(tmp_path, variants=("one-pot",), lr_factors=(0.5, 1.0, 2.0))
    mid = [cc.RunResult("one-pot", 0, [{"name": s, "eval": {"language": loss, "math": loss}}
                                       for s in ("language", "math")], 1, 1.0, [], lr)
           for lr, loss in {1.5e-3: 2.0, 3e-3: 1.0, 6e-3: 1.5}.items()]
    quiet = cc.summarise(req3, cc.plan_variants(req3), mid)
    assert quiet["variants"]["one-pot"]["lr"]["edge"] is None and quiet["lr_edge"] is None
    assert cc.EDGE_NOTE not in cc.tuning_markdown(quiet)


def test_the_evaluations_size_is_in_the_fingerprint_but_a_resume_may_change_it(tmp_path) -> None:
    from reports.curriculum_variants import variant_tasks
    from trainer.file_digests import FileDigests
    from trainer.run_identity import fingerprint, mismatch

    plan = cc.plan_variant(variant_tasks(_request(tmp_path).task, ("one-pot",))["one-pot"],
                           ModelSpec(name="tiny", hf_config=CONFIG), load_hardware("cpu"))
    scored_on_2, scored_on_8 = (fingerprint(plan, plan.chosen.layout, cc.run_options(0, n), None, None, FileDigests())
                                for n in (2, 8))
    assert scored_on_2 != scored_on_8 and scored_on_2["scoring"]["eval_sequences"] == 2
    assert mismatch(scored_on_2, scored_on_8) is None  # a resume may score on more sequences
