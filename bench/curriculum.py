"""Does splitting the objective pay on the demo curriculum? `advisor curriculum compare`, honestly sized.

The bundled curriculum (trainer/data/demo_corpus.py: language, arithmetic reasoning, instructions,
then a mixed stage replaying 30% language and 30% reasoning), generated at --scale times its usual
size (fresh documents, not repeats of the default files), trained at --scale times every stage's
budget under the five variants of reports/curriculum_variants.py (one-pot, staged hard switch,
staged + ramped replay, the task as written with its mixed stage, and late-mix: one-pot until the
decay, then the later skills' data with a replay of the pool), all under one WSD schedule at one
peak rate per run, the rate tuned per variant over --lr-grid on seed 0, --seeds seeds each, on a
scaled-down proxy of demo-tiny (--hidden, --layers: the same tokenizer, sequence and batch), one
process per core of this CPU, through the command users run:

    advisor curriculum compare --task <demo copy> --seeds 3 --scale 20 --hidden 64 --layers 2 --lr-grid 0.25,0.5,1,2,4 ...

Scores: each skill's eval loss on its held-out file (the trainer's stage-end evaluation,
--eval-sequences sequences), exact match where the trainer's evaluation gives it; mean ± sample
standard deviation over seeds. Forgetting: how much a skill's loss rose after its own stage;
recovery: how much of that the last stage took back. The finding (no staged variant matches one-pot
on every skill, or that one does) goes to presets/findings/demo.json, which `advisor plan --task
demo` prints.

A full comparison trains for hours (35 runs of about 22 minutes on one core each at 20x), longer than a
session of a machine that starts empty: each finished run's record is kept in bench/results/
(bench/curriculum_archive.py) while the bench runs, and restored by the next invocation anywhere,
whose fingerprint check reuses it; commit that folder to carry the bench over.

    python -m bench.curriculum [--scale 20] [--seeds 3] [--hidden 64] [--layers 2] [--lr-grid 0.25,0.5,1,2,4] [--no-write]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402
from curriculum_archive import Keeper, restore  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FINDING = ROOT / "presets" / "findings" / "demo.json"
DEMO_TOKENS = 360_000  # the demo task's budgets summed: the previous bench's tokens (--scale 1)


def load_average() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def compare_command(task: Path, out: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "advisor.cli", "curriculum", "compare", "--task", str(task), "--seeds",
            str(args.seeds), "--scale", str(args.scale), "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--eval-sequences", str(args.eval_sequences), "--lr-grid", args.lr_grid, "--jobs", str(args.jobs),
            "--out", str(out), "--json"]


def flattening(result: dict) -> str:
    """One-pot's training loss (mean over seeds) in each tenth of its steps, and whether it had flattened
    before the decay: WSD decays over the run's last tenth (wsd_decay_fraction 0.1), whose drop is the
    schedule's gain, not more learning, so the flatness criterion is the ninth tenth against the eighth."""
    tenths = result["variants"].get("one-pot", {}).get("train_loss_tenths", [])
    if len(tenths) < 10:
        return "no record"
    values = [t["mean"] for t in tenths]
    stable = 100 * (values[8] - values[7]) / values[7]
    decay = 100 * (values[9] - values[8]) / values[8]
    verdict = "flat: under 1%" if abs(stable) < 1 else "not flat yet: 1% or more; a larger --scale trains longer"
    return (", ".join(f"{v:.3f}" for v in values) + f" (the stable phase's last tenth against the one before: "
            f"{stable:+.1f}%, {verdict}; the decay's tenth against it: {decay:+.1f}%)")


def finding_sentence(result: dict, tokens: int, date: str) -> str | None:
    if not result.get("finding"):
        return None
    variants = result["variants"]
    pot = variants["one-pot"]["eval"]["mean"]["mean"]
    staged = {n: v["eval"]["mean"]["mean"] for n, v in variants.items() if n != "one-pot"}
    best = min(staged, key=staged.get)
    return (f"measured on the demo curriculum ({date}, bench/curriculum.py: {result['seeds']} seeds, {tokens:,} tokens, "
            f"a {result['model']} proxy, WSD for every variant at its best peak rate): no other curriculum matched "
            f"one-pot training on every skill; mean eval loss {pot:.3f} one-pot against {staged[best]:.3f} for the "
            f"best other variant ({best})")


