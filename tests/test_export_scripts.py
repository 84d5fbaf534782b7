"""Launcher scripts from `advisor plan --export` keep user strings inert: a model folder named like a
command (`;`, `$()`, quotes, a newline) ends up neither run nor able to break the script."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from advisor.cli import app
from advisor.plan_file import load_plan
from presets import load_model

NAMES = ["m; touch PWNED", "m $(touch PWNED) `touch PWNED`", "m' \"; touch PWNED; echo '", "m\ntouch PWNED\n#"]


def fake_tools(folder: Path) -> dict[str, str]:
    """`scontrol`, `srun` and `torchrun` stand-ins: srun runs its command, torchrun records its words."""
    folder.mkdir()
    (folder / "scontrol").write_text("#!/bin/bash\necho node0\n")
    (folder / "srun").write_text('#!/bin/bash\nexec "$@"\n')
    (folder / "torchrun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGS_FILE"\n')
    for tool in folder.iterdir():
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node0"}


@pytest.mark.parametrize("name", NAMES)
def test_a_model_folder_named_like_a_command_runs_nothing(tmp_path: Path, name: str) -> None:
    model = tmp_path / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps(load_model("demo-tiny").hf_config))
    export = tmp_path / "launch"
    result = CliRunner().invoke(app, ["plan", "--model", str(model), "--hardware", "a100-80g", "--gpus-per-node", "2",
                                      "--seq-len", "128", "--global-batch", "8", "--export", str(export)])
    assert result.exit_code == 0, result.output
    assert load_plan(export / "plan.yaml").model.name == name
    env = fake_tools(tmp_path / "bin")
    for script in ("torchrun.sh", "slurm.sbatch"):
        text = (export / script).read_text()
        assert subprocess.run(["bash", "-n", str(export / script)]).returncode == 0
        job = [line for line in text.splitlines() if line.startswith("#SBATCH --job-name=")]
        assert all(re.fullmatch(r"#SBATCH --job-name=advisor-[A-Za-z0-9._+-]+", line) for line in job)
        args_file = tmp_path / f"{script}.args"
        done = subprocess.run(["bash", str(export / script)], cwd=tmp_path, env={**env, "ARGS_FILE": str(args_file)},
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert not list(tmp_path.rglob("PWNED"))
        words = args_file.read_text().splitlines()
        assert words[-3:] == ["train", "plan.yaml", "--launched"]
        assert "--rdzv-endpoint=127.0.0.1:29511" in words or "--rdzv-endpoint=node0:29511" in words
