"""Install size and time: the README's install in a fresh venv, measured.

Creates a venv in a temporary folder, runs `pip install torch==2.13.0` and then
`pip install -e <repo>[distributed]` (both `--no-cache-dir`, so that every wheel is fetched and
unpacked as on a fresh machine), times each, and measures the venv's size on disk and the ten
largest installed distributions (the files of each one's RECORD). Prints the table and writes it
to docs/benchmarks.md.

    python bench/install_size.py [--extras distributed] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.benchmarks_md import write_section  # noqa: E402

TORCH = "torch==2.13.0"
MB = 1e6
# run by the venv's own interpreter: bytes on disk of each installed distribution's files
SIZES_SCRIPT = """
import json, os
from importlib.metadata import distributions
sizes = {}
for dist in distributions():
    total = 0
    for f in dist.files or []:
        path = dist.locate_file(f)
        if os.path.isfile(path) and not os.path.islink(path):
            total += os.stat(path).st_blocks * 512
    sizes[dist.metadata["Name"]] = total
print(json.dumps(sizes))
"""


def disk_bytes(folder: Path) -> int:
    """Blocks allocated (what `du` says), each inode counted once."""
    seen: set[int] = set()
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total


def timed_pip(python: Path, args: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run([str(python), "-m", "pip", "install", "--no-cache-dir", "-q", *args], check=True,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return time.perf_counter() - started


def measure(extras: str) -> dict:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="advisor-install-") as tmp:
        venv = Path(tmp) / "venv"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        venv_s = time.perf_counter() - started
        python = venv / "bin" / "python"
        base_bytes = disk_bytes(venv)
        torch_s = timed_pip(python, [TORCH])
        torch_bytes = disk_bytes(venv)
        project_s = timed_pip(python, ["-e", f"{ROOT}[{extras}]" if extras else str(ROOT)])
        total_bytes = disk_bytes(venv)
        sizes = json.loads(subprocess.run([str(python), "-c", SIZES_SCRIPT], check=True, capture_output=True,
                                          text=True).stdout)
    return {"load": (load_before, os.getloadavg()[0]), "venv_s": venv_s, "torch_s": torch_s, "project_s": project_s, "base_bytes": base_bytes,
            "torch_bytes": torch_bytes, "total_bytes": total_bytes, "distributions": len(sizes),
            "largest": sorted(sizes.items(), key=lambda kv: -kv[1])[:10]}


def table(result: dict, extras: str) -> str:
    project = f"pip install -e .[{extras}]" if extras else "pip install -e ."
    rows = [
        "| step | seconds | venv size after (MB) |",
        "|---|---:|---:|",
        f"| python -m venv | {result['venv_s']:.1f} | {result['base_bytes'] / MB:,.0f} |",
        f"| pip install {TORCH} | {result['torch_s']:.1f} | {result['torch_bytes'] / MB:,.0f} |",
        f"| {project} | {result['project_s']:.1f} | {result['total_bytes'] / MB:,.0f} |",
        f"| **total** | **{result['venv_s'] + result['torch_s'] + result['project_s']:.1f}** | "
        f"**{result['total_bytes'] / MB:,.0f}** |",
        "",
        f"The ten largest of the {result['distributions']} installed distributions (their files on disk):",
        "",
        "| distribution | MB | share of the venv |",
        "|---|---:|---:|",
    ]
    rows += [f"| {name} | {size / MB:,.1f} | {size / result['total_bytes']:.0%} |" for name, size in result["largest"]]
    rows += ["", f"1-minute load average at the start and the end: {result['load'][0]:.2f}, {result['load'][1]:.2f} "
                 f"({os.cpu_count()} cores, shared)."]
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extras", default="distributed", help="extras of the project install (default: distributed)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    result = measure(args.extras)
    body = table(result, args.extras)
    print(body)
    if not args.no_write:
        command = "python bench/install_size.py" + (f" --extras {args.extras}" if args.extras != "distributed" else "")
        write_section("install_size", "Install size and time (fresh venv, no pip cache)", command,
                      "pip's cache is off (`--no-cache-dir`): every wheel is fetched from the configured "
                      "indexes and unpacked, as on a fresh machine.\n\n" + body)


if __name__ == "__main__":
    main()
