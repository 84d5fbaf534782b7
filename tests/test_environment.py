"""Every environment variable that steers the advisor is declared once (specs/environment.py, issue
30) and read through it; a value that does not parse is one line and exit 2 (issue 31)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specs import environment
from specs.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["advisor", "presets", "profiler", "planner", "trainer", "reports"]


def test_every_advisor_variable_in_the_code_is_declared_and_read_through_the_declaration() -> None:
    named, raw_reads = set(), []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            named |= set(re.findall(r"\bADVISOR_[A-Z_]+\b", text))
            if path.name != "environment.py" and re.search(r"(environ\.get|environ\[|getenv)\(?\s*[\"']ADVISOR_", text):
                raw_reads.append(str(path.relative_to(ROOT)))
    assert named and named <= set(environment.VARIABLES), named - set(environment.VARIABLES)
    assert not raw_reads, raw_reads
    assert all(v.meaning and v.audience in ("user", "test hook", "internal") for v in environment.VARIABLES.values())


def test_an_undeclared_name_cannot_be_read_and_a_bad_number_is_one_line(monkeypatch) -> None:
    with pytest.raises(KeyError):
        environment.read("ADVISOR_SOMETHING_NEW")
    monkeypatch.setenv("ADVISOR_CHECKPOINT_DELAY_S", "0.25")
    assert environment.read_seconds("ADVISOR_CHECKPOINT_DELAY_S") == 0.25
    for bad in ("x", "inf", "-1", "nan"):
        monkeypatch.setenv("ADVISOR_CHECKPOINT_DELAY_S", bad)
        with pytest.raises(UsageError, match="ADVISOR_CHECKPOINT_DELAY_S"):
            environment.read_seconds("ADVISOR_CHECKPOINT_DELAY_S")
    monkeypatch.delenv("ADVISOR_CHECKPOINT_DELAY_S")
    assert environment.read_seconds("ADVISOR_CHECKPOINT_DELAY_S") == 0.0
