"""`advisor report capacity --jobs 1` against `--jobs 2` on the README's capacity grid (issue 30: the
planner loads no torch, so the report plans its options in forked processes again).

    python -m bench.capacity_jobs [--runs 3] [--no-write]

Each run is the whole command, as a user runs it, in a fresh process; the two settings alternate so
that a drift of the machine's speed falls on both. Medians of `--runs` runs, every run listed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRID = ["--model", "llama3-8b", "--tokens", "2e10", "--hardware", "h100-80g,a100-80g", "--gpus", "8,64"]


def run_once(jobs: int, out: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "advisor.cli", "report", "capacity", *GRID, "--out", str(out),
                    "--jobs", str(jobs)], check=True, capture_output=True)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    seconds: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for jobs in (1, 2) if run % 2 == 0 else (2, 1):
                seconds[jobs].append(run_once(jobs, Path(tmp, f"jobs{jobs}-{run}")))
    one, two = statistics.median(seconds[1]), statistics.median(seconds[2])
    body = "\n".join([
        "| `--jobs` | median s | runs (s) |", "|---|---|---|",
        *(f"| {jobs} | {statistics.median(s):.1f} | {', '.join(f'{x:.1f}' for x in s)} |" for jobs, s in seconds.items()),
        "", f"`--jobs 2` takes {two / one:.2f}x the time of `--jobs 1` on this 2-core machine; "
        "the grid: " + " ".join(GRID) + " (8 options)."])
    print(body)
    if not args.no_write:
        from bench.benchmarks_md import write_section

        write_section("capacity_jobs", "Capacity report: planning in parallel processes",
                      "python -m bench.capacity_jobs", body)
    return body


if __name__ == "__main__":
    main()
