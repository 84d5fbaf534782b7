"""`advisor data prepare --executor slurm --dry-run` writes a job array that sbatch would accept
(its directives checked one by one) and a finishing job; the array's tasks, run as Slurm would run
them (datatrove's pickled executor, one SLURM_ARRAY_TASK_ID each), then the finishing command,
write what a local prepare writes."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import dill
import pytest
from typer.testing import CliRunner

from advisor.cli import app
from presets import load_task
from test_data_resume import comparable_manifest, output_files, write_corpus
from trainer.data.prepare import prepare

# sbatch's long options that the scripts may use (sbatch(1)); anything else would be refused
SBATCH_OPTIONS = {"array", "cpus-per-task", "mem-per-cpu", "nodes", "partition", "job-name", "time", "output",
                  "error", "requeue", "qos", "mail-type", "mail-user", "gpus", "dependency"}
SLURM_TIME = re.compile(r"(\d+-)?\d{1,3}(:\d{2}){0,2}")


def directives(script: str) -> dict[str, str]:
    """The #SBATCH options of a script, checked as sbatch reads them: after the shebang and before
    the first command (sbatch stops at the first line that is not a comment)."""
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    found = {}
    for line in lines[1:]:
        if not line.startswith("#"):
            break
        match = re.fullmatch(r"#SBATCH --([a-z-]+)(?:=(\S+))?", line)
        assert match, line
        found[match[1]] = match[2] or ""
    assert not any(line.startswith("#SBATCH") for line in lines[1 + len(found):]), "a directive after a command"
    assert set(found) <= SBATCH_OPTIONS, set(found) - SBATCH_OPTIONS
    return found


def test_slurm_dry_run_writes_an_array_whose_tasks_and_finish_match_a_local_prepare(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = write_corpus(tmp_path)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["data", "prepare", "--task", str(task), "--out", str(out), "--executor", "slurm",
                                      "--dry-run", "--partition", "cpu", "--time", "01:30:00", "--workers", "8",
                                      "--rows-per-part", "240"])
    assert result.exit_code == 0, result.output
    assert not out.exists()
    (work,) = tmp_path.glob(".out.scan-*")
    array = directives((work / "datatrove" / "launch_script.slurm").read_text())
    assert array["array"] == "0-1%8"  # 2 parts (one per file), at most 8 at once
    assert array["partition"] == "cpu" and array["time"] == "01:30:00" and SLURM_TIME.fullmatch(array["time"])
    assert array["cpus-per-task"] == "1" and array["nodes"] == "1" and re.fullmatch(r"\d+G", array["mem-per-cpu"])
    assert array["output"] == array["error"] == f"{work}/slurm_logs/%A_%a.out" and (work / "slurm_logs").is_dir()
    assert "requeue" in array
    finish_script = (work / "finish.slurm").read_text()
    finish = directives(finish_script)
    assert finish["partition"] == "cpu" and finish["time"] == "01:30:00" and "array" not in finish
    submit = (work / "submit.sh").read_text()
    assert "RUN_OFFSET=0" in submit and "--dependency=$after" in submit

    # the array's two tasks, as Slurm runs them: the pickled executor, with the task's array index
    from datatrove.executor import slurm
    monkeypatch.setattr(slurm, "expand_slurm_nodelist", lambda nodes: ["localhost"])
    monkeypatch.setenv("SLURM_NODELIST", "localhost")
    for index in ("0", "1"):
        monkeypatch.setenv("SLURM_ARRAY_TASK_ID", index)
        with open(work / "datatrove" / "executor.pik", "rb") as f:
            dill.load(f).run()
    command = shlex.split(finish_script.strip().splitlines()[-1])
    finished = CliRunner().invoke(app, command[command.index("advisor.cli") + 1:])
    assert finished.exit_code == 0, finished.output
    assert "resuming: 2 of 2 parts were scanned before" in finished.output

    local, _ = prepare(load_task(str(task)), tmp_path / "local", rows_per_part=240)
    assert output_files(out) == output_files(local)
    assert comparable_manifest(out) == comparable_manifest(local)


FAKE_SBATCH = """#!/bin/bash
# records its arguments, one call a line; prints a job id as `sbatch --parsable` does (id;cluster)
if [ -n "$FAKE_SBATCH_REFUSE" ]; then echo "sbatch: error: $FAKE_SBATCH_REFUSE" >&2; exit 1; fi
echo "$*" >> "$FAKE_SBATCH_LOG"
echo "$((4240 + $(wc -l < "$FAKE_SBATCH_LOG")));cluster-a"
"""


def test_slurm_without_dry_run_submits_the_array_then_the_finish_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = write_corpus(tmp_path)
    bin_dir, log = tmp_path / "bin", tmp_path / "sbatch.log"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH)
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SBATCH_LOG", str(log))
    command = ["data", "prepare", "--task", str(task), "--out", str(tmp_path / "out"), "--executor", "slurm",
               "--partition", "cpu", "--rows-per-part", "240"]

    monkeypatch.setenv("FAKE_SBATCH_REFUSE", "invalid partition specified: cpu")
    refused = CliRunner().invoke(app, command)
    assert refused.exit_code == 2, refused.output
    lines = refused.output.strip().splitlines()
    assert len(lines) == 1 and "sbatch refused the prepare's job: sbatch: error: invalid partition" in lines[0]
    assert not log.exists()

    monkeypatch.delenv("FAKE_SBATCH_REFUSE")
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    (work,) = tmp_path.glob(".out.scan-*")
    calls = log.read_text().splitlines()
    assert calls == [f"--parsable --export=ALL,RUN_OFFSET=0 {work}/datatrove/launch_script.slurm",
                     f"--parsable --dependency=afterok:4241 {work}/finish.slurm"]
    assert "submitted the scan as job 4241, then the finishing job 4242" in " ".join(result.output.split())


def test_slurm_without_sbatch_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = write_corpus(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    result = CliRunner().invoke(app, ["data", "prepare", "--task", str(task), "--out", str(tmp_path / "o"),
                                      "--executor", "slurm", "--partition", "cpu"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "sbatch is not on PATH" in lines[0] and "--dry-run writes" in lines[0], result.output
    assert not list(tmp_path.glob(".o.*")), "nothing written"


@pytest.mark.parametrize("flags, message", [
    (["--executor", "slurm", "--dry-run"], "needs --partition"),
    (["--dry-run"], "goes with --executor slurm"),
    (["--executor", "slurm", "--dry-run", "--partition", "cpu", "--time", "soon"], "--time 'soon'"),
])
def test_slurm_flags_are_checked_in_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    task = write_corpus(tmp_path)
    result = CliRunner().invoke(app, ["data", "prepare", "--task", str(task), "--out", str(tmp_path / "o"), *flags])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
