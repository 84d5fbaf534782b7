"""The fuzz campaign of issue 31: every fuzz test of tests/test_fuzz_inputs.py (files, layout strings,
numbers) and tests/test_fuzz_verbs.py (every verb's options under drawn environment variables), run
by pytest with Hypothesis's statistics, counted per test.

    python -m bench.fuzz_campaign [--no-write]

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
    done = subprocess.run([sys.executable, "-m", "pytest", *FILES, "-q", "-p", "no:cacheprovider",
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
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    counts, code, seconds = run_campaign()
    passing = sum(c[0] for c in counts.values())
    failing = sum(c[1] for c in counts.values())
    rows = [f"| `{name.split('::')[1]}` | {p} | {f} | {i} |" for name, (p, f, i) in sorted(counts.items())]
    body = "\n".join([
        "| test | cases run | failing | discarded (invalid draws) |", "|---|---|---|---|", *rows, "",
        f"{passing:,} generated cases over {len(counts)} fuzz tests, {failing} failing; pytest exit {code}; "
        f"{seconds:.0f} s on this 2-core machine. A case fails on a traceback, an \"internal error\", an exit "
        "code other than 0 or 2, a file written outside its folder, or more than 10 s."])
    print(body)
    if not args.no_write:
        from bench.benchmarks_md import write_section

        write_section("fuzz_campaign", "Fuzz campaign: every verb's options, files and environment",
                      "python -m bench.fuzz_campaign", body)
    return body


if __name__ == "__main__":
    main()
