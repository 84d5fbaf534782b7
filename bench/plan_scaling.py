"""Planning time against device count: `llama3-70b` on `h100-80g`.

Two tables. The first is issue 13's target: seq 8192, global batch 1024, on 16, 32, 256 and 1024
GPUs, the solver (one `make_plan` call: shape enumeration, bounds, ILPs, the relaxed re-search when
no layout meets the compute rule; warm trace cache) <= 2 s and the whole `advisor plan` command (a
fresh process: imports, planning, printing) <= 10 s. The second sweeps 8 to 4096 GPUs at seq 4096.
Every figure is the median of 3; the first table lists each run too.

    python bench/plan_scaling.py [--save before.json] [--before before.json] [--no-write]
                                 [--gpus 16,256] [--repeats 3]

`--before` adds the figures of another checkout to the first table: run this script with
PYTHONPATH=<that checkout>, from that checkout's folder, with `--save before.json --no-write` first.
bench/plan_scaling_before.json holds the figures of the checkout before the change the note
describes, measured so just before this table's run. `--gpus` times only those sizes of the first
table (a quick check; with it the script writes nothing to docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402

from planner.plan import PlanOptions, make_plan  # noqa: E402
from presets import load_hardware, load_model  # noqa: E402
from profiler.model_trace import trace_model  # noqa: E402

REPEATS = 3
# What the `a → b` columns compare: the checkout that bench/plan_scaling_before.json was measured on,
# and this one. Rewritten with each change the table is rerun for.
CHANGE = ("before (36134d9: every estimate read torch's, transformers' and peft's versions from their "
          "metadata to key its trace; every stage time rebuilt each linear's GEMMs and their tile counts for "
          "the wave loss) → after (the versions read once per process; the wave loss cached per GEMM shape; "
          "the same shapes, ILPs and top 5 layouts). Earlier: 800e8fc → the bounds and the LP of issue 13")
TARGET_SEQ, TARGET_BATCH, TARGET_GPUS = 8192, 1024, (16, 32, 256, 1024)
SWEEP_SEQ = 4096


def solve_runs(nodes: int, seq: int, batch: int):
    """The solver seconds of each of REPEATS `make_plan` calls, and the last plan."""
    model, hardware = load_model("llama3-70b"), load_hardware("h100-80g")
    times, plan = [], None
    for _ in range(REPEATS):
        plan = make_plan(PlanOptions(model=model, hardware=hardware, nodes=nodes, seq=seq, global_batch=batch))
        times.append(plan.solver["seconds"])
    return times, plan


def solve(nodes: int, seq: int, batch: int):
    """The median solver seconds of REPEATS `make_plan` calls, and the last plan."""
    times, plan = solve_runs(nodes, seq, batch)
    return statistics.median(times), plan


def command_runs(nodes: int, seq: int, batch: int) -> list[float]:
    """The wall-clock seconds of each of REPEATS `advisor plan` commands, each a fresh process."""
    words = [sys.executable, "-m", "advisor.cli", "plan", "--model", "llama3-70b", "--hardware", "h100-80g",
             "--nodes", str(nodes), "--seq-len", str(seq), "--global-batch", str(batch)]
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        subprocess.run(words, check=True, capture_output=True, env=os.environ)
        times.append(time.perf_counter() - started)
    return times


def target_rows(sizes: tuple[int, ...] = TARGET_GPUS) -> list[dict]:
    trace_model(load_model("llama3-70b"), TARGET_SEQ, "bf16")  # warm the cache: time the search, not the trace
    rows = []
    for gpus in sizes:
        nodes = gpus // 8
        solver_runs, plan = solve_runs(nodes, TARGET_SEQ, TARGET_BATCH)
        commands = command_runs(nodes, TARGET_SEQ, TARGET_BATCH)
        row = {"gpus": gpus, "nodes": nodes, "shapes": plan.solver["shapes"], "ilps": plan.solver["ilps"],
               "solver_s": statistics.median(solver_runs), "solver_runs": solver_runs,
               "command_s": statistics.median(commands), "command_runs": commands,
               "layout": plan.chosen.layout.short(), "step_s": plan.chosen.estimate.time.step_s}
        print(row, flush=True)
        rows.append(row)
    return rows


def _seconds(row: dict, key: str, digits: int) -> str:
    """The median, and each run in parentheses where the figures list them."""
    runs = row.get(key.replace("_s", "_runs"))
    listed = f" ({', '.join(f'{x:.{digits}f}' for x in runs)})" if runs else ""
    return f"{row[key]:.{digits}f}{listed}"


def target_table(rows: list[dict], before: dict[int, dict]) -> str:
    lines = ["| GPUs | nodes | shapes | ILPs solved | solver s: median (runs) | `advisor plan` s: median (runs) | "
             "chosen layout | step s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = before.get(r["gpus"])
        was = (lambda text: f"{text} → " if b else "")  # noqa: E731
        lines.append(f"| {r['gpus']} | {r['nodes']} | {was(b and b['shapes'])}{r['shapes']} | "
                     f"{was(b and b['ilps'])}{r['ilps']} | {was(b and _seconds(b, 'solver_s', 2))}"
                     f"{_seconds(r, 'solver_s', 2)} | {was(b and _seconds(b, 'command_s', 1))}"
                     f"{_seconds(r, 'command_s', 1)} | `{r['layout']}` | {r['step_s']:.3f} |")
    return "\n".join(lines)


def sweep_table() -> str:
    trace_model(load_model("llama3-70b"), SWEEP_SEQ, "bf16")
    lines = ["| GPUs | nodes | global batch | shapes | ILPs solved | plan s (median of 3) | chosen layout | MFU | "
             "compute |", "|---|---|---|---|---|---|---|---|---|"]
    for nodes in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        devices = 8 * nodes
        batch = max(1024, devices)
        seconds, plan = solve(nodes, SWEEP_SEQ, batch)
        est = plan.chosen.estimate
        lines.append(f"| {devices} | {nodes} | {batch} | {plan.solver['shapes']} | {plan.solver['ilps']} | "
                     f"{seconds:.2f} | `{plan.chosen.layout.short()}` | {100 * est.throughput.mfu:.0f}% | "
                     f"{100 * est.compute_fraction:.0f}% |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    global REPEATS  # --repeats: the figures' runs, read by the functions above
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", type=Path, help="write the first table's figures here (JSON)")
    parser.add_argument("--before", type=Path, help="figures of another checkout (from --save) to compare")
    parser.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    parser.add_argument("--gpus", help="only these sizes of the first table, comma-separated (writes no docs)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="runs per figure (median)")
    args = parser.parse_args()
    REPEATS = args.repeats
    load_start = load_average()
    sizes = tuple(int(g) for g in args.gpus.split(",")) if args.gpus else TARGET_GPUS
    if any(g % 8 for g in sizes):
        parser.error("--gpus: whole nodes of 8")
    rows = target_rows(sizes)
    if args.save:
        args.save.write_text(json.dumps(rows, indent=2) + "\n")
    if args.no_write or args.gpus:
        return
    before = {r["gpus"]: r for r in json.loads(args.before.read_text())} if args.before else {}
    sweep = sweep_table()
    note = (f"\n\nMedians of {REPEATS}, each run in parentheses. Measured under load: 1-minute load average "
            f"{load_start} at the start and {load_average()} at the end, on {os.cpu_count()} shared cores; an idle "
            "machine is several times faster. ILPs solved counts the shapes whose bounds could still beat the 5th "
            "best plan; when no layout meets the 80% compute rule the search runs again without it, and both "
            "passes count.")
    if before:
        same = all(f"{r['step_s']:.9g}" == f"{before[r['gpus']]['step_s']:.9g}" for r in rows if r["gpus"] in before)
        note += (f" The chosen step times {'equal' if same else 'DIFFER FROM'} the previous solver's to 9 digits "
                 f"(tests/test_plan_search.py checks the optimum against brute force). `a → b`: {CHANGE}.")
    body = (f"Issue 13's target, seq {TARGET_SEQ}, global batch {TARGET_BATCH}: solver <= 2 s and the whole "
            f"command <= 10 s at every size.\n\n{target_table(rows, before)}\n\nSweep at seq {SWEEP_SEQ} "
            f"(global batch max(1024, GPUs)):\n\n{sweep}{note}")
    write_section("plan_scaling", "Planning time against device count (llama3-70b, h100-80g)",
                  "python bench/plan_scaling.py --before bench/plan_scaling_before.json", body)


if __name__ == "__main__":
    main()
