"""Every `advisor` command in the README's code blocks runs as written (with small budgets where the
real one takes minutes), so the README cannot drift from the CLI."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
# Verbs whose full run takes minutes: the same command with a smaller budget appended.
SMALL_BUDGETS = {
    "run": ["--max-steps-per-stage", "2", "--verify", "1", "--verify-steps", "3"],
    "train": ["--max-steps-per-stage", "2"],
}


def readme_commands() -> list[list[str]]:
    """The `advisor ...` commands of the README's code blocks: continuation lines joined, comments
    dropped, `a && b` split."""
    blocks = re.findall(r"```(?:bash|sh|console)?\n(.*?)```", README.read_text(), flags=re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["advisor"]:
                    commands.append(words[1:])
    return commands


def test_the_readme_has_commands_to_check() -> None:
    verbs = {c[0] for c in readme_commands()}
    assert {"run", "estimate", "plan", "profile"} <= verbs


@pytest.mark.slow
@pytest.mark.parametrize("args", readme_commands(), ids=lambda a: " ".join(a)[:60])
def test_readme_command_runs(args: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    # one working folder for the whole README, so a file one command writes (p.json) feeds the next
    cwd = tmp_path_factory.getbasetemp() / "readme"
    cwd.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "advisor.cli", *args, *SMALL_BUDGETS.get(args[0], [])]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"advisor {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    if "--help" in args:
        assert "Usage" in done.stdout
