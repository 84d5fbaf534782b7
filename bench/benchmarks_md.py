"""Write one bench's table into docs/benchmarks.md, replacing that bench's previous section."""

from __future__ import annotations

import datetime as dt
import platform
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach section is written by the bench script named in it; rerun the command to refresh it.\n"


def write_section(name: str, title: str, command: str, body: str) -> None:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (f"{start}\n## {title}\n\nCommand: `{command}` ({stamp}, {platform.machine()}, "
               f"{platform.python_version()})\n\n{body.rstrip()}\n{end}")
    text = DOC.read_text() if DOC.exists() else HEADER
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