def body_text(result: dict, command: list[str], wall_s: float | None, loads: list[str], tokens: int, jobs: int) -> str:
    from reports.curriculum import SCHEDULE_PROTOCOL, forgetting_markdown, table_markdown, tuning_markdown, winners_text

    rec = result["recommendation"]
    shown = " ".join(Path(c).name if c == sys.executable else c for c in command)
    lines = [
        f"Advisor command: `{shown}` (the task: the demo's task.yaml next to its data, generated at {result['scale']}x).",
        "",
        f"Proxy {result['model']} ({result['hf_config']['hidden_size']} hidden, "
        f"{result['hf_config']['num_hidden_layers']} layers, the demo's tokenizer, sequence length and batch), "
        f"{tokens:,} tokens per run ({tokens / DEMO_TOKENS:.0f}x the previous bench's), {result['seeds']} seeds per "
        f"variant, eval on {result['eval_sequences']} held-out sequences per skill. Final eval loss, mean ± sample "
        "standard deviation over seeds (lower is better):",
        "",
        table_markdown(result),
        "",
        f"Schedule: {result.get('schedule', SCHEDULE_PROTOCOL)}. Peak rate per variant (seed 0's final mean eval "
        "loss at each rate of the grid; (edge): the best rate is the grid's lowest or highest):",
        "",
        tuning_markdown(result),
        "",
        f"Recommendation ({rec['rule']}): {rec['text']}.",
        "",
        f"Which variant wins each skill: {winners_text(result)}.",
        "",
        f"Has one-pot flattened? Its training loss by tenths of the run: {flattening(result)}.",
    ]
    if "exact_match" not in next(iter(result["variants"].values())):
        lines += ["", "Exact match: this build's evaluation scores loss only (exact match comes with issue 17's "
                  "evaluation; rerun the command after it to fill the columns)."]
    forgot = forgetting_markdown(result)
    if forgot:
        lines += ["", "Forgetting and recovery per skill (staged variants; recovered: the share of the rise the "
                  "last stage took back):", "", forgot]
    complete = result.get("complete", True)
    runs = [r for v in result["variants"].values() for r in v["runs"]]
    done, total = result.get("runs_done", len(runs)), result.get("runs_total", len(runs))
    if not complete:
        lines[0:0] = [f"**Partial: {done} of {total} runs** (the command was still running when this was "
                      "written; a variant without a spread has one seed).", ""]
    lines += ["", f"Finding: {result['finding']}." if result.get("finding") else
              "Finding: none yet (not every variant has its seeds)." if not complete else
              "Finding: at least one staged variant matched one-pot on every skill (within the seeds' spread)."]
    per_run = sum(r["wall_s"] for r in runs) / max(1, len(runs))
    reused = result.get("runs_reused", 0) + result.get("runs_resumed", 0)
    timing = (f"Wall time {wall_s / 60:.1f} min for all {total} runs" if wall_s is not None and complete and not reused
              else f"{len(runs)} runs done")
    if reused:  # this invocation's wall time does not cover the runs an earlier one trained
        timing += (f" ({result.get('runs_reused', 0)} reused and {result.get('runs_resumed', 0)} resumed from an "
                   "earlier invocation into the same --out or from the bench's archive of finished runs; each run's "
                   "time as it was measured)")
    lines += ["", f"{timing}, {jobs} at a time on this CPU (one core each), {per_run / 60:.1f} min per run; "
              f"1-minute load average {', '.join(loads)} (2 cores, shared by other work: an idle machine runs a "
              "step several times faster)."]
    return "\n".join(lines)


def write_finding(sentence: str | None, command: str) -> None:
    FINDING.parent.mkdir(parents=True, exist_ok=True)
    FINDING.write_text(json.dumps({"task": "demo", "finding": sentence, "command": command}, indent=2) + "\n")


def default_archive(args: argparse.Namespace) -> Path:
    """Where the finished runs of this bench's size are kept (bench/curriculum_archive.py)."""
    return ROOT / "bench" / "results" / (f"curriculum-x{args.scale:g}-h{args.hidden}-l{args.layers}"
                                         f"-e{args.eval_sequences}")


