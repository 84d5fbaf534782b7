"""Print the lowest versions `pyproject.toml` declares, one `name==floor` a line, for CI's
lowest-versions leg: the project's dependencies and the extras named on the command line.

`python .ci/floors.py test` prints the floors of the dependencies and of the `test` extra,
`python .ci/floors.py --only distributed` those of one extra alone;
`python .ci/floors.py --check test distributed` (run by the leg's own interpreter) fails unless exactly those
versions are installed. A dependency declared without a lower bound (`>=`) is an error: its floor
would be untested."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

FLOOR = re.compile(r"^\s*([A-Za-z0-9_.\-\[\]]+)\s*(?:[^;]*?)>=\s*([0-9][^,;\s]*)")


def floors(extras: list[str], only_extras: bool = False) -> list[str]:
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    specs = [] if only_extras else list(project["dependencies"])
    for extra in extras:
        specs += project["optional-dependencies"][extra]
    pins = []
    for spec in specs:
        match = FLOOR.match(spec)
        if match is None:
            raise SystemExit(f"floors: '{spec}' declares no lower bound (>=)")
        pins.append(f"{match.group(1)}=={match.group(2)}")
    return pins


def check(pins: list[str]) -> None:
    from importlib.metadata import version

    from packaging.version import Version

    wrong = []
    for pin in pins:
        name, floor = pin.split("==")
        installed = version(name.split("[")[0])
        if Version(installed) != Version(floor):
            wrong.append(f"{name} {installed} (floor {floor})")
    if wrong:
        raise SystemExit("floors: not the declared floors: " + ", ".join(wrong))
    print("floors installed: " + " ".join(pins))


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] == ["--check"]:
        check(floors(arguments[1:]))
    elif arguments[:1] == ["--only"]:  # just these extras' floors
        print("\n".join(floors(arguments[1:], only_extras=True)))
    else:
        print("\n".join(floors(arguments)))
