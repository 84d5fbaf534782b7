"""Predicted against measured step time of real training steps of `demo-tiny` on this CPU.

1. Profile: `advisor profile --quick --model demo-tiny --out PROFILE` (skipped with --profile).
   Its calibration ran a 2-layer cut of demo-tiny at seq 256 (mbs 1, mbs 4, LoRA mbs 2) to fit
   the GEMM and memory efficiencies (planner/calibration.py).
2. Measure: every layout below trains the full 4-layer demo-tiny through `advisor train`'s own
   engine and step code (trainer/timed_steps.py: fp32, AdamW; DDP over forked gloo ranks for 2
   ranks) for STEPS optimizer steps, one thread per rank (a device is one core, as in the
   profile); the figure is the median step after WARMUP steps, of the slowest rank.
3. Predict: `advisor estimate --model demo-tiny --hardware PROFILE --layout ... --json`.

All layouts here are held out: none of them ran in the calibration (other depth, and other
mbs/seq/recompute/method/rank combinations).

    python -m bench.step_time_accuracy [--profile p.json] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks_md import write_section  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from advisor.cli import app  # noqa: E402
from specs.profile import load_profile  # noqa: E402
from specs.core import Layout, parse_layout_string  # noqa: E402
from presets import load_model  # noqa: E402
from trainer.timed_steps import time_layout  # noqa: E402

# dp is always written out: without it `estimate` fills dp with every device of the node.
LAYOUTS = [
    "dp=1,mbs=2,seq=256",
    "dp=1,mbs=1,seq=512",
    "dp=1,mbs=2,seq=512",
    "dp=1,mbs=4,seq=256,recompute=full",
    "dp=1,mbs=4,seq=256,method=lora",
    "dp=1,mbs=2,seq=512,recompute=full,method=lora",
    "dp=1,mbs=2,seq=256,gas=2",
    "dp=2,mbs=2,seq=256",
    "dp=2,mbs=2,seq=512,recompute=full",
    "dp=2,mbs=4,seq=256,method=lora",
]
GOAL = 0.15


def layout_of(text: str) -> Layout:
    return Layout(**parse_layout_string(f"{text},dtype=fp32"))


def _short(layout: str) -> str:
    """'dp=1,tp=1,...,mbs=4,...' -> 'mbs=4 seq=256' (the keys that differ from the defaults)."""
    keep = ("dp", "mbs", "gas", "seq", "method", "recompute")
    defaults = {"dp=1", "gas=1", "method=full", "recompute=none"}
    return " ".join(kv for kv in layout.split(",") if kv.split("=")[0] in keep and kv not in defaults)


def predict(profile: Path, layout: str) -> dict:
    result = CliRunner().invoke(app, ["estimate", "--model", "demo-tiny", "--hardware", str(profile),
                                      "--layout", f"{layout},dtype=fp32", "--json"])
    if result.exit_code != 0:
        raise RuntimeError(result.output)
    return json.loads(result.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, help="use this profile instead of profiling first")
    parser.add_argument("--out", type=Path, default=Path("/tmp/step_time_profile.json"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out (glibc's mmap threshold warms up)")
    parser.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args()
    profile_path = args.profile
    quick_s = None
    if profile_path is None:
        profile_path = args.out
        started = time.perf_counter()
        result = CliRunner().invoke(app, ["profile", "--quick", "--model", "demo-tiny", "--out", str(profile_path)])
        quick_s = time.perf_counter() - started
        if result.exit_code != 0:
            raise SystemExit(result.output)
        print(result.stdout)
    profile = load_profile(profile_path)
    threads = profile.inventory.threads_per_device
    hw = profile.hardware
    lines = ["| # | layout (demo-tiny, fp32) | ranks | measured step | predicted step | error | load avg |",
             "|---|---|---|---|---|---|---|"]
    errors = []
    for i, layout in enumerate(LAYOUTS, 1):
        run = layout_of(layout)
        measured = time_layout(load_model("demo-tiny"), run, steps=args.steps, threads=threads, warmup=args.warmup)
        load = Path("/proc/loadavg").read_text().split()[0] if Path("/proc/loadavg").exists() else "?"
        predicted = predict(profile_path, layout)["time"]["step_s"]
        error = predicted / measured.step_s - 1
        errors.append(error)
        lines.append(f"| {i} | {layout} | {run.devices} | {measured.step_s * 1e3:.0f} ms | "
                     f"{predicted * 1e3:.0f} ms | {100 * error:+.1f}% | {load} |")
        print(lines[-1], flush=True)
    within = sum(abs(e) <= GOAL for e in errors)
    cal = profile.calibration
    eff = hw.efficiency
    fitted_runs = ", ".join(_short(step.layout) for step in cal.steps) if cal else ""
    summary = (
        f"\n\n{within} of {len(errors)} layouts within {100 * GOAL:.0f}% (worst {100 * max(map(abs, errors)):.1f}%, "
        f"mean {100 * sum(errors) / len(errors):+.1f}%). "
        f"Profile: {'`advisor profile --quick --model demo-tiny`' + (f' in {quick_s:.0f} s' if quick_s else '')}; "
        f"GEMM fp32 {hw.peak_tflops['fp32'] * 1e3:.1f} GFLOP/s, copy {hw.memory_bandwidth_gbs:.1f} GB/s, "
        f"all-reduce {hw.intra_node_bandwidth_gbs:.2f} GB/s bus + {hw.intra_node_latency_us:.0f} µs, "
        f"{threads} thread per device. Fitted: GEMM efficiency {eff.gemm:.2f}, memory {eff.memory_bandwidth:.2f}, "
        f"LoRA adapters {eff.adapter_gemm or eff.gemm:.2f}, {eff.micro_batch_overhead_s * 1e3:.1f} ms per micro-batch, "
        f"node contention +{100 * eff.node_contention:.0f}%"
        + (f", from {len(cal.steps)} layouts of a {cal.layers}-layer cut ({fitted_runs})" if cal else "")
        + ". Measured: median of steps "
        f"{args.warmup + 1}-{args.steps}, slowest rank. Every layout is held out from the calibration (other depth "
        "and other mbs/seq/gas/recompute/method combinations). The 1-minute load average per row includes this "
        "bench's own ranks; a busier machine slows wall-clock steps, 2-rank steps most."
    )
    print(summary)
    if not args.no_write:
        write_section("step_time_accuracy", "Step time: predicted (from a quick profile) against measured "
                      "(demo-tiny, this CPU)", "python -m bench.step_time_accuracy", "\n".join(lines) + summary)


if __name__ == "__main__":
    main()
