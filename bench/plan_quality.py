"""How good is `advisor run`'s choice? Against every layout of the search space, measured.

On this CPU with 2 ranks (one core each, as the profile defines a device) and demo-tiny on the
demo task (global batch 16, seq 256):

1. `advisor run --max-steps-per-stage N` from a fresh cache: profile, plan, verify the top K,
   train, feed back. Its wall time and the layout it trained.
2. The exhaustive trial: every layout the planner's search space holds for 2 devices at tp = pp
   = 1 (what the trainer runs), with no and with every layer recomputed, is measured through
   `advisor train`'s own engines and step code (trainer/timed_steps.py: forked gloo ranks, random
   tokens, STEPS steps, median after 2 warm-up steps), each layout as the trainer runs it.
3. `advisor run` again on the same machine: the profile now carries the first run's feedback. Its
   prediction error of its own trials, against the first run's (the feedback's out-of-sample test).

Reported: measured tokens/s of the layout each run trained (and of the planner's untested first
choice) over the best measured; the time of the whole `run` against that of the exhaustive trial.

    python -m bench.plan_quality [--steps 4] [--runs 2] [--verify 3] [--no-write]

Issue 14's grid (DDP and TP x micro-batch 1-8 x recompute on a 512-wide model that is no preset, the
planner's untested first choice from a fresh quick profile) is bench/plan_quality_grid.py.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402

GOAL = 0.95


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def advisor_run(cache: Path, out: Path, steps_per_stage: int, verify: int) -> tuple[dict, float]:
    env = {**os.environ, "ADVISOR_CACHE": str(cache)}
    command = [sys.executable, "-m", "advisor.cli", "run", "--out", str(out), "--max-steps-per-stage",
               str(steps_per_stage), "--verify", str(verify), "--json"]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"advisor run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), seconds


def search_space(profile: Path) -> list:
    """Every uniform layout the planner enumerates for 2 devices at tp = pp = 1, full method."""
    from presets import load_task
    from planner.search import PlanRequest, SearchSpace, enumerate_shapes
    from presets import load_hardware, load_model
    from profiler.model_trace import trace_model

    model = load_model("demo-tiny")
    hardware = load_hardware(str(profile)).model_copy(update={"devices_per_node": 2})
    task = load_task("demo")
    trace = trace_model(model, task.seq_len, dtype="fp32", device_type="cpu")
    request = PlanRequest(model=model, hardware=hardware, devices=2, seq=task.seq_len,
                          global_batch=task.global_batch or 16, dtype="fp32",
                          space=SearchSpace(tp_degrees=(1,), pp_degrees=(1,)))
    out = []
    for shape in enumerate_shapes(trace, request, "full"):
        # the ILP picks how many layers of a shape recompute (0 to all); with no memory pressure
        # time only grows with that count, so its two ends bound every choice
        out += [shape.model_copy(update={"recompute": "none"}), shape] if shape.recompute != "none" else [shape]
    return out


def key(layout) -> str:
    return layout.short()


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="plan_quality_"))
    cache = work / "cache"
    loads = [load_average()]
    print(f"run 1 (fresh cache {cache}) ...", flush=True)
    runs = [advisor_run(cache, work / "run1", args.steps_per_stage, args.verify)]
    loads.append(load_average())
    profile = Path(runs[0][0]["hardware_basis"])

    layouts = search_space(profile)
    started = time.perf_counter()
    measured, rows = measure_every_layout(layouts, args.steps)
    exhaustive_s = time.perf_counter() - started
    loads.append(load_average())
    for i in range(1, args.runs):
        print(f"run {i + 1} (same cache: the profile carries run {i}'s feedback) ...", flush=True)
        runs.append(advisor_run(cache, work / f"run{i + 1}", args.steps_per_stage, args.verify))
        loads.append(load_average())

    tokens_per_step = layouts[0].tokens_per_step
    best_key = min(measured, key=measured.get)
    best_tps = tokens_per_step / measured[best_key]
    run_table, ratios = runs_table(runs, measured, tokens_per_step, best_tps)
    decision_s = [r["timings"].get("profile_s", 0) + r["timings"].get("plan_s", 0) + r["timings"].get("verify_s", 0)
                  for r, _ in runs]
    summary = (
        f"\n\nBest measured: {_short(best_key)} at {best_tps:,.0f} tokens/s. "
        f"The layout `advisor run` trained reached {', '.join(f'{100 * r:.0f}%' for r in ratios)} of it "
        f"(goal >= {100 * GOAL:.0f}%). Exhaustive trial: {len(rows)} distinct layouts ({len(layouts)} in the "
        f"search space) x {args.steps} steps in {exhaustive_s:.0f} s; "
        f"`advisor run` decided (profile + plan + verify) in {', '.join(f'{s:.0f}' for s in decision_s)} s and "
        f"took {', '.join(f'{s:.0f}' for _, s in runs)} s in all with {args.steps_per_stage} training steps per "
        f"stage (run 1 profiles from scratch; run 2 reuses the profile). Trials' step error: each run's "
        f"verification trials predicted with the profile as it stood before that run (run 1: the fresh "
        f"calibration; run 2: after run 1's feedback), RMS of predicted/measured - 1. 1-minute load average "
        f"before, between and after: {', '.join(loads)} on 2 cores shared with other jobs: absolute "
        "times are noisy; rerun on a quiet machine."
    )
    body = ("\n".join(run_table) + "\n\nEvery layout of the search space, measured:\n\n"
            + "\n".join(layouts_table(rows, tokens_per_step, best_tps)) + summary)
    print(body)
    if not args.no_write:
        write_section("plan_quality", "Plan quality: `advisor run`'s choice against every layout measured "
                      "(demo-tiny, 2 ranks, this CPU)", "python -m bench.plan_quality", body)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per layout in the exhaustive trial")
    parser.add_argument("--runs", type=int, default=2, help="`advisor run`s (the second tests the feedback)")
    parser.add_argument("--verify", type=int, default=3)
    parser.add_argument("--steps-per-stage", type=int, default=4, help="training steps per stage in each run")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    return parser.parse_args()


def measure_every_layout(layouts: list, steps: int) -> tuple[dict[str, float], list[tuple]]:
    """Each distinct layout's measured step time, and (layout, step time, load average) in the order measured."""
    from presets import load_model
    from trainer.timed_steps import time_layout

    measured: dict[str, float] = {}
    rows = []
    for layout in layouts:
        if key(layout) in measured:
            continue
        step_s = time_layout(load_model("demo-tiny"), layout, steps=steps, threads=1, warmup=2).step_s
        measured[key(layout)] = step_s
        rows.append((layout, step_s, load_average()))
        print(f"  {layout.short()}: {step_s:.3f} s (load {rows[-1][2]})", flush=True)
    return measured, rows


