"""The fuzz campaign of issue 31: every fuzz test of tests/test_fuzz_inputs.py (files, layout strings,
numbers) and tests/test_fuzz_verbs.py (every verb's options under drawn environment variables), run
by pytest with Hypothesis's statistics, counted per test.

    python -m bench.fuzz_campaign [--runs 3] [--no-write]

A case passes when it exits 0 or 2 (or is accepted and reaches the work), prints no traceback and
no "internal error", and finishes within 10 s (each test's Hypothesis deadline). The counts are
Hypothesis's own: examples run in the generate phase, and those it had to discard as invalid.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

FILES = ["tests/test_fuzz_inputs.py", "tests/test_fuzz_verbs.py"]
_TEST = re.compile(r"^(tests/\S+::\S+):$")
_COUNTS = re.compile(r"- (\d+) passing examples, (\d+) failing examples, (\d+) invalid examples")


def run_campaign() -> tuple[dict[str, tuple[int, int, int]], int, float]:
    """{test: (passing, failing, invalid)} of the generate phase, pytest's exit code, seconds."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", *FILES, "-q", "-p", "no:cacheprovider", "--hypothesis-profile=campaign",
                           "--hypothesis-show-statistics"], capture_output=True, text=True, check=False)
    counts: dict[str, tuple[int, int, int]] = {}
    test = None
    for line in done.stdout.splitlines():
        if found := _TEST.match(line.strip()):
            test = found.group(1)
        elif (found := _COUNTS.search(line)) and test and test not in counts:  # the generate phase comes first
            counts[test] = tuple(int(g) for g in found.groups())  # type: ignore[assignment]
    if done.returncode:
        print(done.stdout[-4000:], file=sys.stderr)
    return counts, done.returncode, time.perf_counter() - started


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="campaigns, each with fresh draws")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    runs = [run_campaign() for _ in range(args.runs)]
    counts = runs[-1][0]
    rows = [f"| `{name.split('::')[1]}` | {p} | {f} | {i} |" for name, (p, f, i) in sorted(counts.items())]
    totals = [(sum(c[0] for c in run.values()), sum(c[1] for c in run.values()), code, seconds)
              for run, code, seconds in runs]
    body = "\n".join([
        "| test (the last run) | cases run | failing | discarded (invalid draws) |", "|---|---|---|---|", *rows, "",
        *(f"- run {k + 1}: {cases:,} generated cases over {len(run[0])} fuzz tests, {failing} failing, pytest exit "
          f"{code}, {seconds:.0f} s" for k, ((cases, failing, code, seconds), run) in enumerate(zip(totals, runs))),
        "", "Each run draws anew (`--hypothesis-profile=campaign`; CI runs the same tests with fixed draws). A case "
        "fails on a traceback, an \"internal error\", an exit code other than 0 or 2, a file written outside its "
        "folder, or more than 10 s (each test's deadline)."])
    print(body)
    if not args.no_write:
        from bench.benchmarks_md import write_section

        write_section("fuzz_campaign", "Fuzz campaign: every verb's options, files and environment",
                      "python -m bench.fuzz_campaign", body)
    return body


if __name__ == "__main__":
    main()
