"""Nothing in an --out is lost: what a new run would write over is moved aside under a dated name,
or the run refuses; and no stage name takes a run's writes outside its directory.

One in-process training of the tiny Llama (two stages of 2 steps); the rest calls the run-dir
claim directly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specs.errors import UsageError
from specs.plan_file import load_plan
from test_trainer import make_plan_file
from trainer.loop import TrainOptions, train
from trainer.run_identity import IN_THE_WAY, claim, move_in_the_way_aside

DATED = re.compile(r"^(?P<name>.+)\.old-\d{8}T\d{12}Z$")  # <name>.old-<UTC time to microseconds>Z
FINGERPRINT = {"task": "t", "seed": 0, "model": "m", "seq_len": 8, "global_batch": 1, "engine": "auto", "data": "d"}


def users_folder(root: Path, name: str) -> Path:
    """A folder of the user's where a run's product goes, with a file that must survive."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text(f"my {name}\n")
    return folder


def aside(root: Path, name: str) -> list[Path]:
    return [p for p in root.iterdir() if (m := DATED.match(p.name)) and m["name"] == name]


def test_training_into_an_out_whose_model_folder_holds_no_run_moves_it_aside(tmp_path) -> None:
    """The reported loss: `model/` in an --out without a run was replaced by the run's artifact and the
    old one deleted. It is now renamed `model.old-<time>` with everything in it, and the run's own
    model/ takes its place."""
    plan = load_plan(make_plan_file(tmp_path, steps=2))
    run = tmp_path / "run"
    users_folder(run, "model")
    users_folder(run, "stages")
    train(plan, run, resume=False, options=TrainOptions(show_progress=False, eval_sequences=1, exact_match_prompts=0))
    for name in ("model", "stages"):
        [old] = aside(run, name)
        assert (old / "notes.txt").read_text() == f"my {name}\n"
        assert not (run / name / "notes.txt").exists()
    assert (run / "model" / "config.json").is_file()  # the run's own artifact
    assert all((run / "stages" / s.name / "model" / "config.json").is_file() for s in plan.task.stages)


@pytest.mark.parametrize("resume", [False, True])
def test_a_fresh_claim_moves_whatever_training_would_write_over_aside(tmp_path, resume: bool) -> None:
    """Without a run in the directory, `--resume` is a fresh start too."""
    run = tmp_path / "run"
    for name in IN_THE_WAY:
        if "." in name:
            run.mkdir(exist_ok=True)
            (run / name).write_text("mine\n")
        else:
            users_folder(run, name)
    (run / "plan.yaml").write_text("kept in place\n")
    moved = claim(run, FINGERPRINT, resume=resume, overwrite=False)
    assert moved is not None and DATED.match(moved.name)
    for name in IN_THE_WAY:
        [old] = aside(run, name)
        assert not (run / name).exists()
        assert ((old / "notes.txt") if old.is_dir() else old).read_text() in (f"my {name}\n", "mine\n")
    assert (run / "plan.yaml").read_text() == "kept in place\n" and (run / "run.json").is_file()


def test_a_run_is_still_refused_without_overwrite_and_nothing_moves(tmp_path) -> None:
    run = tmp_path / "run"
    users_folder(run, "checkpoints/step-00000002")
    users_folder(run, "model")
    with pytest.raises(UsageError, match="already holds a training run"):
        claim(run, FINGERPRINT, resume=False, overwrite=False)
    assert move_in_the_way_aside(run) == []  # a run is moved as a whole (--overwrite), never piecemeal
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "model"]


def test_a_run_dirs_own_model_is_not_moved_when_it_resumes(tmp_path) -> None:
    run = tmp_path / "run"
    claim(run, FINGERPRINT, resume=False, overwrite=False)
    users_folder(run, "model")
    assert claim(run, FINGERPRINT, resume=True, overwrite=False) is None
    assert (run / "model" / "notes.txt").is_file() and not aside(run, "model")


def test_a_symlinked_model_is_moved_not_followed(tmp_path) -> None:
    """A link to the user's model elsewhere is renamed; its target is left alone."""
    elsewhere = users_folder(tmp_path, "elsewhere")
    run = tmp_path / "run"
    run.mkdir()
    (run / "model").symlink_to(elsewhere, target_is_directory=True)
    claim(run, FINGERPRINT, resume=False, overwrite=False)
    [old] = aside(run, "model")
    assert old.is_symlink() and (elsewhere / "notes.txt").read_text() == "my elsewhere\n"


def test_advisor_run_keeps_a_stopped_runs_verification_and_moves_a_whole_run_with_its_trials(tmp_path) -> None:
    """A run that `advisor run` stopped after verification leaves verify/ and verify.json without a run:
    the next one moves them aside (its trials would delete verify/<trial>/); a finished run moves into
    previous-<time>/ with its verify/."""
    from advisor.cli.run_chain import _make_room

    said: list[str] = []
    stopped = tmp_path / "stopped"
    users_folder(stopped, "verify/0")
    (stopped / "verify.json").write_text("{}\n")
    _make_room(stopped, said.append, 3)
    [trials] = aside(stopped, "verify")
    [record] = aside(stopped, "verify.json")
    assert (trials / "0" / "notes.txt").read_text() == "my verify/0\n" and record.read_text() == "{}\n"
    assert len(said) == 2 and all("holds no run" in line for line in said)

    finished = tmp_path / "finished"
    users_folder(finished, "verify/0")
    (finished / "metrics.jsonl").write_text('{"step": 1}\n')
    _make_room(finished, said.append, 3)
    [previous] = finished.glob("previous-*")
    assert (previous / "verify" / "0" / "notes.txt").is_file() and (previous / "metrics.jsonl").is_file()
    assert not (finished / "verify").exists()


def test_advisor_run_keeps_the_newest_runs_and_moves_older_ones_into_its_trash(tmp_path) -> None:
    """Issue 31: old runs piled up without bound. Six runs one after another with --keep-runs 2: the
    run dir keeps the two newest previous runs, the older four are in trash/ (named on the console each
    time), and every file of every run is still somewhere."""
    from advisor.cli.run_chain import _make_room

    said: list[str] = []
    out = tmp_path / "runs"
    for run in range(6):
        out.mkdir(exist_ok=True)
        (out / "metrics.jsonl").write_text(f'{{"run": {run}}}\n')
        _make_room(out, said.append, 2)
    kept = sorted(p.name for p in out.glob("previous-*"))
    trashed = sorted(p.name for p in (out / "trash").glob("previous-*"))
    assert len(kept) == 2 and len(trashed) == 4 and max(trashed) < min(kept)  # the older ones went
    runs = sorted(int((p / "metrics.jsonl").read_text().split(":")[1].strip(" }\n"))
                  for p in [*out.glob("previous-*"), *(out / "trash").glob("previous-*")])
    assert runs == [0, 1, 2, 3, 4, 5]
    assert sum("into " + str(out / "trash") in line and "--keep-runs 2" in line for line in said) == 4
