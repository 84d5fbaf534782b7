"""Record the CLI's outputs over a fixed grid, to byte-compare a refactor's before and after.

    python -m bench.golden_outputs record DIR     # run every command, write DIR/<name>.json|.jsonl
    python -m bench.golden_outputs compare A B    # list the files whose content differs

Timing fields (solver seconds, wall-clock step times, throughput measured in a run) are stripped, so what
remains is deterministic on one machine: the cost model's figures, the planner's choice, the data
manifests and the demo's per-step losses (CPU training is deterministic).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from profiler.ranks import free_port

MODELS = ["demo-tiny", "llama2-7b", "llama3-70b", "mistral-7b", "qwen2.5-14b"]
HARDWARE = ["h100-80g", "rtx4090-24g", "a100-40g", "cpu"]
LAYOUTS = [
    "dp=1,mbs=1",
    "tp=2,zero=1,mbs=2,gas=4,recompute=selective",
    "tp=4,pp=2,zero=1,mbs=1,gas=16,recompute=full",
    "dp=8,zero=3,mbs=1,recompute=full",
    "dp=1,method=lora,mbs=4,recompute=full",
    "dp=1,method=qlora,mbs=2",
    "pp=4,vpp=2,zero=1,mbs=1,gas=8",
    "dp=2,zero=2,offload=optimizer,mbs=1",
]
PLANS = {
    "plan_throughput": ["--model", "llama3-8b", "--hardware", "h100-80g", "--nodes", "2", "--global-batch", "256"],
    "plan_70b": ["--model", "llama3-70b", "--hardware", "h100-80g", "--nodes", "16", "--seq-len", "4096",
                 "--global-batch", "1024"],
    "plan_task_demo": ["--model", "demo-tiny", "--hardware", "cpu", "--task", "demo"],
    "plan_cost": ["--model", "llama3-8b", "--hardware", "h100-80g", "--nodes", "16", "--objective", "cost",
                  "--deadline", "14d", "--tokens", "2e11", "--price-per-gpu-hour", "2.5"],
    "plan_auto_4090": ["--model", "llama2-7b", "--hardware", "rtx4090-24g", "--gpus-per-node", "1",
                       "--global-batch", "16", "--method", "auto"],
    "plan_infeasible": ["--model", "llama3-405b", "--hardware", "rtx4090-24g", "--gpus-per-node", "1"],
}
# Wall-clock fields, and what depends on the temporary folder (file paths, mtimes in fingerprints).
TIMING_KEYS = {"seconds", "wall_s", "step_s_measured", "elapsed_s", "time", "created", "tokens_per_s_measured",
               "fingerprint", "prepared_at", "files"}
RUN_TIMING_KEYS = {"tokens_per_s", "step_s", "time", "wall_s", "elapsed_s"}


def _advisor(*args: str, cwd: Path | None = None) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "advisor.cli", *args], capture_output=True, text=True, cwd=cwd)
    return done.returncode, done.stdout


def _strip(value, keys: set[str]):
    if isinstance(value, dict):
        return {k: _strip(v, keys) for k, v in value.items() if k not in keys and not k.endswith("_seconds")}
    if isinstance(value, list):
        return [_strip(v, keys) for v in value]
    return value


def _write(out: Path, name: str, rc: int, stdout: str) -> None:
    stdout = re.sub(re.escape(tempfile.gettempdir()) + r"/tmp\w+", "<tmp>/run", stdout)  # TemporaryDirectory
    try:
        body = _strip(json.loads(stdout), TIMING_KEYS)
    except json.JSONDecodeError:
        body = stdout
    (out / f"{name}.json").write_text(json.dumps({"rc": rc, "out": body}, indent=1, sort_keys=True))


def record(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model in MODELS:
        for hardware in HARDWARE:
            for i, layout in enumerate(LAYOUTS):
                rc, stdout = _advisor("estimate", "--model", model, "--hardware", hardware, "--nodes", "1",
                                      "--layout", layout, "--json")
                _write(out, f"estimate_{model}_{hardware}_{i}", rc, stdout)
    for name, args in PLANS.items():
        _write(out, name, *_advisor("plan", *args, "--json"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        _write(out, "report_capacity", *_advisor(
            "report", "capacity", "--model", "llama3-8b", "--tokens", "1e10", "--hardware", "h100-80g,a100-80g",
            "--gpus", "8,64", "--jobs", "1", "--out", str(tmp_path / "cap"), "--json"))
        demo = tmp_path / "demo"
        subprocess.run([sys.executable, "-m", "advisor.cli", "data", "generate-demo", "--out", str(demo),
                        "--scale", "0.2"], check=True, capture_output=True)
        rc, stdout = _advisor("data", "prepare", "--task", str(demo / "task.yaml"), "--out", str(tmp_path / "prep"),
                              "--json")
        _write(out, "data_prepare", rc, stdout)
        manifest = tmp_path / "prep" / "manifest.json"
        _write(out, "data_manifest", 0, manifest.read_text() if manifest.exists() else "missing")
        plan = tmp_path / "plan.yaml"
        _advisor("plan", "--model", "demo-tiny", "--hardware", "cpu", "--task", str(demo / "task.yaml"),
                 "--out", str(plan))
        rc, _ = _advisor("train", str(plan), "--out", str(tmp_path / "run"), "--max-steps-per-stage", "4",
                         "--master-port", str(free_port()))
        metrics = tmp_path / "run" / "metrics.jsonl"
        rows = [_strip(json.loads(line), RUN_TIMING_KEYS) for line in metrics.read_text().splitlines()] \
            if metrics.exists() else []
        (out / "train_metrics.jsonl").write_text(json.dumps({"rc": rc}) + "\n"
                                                + "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def compare(before: Path, after: Path) -> int:
    names = sorted({p.name for p in before.iterdir()} | {p.name for p in after.iterdir()})
    differ = [n for n in names if not (before / n).exists() or not (after / n).exists()
              or (before / n).read_bytes() != (after / n).read_bytes()]
    print(f"{len(names) - len(differ)} of {len(names)} outputs identical")
    for name in differ:
        print(f"differs: {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"]:
        record(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["compare"]:
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
