"""Every `advisor` command in the README's code blocks runs as written (with small budgets where the
real one takes minutes), so the README cannot drift from the CLI. A block's `python - <<'EOF'`
script (one that writes the small files later commands read) runs first, in the same folder."""

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

SCRIPT = re.compile(r"^python - <<'EOF'\n(.*?)^EOF\n", flags=re.S | re.M)  # a Python script given on stdin


def readme_blocks() -> list[str]:
    """The shell code blocks: fences paired from the top (a block in another language is skipped whole)."""
    fenced = re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    return [body for language, body in fenced if language in ("", "bash", "sh", "console")]


def readme_scripts() -> list[str]:
    """The Python scripts the README's code blocks run as `python - <<'EOF' ... EOF`."""
    return [script for block in readme_blocks() for script in SCRIPT.findall(block)]


def readme_commands() -> list[list[str]]:
    """The `advisor ...` commands of the README's code blocks: continuation lines joined, comments
    dropped, `a && b` split (a script's lines are not commands)."""
    commands = []
    for block in readme_blocks():
        for line in SCRIPT.sub("", block).replace("\\\n", " ").splitlines():
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
    if not cwd.exists():  # the scripts write files: once, before the first command
        cwd.mkdir()
        for script in readme_scripts():
            done = subprocess.run([sys.executable, "-"], input=script, cwd=cwd, capture_output=True, text=True,
                                  timeout=600)
            assert done.returncode == 0, f"a README script failed:\n{done.stderr[-3000:]}"
    command = [sys.executable, "-m", "advisor.cli", *args, *SMALL_BUDGETS.get(args[0], [])]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"advisor {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    if "--help" in args:
        assert "Usage" in done.stdout
