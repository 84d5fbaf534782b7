"""Dependencies the main job never imports are an extra, and a command that needs a missing extra
says how to install it in one line.

Truths: pyproject.toml as pip reads it; an interpreter in which the extra's modules cannot be
imported (`sys.modules[name] = None` is how Python marks a module absent).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from advisor.cli.data import DATA_EXTRA

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_data_extra_is_what_the_cli_checks_and_not_a_main_dependency() -> None:
    extra = _names(PYPROJECT["optional-dependencies"]["data"])
    assert extra == set(DATA_EXTRA)
    assert not extra & _names(PYPROJECT["dependencies"])


def test_a_command_that_needs_a_missing_extra_names_the_install(tmp_path: Path) -> None:
    blocked = "import sys; sys.modules['datasets'] = None; from advisor.cli import app; app()"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ADVISOR_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", blocked, "data", "prepare", "--task", "demo"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and 'pip install -e ".[data]"' in lines[0] and "datasets" in lines[0], lines
    assert not (tmp_path / "cache").exists()  # stopped before any work
