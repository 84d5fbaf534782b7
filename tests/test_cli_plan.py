"""`advisor plan` as a user meets it: contract, refusals with fixes, exports, stage granularity."""

import functools
import itertools
import json
import math

import pytest
from typer.testing import CliRunner

from specs.capabilities import ENGINES, engine_for
from advisor.cli import app
from specs.errors import UsageError
from specs.plan_file import load_plan
from specs.core import Layout, resolve_layout
from planner.cost_model import estimate
from planner.time_to_train import young_interval_s
from presets import load_hardware, load_model

runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args))


def test_full_finetune_of_llama2_7b_on_one_4090_is_refused_with_fixes() -> None:
    result = run("plan", "--model", "llama2-7b", "--hardware", "rtx4090-24g", "--gpus-per-node", "1",
                 "--global-batch", "16", "--seq-len", "2048")
    assert result.exit_code == 2
    err = result.stderr
    assert "does not fit 1 x rtx4090-24g" in err and "Traceback" not in err
    assert "--method lora: fits" in err and "--method qlora: fits" in err
    assert "host RAM" in err  # ZeRO-Offload would need more RAM than a 64 GiB workstation has


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_and_qlora_fit_llama2_7b_on_one_4090(method: str) -> None:
    result = run("plan", "--model", "llama2-7b", "--hardware", "rtx4090-24g", "--gpus-per-node", "1",
                 "--global-batch", "16", "--seq-len", "2048", "--method", method, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    best = out["plans"][0]
    assert best["layout"]["method"] == method
    assert best["estimate"]["memory"]["fits"]
    assert best["estimate"]["memory"]["peak"] <= best["estimate"]["memory"]["capacity"] * 0.95 + 1
    assert out["solver"]["status"] in ("optimal", "below_compute_rule")
    steps = [p["estimate"]["time"]["step_s"] for p in out["plans"]]
    assert steps == sorted(steps)  # best first


def test_plan_writes_a_plan_train_can_read_and_exports_launchers(tmp_path) -> None:
    out_file, export_dir = tmp_path / "plan.yaml", tmp_path / "launch"
    result = run("plan", "--model", "llama3-8b", "--hardware", "a100-80g", "--nodes", "2", "--seq-len", "4096",
                 "--global-batch", "256", "--top", "3", "--out", str(out_file), "--export", str(export_dir))
    assert result.exit_code == 0, result.output
    plan = load_plan(out_file)
    layout = plan.chosen.layout
    assert layout.devices == 16 and layout.global_batch == 256
    assert all(alt.layout.global_batch == 256 for alt in plan.alternatives)  # OOM fallbacks keep the batch
    # a DeepSpeed file only for the DeepSpeed engine, an accelerate file only without tp/pp (tests/test_export_scripts.py)
    engine = engine_for(layout, plan.engine)
    assert (export_dir / "deepspeed.json").exists() == (engine == "deepspeed")
    assert (export_dir / "accelerate.yaml").exists() == (layout.tp == 1 and layout.pp == 1)
    assert "--nnodes=2" in (export_dir / "torchrun.sh").read_text()
    slurm = (export_dir / "slurm.sbatch").read_text()
    # the launcher of `advisor train` on every node (issue 31: every segment of the plan runs)
    assert "#SBATCH --nodes=2" in slurm and "srun advisor train" in slurm and "--resume" in slurm


def test_task_stages_get_steps_and_young_checkpoint_intervals(tmp_path) -> None:
    result = run("plan", "--model", "demo-tiny", "--hardware", "a100-80g", "--gpus-per-node", "1", "--task", "demo",
                 "--mtbf-hours", "1", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    stages = out["stages"]
    assert [s["name"] for s in stages] == ["language", "reasoning", "instructions", "mixed"]
    for s in stages:
        tokens_per_step = s["layout"]["dp"] * s["layout"]["mbs"] * s["layout"]["gas"] * s["layout"]["seq"]
        assert s["steps"] == math.ceil(s["tokens"] / tokens_per_step)
        expected = round(young_interval_s(s["checkpoint_write_s"], 3600) / s["step_s"])
        assert s["checkpoint_every_steps"] == max(1, min(expected, s["steps"]))


def test_young_interval_minimises_expected_waste() -> None:
    write_s, mtbf_s = 30.0, 86400.0
    best = young_interval_s(write_s, mtbf_s)

    def waste(tau: float) -> float:  # checkpoint cost + expected rework, per unit of time
        return write_s / tau + tau / (2 * mtbf_s)

    assert waste(best) < waste(best * 0.8) and waste(best) < waste(best * 1.25)


COST_REQUEST = {"model": "llama3-8b", "hardware": "h100-80g", "nodes": 4, "seq": 4096, "global_batch": 256,
                "tokens": 1e10}


@functools.cache
def _brute_force_layouts() -> list[tuple[int, float]]:
    """(devices, tokens/s) of every layout in a plain grid that the planner may choose for COST_REQUEST:
    the device counts it compares (powers of two in a node, then 2 and 4 whole nodes), tp within a
    node with and without sequence parallelism, the global batch held, fitting with the planner's 5%
    memory margin, computing >= 80% of the step. Each is priced by the cost model alone, with no search."""
    hardware, model = load_hardware(COST_REQUEST["hardware"]), load_model(COST_REQUEST["model"])
    per_node = hardware.devices_per_node
    counts = [1, 2, 4, 8, 2 * per_node, 4 * per_node]
    found = []
    for devices, tp, sp, pp, mbs, zero, recompute in itertools.product(
            counts, (1, 2, 4, 8), (False, True), (1, 2, 4), (1, 2, 4), (0, 1, 2, 3), ("none", "selective", "full")):
        if devices % (tp * pp) or tp > per_node or (sp and tp == 1):
            continue
        dp = devices // (tp * pp)
        if COST_REQUEST["global_batch"] % (dp * mbs):
            continue
        gas = COST_REQUEST["global_batch"] // (dp * mbs)
        try:
            layout = resolve_layout(f"tp={tp},sp={int(sp)},pp={pp},zero={zero},mbs={mbs},gas={gas},"
                                    f"recompute={recompute}",
                                    devices, hardware, COST_REQUEST["seq"])
            est = estimate(model, hardware, layout)
        except UsageError:
            continue  # an illegal layout (tp not dividing the heads, pp not dividing the layers, ...)
        if est.memory.peak <= 0.95 * hardware.usable_bytes and est.compute_fraction >= 0.8:
            found.append((devices, est.throughput.tokens_per_s))
    return found


# loose, then tight enough to rule out the cheapest device counts (here 8 H100s). A deadline that
# rules out 16 (10h) is met only by recomputing some of the layers (the planner's granularity),
# which this grid does not enumerate.
@pytest.mark.parametrize("deadline,deadline_h", [("1000d", 24000.0), ("20h", 20.0)])
def test_cost_objective_picks_fewest_gpu_hours_that_meet_the_deadline(deadline: str, deadline_h: float) -> None:
    r = COST_REQUEST
    result = run("plan", "--model", r["model"], "--hardware", r["hardware"], "--nodes", str(r["nodes"]),
                 "--seq-len", str(r["seq"]), "--global-batch", str(r["global_batch"]), "--objective", "cost",
                 "--deadline", deadline, "--tokens", f"{r['tokens']:g}", "--json")
    assert result.exit_code == 0, result.output
    chosen = json.loads(result.stdout)["plans"][0]
    # the planner's choice, priced again by `advisor estimate` on its own device count
    layout = Layout(**chosen["layout"]).short()
    again = json.loads(run("estimate", "--model", r["model"], "--hardware", r["hardware"], "--layout", layout,
                           "--json").stdout)
    assert again["devices"] == chosen["estimate"]["devices"]
    chosen_hours = r["tokens"] / again["throughput"]["tokens_per_s"] / 3600
    assert chosen_hours <= deadline_h
    meeting = [devices * r["tokens"] / tokens_per_s / 3600 for devices, tokens_per_s in _brute_force_layouts()
               if r["tokens"] / tokens_per_s / 3600 <= deadline_h]
    assert meeting, "the grid has no layout that meets the deadline: the test proves nothing"
    assert again["devices"] * chosen_hours <= min(meeting) * (1 + 1e-9)


def test_plan_rejects_bad_requests_with_one_line() -> None:
    result = run("plan", "--model", "demo-tiny", "--hardware", "a100-80g", "--objective", "cost")
    assert result.exit_code == 2 and "needs --deadline" in result.stderr
    result = run("plan", "--model", "demo-tiny", "--hardware", "a100-80g", "--task", "no-such-task")
    assert result.exit_code == 2 and "unknown task preset" in result.stderr