def measured_tokens_per_s(layout_text: str, measured: dict[str, float], tokens_per_step: int) -> float | None:
    """The measured tokens/s of a layout `advisor run` printed; None if the trial did not measure it."""
    from specs.core import Layout, parse_layout_string

    layout = Layout(**parse_layout_string(layout_text))
    step = measured.get(key(layout))
    return tokens_per_step / step if step else None


def runs_table(runs: list[tuple[dict, float]], measured: dict[str, float], tokens_per_step: int,
               best_tps: float) -> tuple[list[str], list[float]]:
    """The Markdown table of each `advisor run`, and the trained layout's share of the best measured."""
    run_table = ["| run | seconds | profile | plan | verify | train | planner's #1 | of best | trained (after verify) | "
                 "of best | trials' step error before feedback (RMS) | after refit |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for i, (result, seconds) in enumerate(runs, 1):
        timings = result["timings"]
        trials = result["verification"]["trials"] if result["verification"] else []
        first = trials[0]["layout"] if trials else result["plan"]
        first_tps = measured_tokens_per_s(first, measured, tokens_per_step)
        trained_tps = measured_tokens_per_s(result["plan"], measured, tokens_per_step)
        ratio_first = first_tps / best_tps if first_tps else float("nan")
        ratio = trained_tps / best_tps if trained_tps else float("nan")
        ratios.append(ratio)
        fb = result.get("feedback") or {}
        run_table.append(
            f"| {i} | {seconds:.0f} | {timings.get('profile_s', 0):.0f} | {timings.get('plan_s', 0):.1f} | "
            f"{timings.get('verify_s', 0):.0f} | {timings.get('train_s', 0):.0f} | {_short(first)} | "
            f"{100 * ratio_first:.0f}% | {_short(result['plan'])} | {100 * ratio:.0f}% | "
            f"{100 * fb.get('new_error_before', float('nan')):.1f}% | "
            f"{100 * fb.get('error_after', float('nan')):.1f}% (over {fb.get('used', 0)} observations) |")
    return run_table, ratios


def layouts_table(rows: list[tuple], tokens_per_step: int, best_tps: float) -> list[str]:
    """The Markdown table of every layout measured, fastest first."""
    table = ["| # | layout (dp=2, demo-tiny, fp32, seq 256, global batch 16) | measured step | "
             "tokens/s | of best | load |", "|---|---|---|---|---|---|"]
    for i, (layout, step, load) in enumerate(sorted(rows, key=lambda r: r[1]), 1):
        table.append(f"| {i} | zero={layout.zero},mbs={layout.mbs},gas={layout.gas},recompute={layout.recompute} | "
                     f"{step:.2f} s | {tokens_per_step / step:,.0f} | "
                     f"{100 * tokens_per_step / step / best_tps:.0f}% | {load} |")
    return table


def _short(text: str) -> str:
    keep = [kv for kv in text.split(",") if kv.split("=")[0] in ("zero", "mbs", "gas", "recompute", "world", "dp",
                                                                 "method")]
    return ",".join(keep)


if __name__ == "__main__":
    main()
