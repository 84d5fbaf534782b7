"""bench/gpu_check.py is run by whoever is lent a GPU, once, with minutes on the clock: its code path
must not rot on the CPU-only machines. The smoke run takes its CPU branch (a tiny model, no profile,
no figures written) through the same rows: capability check, cost-model estimate, timed steps.

It runs in a fresh interpreter, as on the GPU machine: the timed steps fork their ranks, and a
test process that earlier tests left with helper threads (thread pools, loggers) is no place to fork."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_the_gpu_check_runs_its_rows_through_the_trainers_timed_steps_on_cpu() -> None:
    from bench import gpu_check

    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--cpu-smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = sorted({line for line in done.stdout.splitlines()  # the layout table's rows: "| 1 | mbs=... |"
                   if line.startswith("| ") and line[2:].split(" ")[0].isdigit() and " ms |" in line})
    assert len(rows) == len(gpu_check.SMOKE_LAYOUTS), done.stdout[-3000:]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2].endswith(" ms") and cells[3].endswith(" ms") and cells[4].endswith("%"), row
    # plain torch's rates beside the profile's, and packed rows through the trainer's document kernel
    assert any(line.startswith("| bf16 GEMM ") for line in done.stdout.splitlines()), done.stdout[-3000:]
    packed = [line for line in done.stdout.splitlines() if line.startswith("| advisor_documents |")]
    assert packed and float(packed[-1].strip("|").split("|")[-1]) < 1e-4, done.stdout[-3000:]

    # the GPU rows themselves: each a valid one-device layout the cost model prices for the 1B model
    from specs.core import ModelSpec, resolve_layout
    from planner.cost_model import estimate
    from presets import load_hardware

    h100, model = load_hardware("h100-80g"), ModelSpec(name="llama-1b", hf_config=gpu_check.LLAMA_1B)
    for text in gpu_check.LAYOUTS:
        assert estimate(model, h100, resolve_layout(text, 1, h100), attention="sdpa").memory.fits, text