def run_compare(args: argparse.Namespace) -> tuple[dict, list[str], float | None, list[str]]:
    """Generate the demo data at --scale, run the command; its JSON, the command, wall time, loads."""
    from trainer.data.demo_corpus import generate_demo_corpus

    # With --out the data lives beside it (<out>-data), generated once per scale: the runs' fingerprints
    # name the task's files, so a later invocation into the same --out (another session) reuses its runs.
    work = args.out.with_name(args.out.name + "-data") if args.out else Path(tempfile.mkdtemp(prefix="curriculum_"))
    stamp, task = work / "generated.json", work / "task.yaml"
    if not (task.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == {"scale": args.scale}):
        task = generate_demo_corpus(work, scale=args.scale)["task.yaml"]
        stamp.write_text(json.dumps({"scale": args.scale}))
    out = args.out or work / "report"
    command = compare_command(task, out, args)
    archive = None if args.no_archive else (args.archive or default_archive(args))
    if archive is not None:
        print(f"archive {archive}: {restore(archive, out)} finished runs restored into {out}")
    loads = [load_average()]
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with Keeper(out, archive) if archive is not None else contextlib.nullcontext():
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=False)
    wall_s = time.perf_counter() - started
    loads.append(load_average())
    if done.returncode:
        sys.exit(f"advisor curriculum compare failed (exit {done.returncode}); see {out}/logs/output.log")
    print(f"report: {out}")
    return json.loads(done.stdout.strip().splitlines()[-1]), command, wall_s, loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 20x: at 10x one-pot's training loss still fell 1.6% from the eighth tenth to the ninth (3 seeds)
    parser.add_argument("--scale", type=float, default=20.0, help="multiplies every stage's budget and data")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64, help="the proxy's hidden size (demo-tiny: 256)")
    parser.add_argument("--layers", type=int, default=2, help="the proxy's layers (demo-tiny: 4)")
    parser.add_argument("--eval-sequences", type=int, default=64)
    # 0.25-4x of the first stage's 2e-3: at 10x the best rate was the grid's edge for every variant, the
    # lowest (1e-3) for the staged ones and the highest (4e-3) for one-pot and late-mix
    parser.add_argument("--lr-grid", default="0.25,0.5,1,2,4", help="peak rate factors every variant is tried at")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (2: one per core of this CPU)")
    parser.add_argument("--out", type=Path, default=None, help="report dir (default: a temporary folder); the same "
                        "--out again reuses the runs it finished and resumes a stopped one")
    parser.add_argument("--from-report", type=Path, default=None,
                        help="write the section from this report dir's compare.json (a finished or a partial "
                        "comparison) instead of running one")
    parser.add_argument("--wall-s", type=float, default=None,
                        help="with --from-report: the comparison's wall time in seconds, as its run printed it")
    parser.add_argument("--archive", type=Path, default=None, help="where finished runs are kept and restored from "
                        "(default: bench/results/curriculum-x<scale>-h<hidden>-l<layers>-e<eval sequences>, committed "
                        "with the repository, so that the bench goes on where another machine stopped)")
    parser.add_argument("--no-archive", action="store_true", help="neither restore nor keep finished runs")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md or the finding")
    args = parser.parse_args()
    if args.from_report:
        from reports.curriculum import one_pot_finding, recommendations

        result = json.loads((args.from_report / "compare.json").read_text())
        # the verdicts again from the stored statistics, by this build's rule
        metrics = [m for m in ("eval", "exact_match") if m in next(iter(result["variants"].values()))]
        result["recommendation"] = recommendations(result["variants"], result["skills"], metrics)
        result["finding"] = one_pot_finding(result["variants"], result["skills"])
        command = compare_command(Path("<demo copy>/task.yaml"), Path("<report dir>"), args)
        wall_s, loads = args.wall_s, [load_average()]
    else:
        result, command, wall_s, loads = run_compare(args)
    tokens = next(iter(result["variants"].values()))["tokens"]
    body = body_text(result, command, wall_s, loads, tokens, args.jobs)
    print(body)
    bench_command = ("python -m bench.curriculum"
                     + "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                               if k not in ("no_write", "out", "from_report", "wall_s", "archive", "no_archive")
                               and v != parser.get_default(k)))
    if not args.no_write:
        write_section("curriculum", "Curriculum: does splitting the objective pay? Five variants at equal tokens, "
                      f"one WSD schedule, the peak rate tuned per variant ({result['seeds']} seeds, demo curriculum)",
                      bench_command, body)
        if result.get("complete", True):  # a partial comparison states no finding
            write_finding(finding_sentence(result, tokens, dt.date.today().isoformat()), bench_command)


if __name__ == "__main__":
    main()
