"""`advisor report capacity` and `advisor report run`, checked against independent truth.

Capacity: every figure on the page is compared with the planner's own output for the same inputs
(`make_plan`, called here directly) and with the checkpoint and failure arithmetic written out
below from its definition (Young's interval, failures = wall-clock hours x nodes / MTBF). The page
is loaded in headless Chromium: no errors, no network requests, every chart decoded.

Run: a synthetic run dir written here by the run-dir contract (docs/architecture.md), whose
every number is known, so the page's figures can be checked against the values written.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from advisor.cli import app
from specs.core import GiB
from presets import load_task
from browser import render
from planner.time_to_train import time_to_train
from planner.plan import InfeasiblePlan, PlanOptions, make_plan
from presets import load_hardware, load_model, preset_data
from reports.capacity import scaling_curves

runner = CliRunner()

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CAPACITY_CHARTS = {"wall_clock", "cost", "memory", "scaling", "methods"}
RUN_CHARTS = {"predicted_measured", "loss", "lr", "eval"}

# the capacity example the capacity tests share: ~2 s of planning on traces that ship with the presets
# (an option the planner refuses costs more: it plans the nearest fixes, and a fix at a shorter
# sequence needs a fresh model trace, so refusals get their own small example below)
MODEL, TOKENS, BATCH, SEQ = "llama2-7b", 1e9, 64, 2048
HARDWARE, GPUS, METHODS = ["h100-80g", "a100-80g"], [1, 8], ["full", "lora"]
PRICES = {"h100-80g": 2.5, "a100-80g": 1.6}
DEADLINE_S = 2 * 86400
MTBF_H, WRITE_GBS, RESTART_S = 2000.0, 2.0, 600.0  # the planner's defaults and the report's stated restart


# ------------------------------------------------------------------------------------------------
# reading figures back from a page


class _Cells(HTMLParser):
    """Every <td data-key data-value> with its text, and every chart figure's image."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[str, tuple[float, str]] = {}
        self.charts: dict[str, str] = {}
        self._open: tuple[str, float] | None = None
        self._text: list[str] = []
        self._figure: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "td" and "data-key" in a:
            self._open, self._text = (a["data-key"], float(a["data-value"])), []
        elif tag == "figure":
            self._figure = a.get("data-chart")
        elif tag == "img" and self._figure:
            self.charts[self._figure] = a.get("src", "")

    def handle_data(self, data):
        if self._open:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "td" and self._open:
            key, value = self._open
            self.cells[key] = (value, "".join(self._text).strip())
            self._open = None
        elif tag == "figure":
            self._figure = None


def page_cells(html: str) -> _Cells:
    parser = _Cells()
    parser.feed(html)
    return parser


def shown_value(text: str) -> tuple[float, float]:
    """The number a reader sees, and half a unit of its last digit (the rounding it may carry)."""
    percent = text.endswith("%")
    digits = text.rstrip("%").replace(",", "")
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    scale = 0.01 if percent else 1.0
    return float(digits) * scale, 0.5 * 10 ** -decimals * scale


def assert_shown(cells: _Cells, key: str, expected: float, rel: float = 1e-9) -> None:
    """The raw value equals the truth, and the text a reader sees rounds it correctly."""
    assert key in cells.cells, f"{key} is not on the page"
    value, text = cells.cells[key]
    assert value == pytest.approx(expected, rel=rel, abs=1e-12), key
    seen, half_unit = shown_value(text)
    assert abs(seen - expected) <= half_unit * 1.0001 + abs(expected) * rel, f"{key}: shows {text}, truth {expected}"


def assert_loads_cleanly(html_path: Path, charts: set[str], width: int = 1280) -> dict:
    probe = render(html_path, width=width).probe
    assert probe["errors"] == [], probe["errors"]
    assert probe["resources"] == [], "the page fetched resources: " + ", ".join(probe["resources"])
    shown = {img["chart"] for img in probe["images"]}
    assert shown == charts
    for img in probe["images"]:
        assert img["complete"] and img["width"] > 100 and img["height"] > 100, img
        assert img["scheme"] == "data"
    assert probe["page_width"] <= probe["viewport"], "the page scrolls sideways (tables must scroll inside)"
    return probe


# ------------------------------------------------------------------------------------------------
# definitions, written out independently of reports/


def checkpoint_seconds(params: int, trainable: int, method: str, nodes: int) -> float:
    """fp32 trainable weights + Adam moments (4 + 8 bytes) and bf16 frozen weights for full training,
    written by every node at WRITE_GBS in parallel."""
    frozen = params - trainable
    nbytes = trainable * 12 + (frozen * 2 if method == "full" else 0)
    return nbytes / (WRITE_GBS * 1e9 * nodes)


def expected_option(hw_name: str, gpus: int, method: str) -> dict | None:
    """The planner's plan for one option and the job arithmetic from first principles; None if no fit."""
    hw = load_hardware(hw_name)
    per_node = hw.devices_per_node
    nodes, gpn = (1, gpus) if gpus <= per_node else (gpus // per_node, per_node)
    try:
        plan = make_plan(PlanOptions(model=load_model(MODEL), hardware=hw, nodes=nodes, gpus_per_node=gpn,
                                     seq=SEQ, global_batch=BATCH, method=method, tokens=TOKENS, top_k=1))
    except InfeasiblePlan as exc:
        return {"fits": False, "why": str(exc).splitlines()[0]}
    est = plan.chosen.estimate
    train_s = TOKENS / est.throughput.tokens_per_s
    write_s = checkpoint_seconds(est.model.params, est.model.trainable_params, method, nodes)
    job_mtbf_s = MTBF_H * 3600 / nodes
    interval_s = min(math.sqrt(2 * write_s * job_mtbf_s), train_s)  # Young (1974), at most the job
    checkpoints = math.ceil(train_s / interval_s)
    base_s = train_s + checkpoints * write_s
    lost_s = interval_s / 2 + RESTART_S
    wall_s = base_s / (1 - lost_s / job_mtbf_s)  # wall = base + failures x lost, failures = wall / job MTBF
    failures = wall_s / 3600 * nodes / MTBF_H
    assert wall_s == pytest.approx(base_s + failures * lost_s)
    gpu_hours = wall_s / 3600 * gpus
    return {"fits": True, "estimate": est, "layout": plan.chosen.layout, "meets_rule": plan.chosen.meets_compute_rule,
            "nodes": nodes, "train_s": train_s, "interval_s": interval_s, "write_s": write_s,
            "checkpoint_fraction": checkpoints * write_s / train_s, "failures": failures,
            "failure_fraction": failures * lost_s / train_s, "wall_s": wall_s, "gpu_hours": gpu_hours,
            "cost": gpu_hours * PRICES[hw_name], "headroom": 1 - est.memory.peak / est.memory.capacity}


@pytest.fixture(scope="module")
def capacity(tmp_path_factory) -> SimpleNamespace:
    out = tmp_path_factory.mktemp("capacity")
    started = time.perf_counter()
    result = runner.invoke(app, ["report", "capacity", "--model", MODEL, "--tokens", f"{TOKENS:g}",
                                 "--hardware", ",".join(HARDWARE), "--gpus", ",".join(map(str, GPUS)),
                                 "--method", ",".join(METHODS), "--global-batch", str(BATCH), "--seq-len", str(SEQ),
                                 "--price-per-gpu-hour", ",".join(f"{k}={v}" for k, v in PRICES.items()),
                                 "--deadline", "2d", "--out", str(out), "--json"])
    seconds = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    truth = {f"{hw}/{g}/{m}": expected_option(hw, g, m) for hw in HARDWARE for g in GPUS for m in METHODS}
    return SimpleNamespace(out=out, json=json.loads(result.stdout), seconds=seconds, truth=truth,
                           html=(out / "capacity.html").read_text())


# ------------------------------------------------------------------------------------------------
# capacity report


def test_failure_overhead_is_youngs_interval_plus_expected_lost_work() -> None:
    # 8 nodes, 2000 h MTBF per node: the job fails every 900,000 s. A 60 s checkpoint write gives
    # Young's interval sqrt(2 * 60 * 900000) = 10,392.3 s; 100 h of training needs 35 checkpoints
    # (2,100 s); a failure loses 5,196.2 + 600 s; wall = 362,100 / (1 - 5,796.2 / 900,000) = 364,447 s.
    ov = time_to_train(train_s=360_000, write_s=60, nodes=8, mtbf_hours=2000, restart_s=600)
    assert ov.interval_s == pytest.approx(10_392.30, abs=0.01)
    assert ov.checkpoints == 35 and ov.checkpoint_s == 2_100
    assert ov.lost_per_failure_s == pytest.approx(5_796.15, abs=0.01)
    assert ov.wall_s == pytest.approx(364_447.1, abs=0.1)
    assert ov.failures == pytest.approx(ov.wall_s / 3600 * 8 / 2000)
    assert ov.wall_s == pytest.approx(360_000 + ov.checkpoint_s + ov.failures * ov.lost_per_failure_s)
    # a short job checkpoints once, at its end, and never more often than it runs
    short = time_to_train(train_s=100, write_s=60, nodes=1, mtbf_hours=2000, restart_s=600)
    assert short.interval_s == 100 and short.checkpoints == 1


def test_knee_is_the_largest_count_still_within_80_percent_of_linear() -> None:
    def option(gpus: int, tokens_per_s: float, fits: bool = True):
        return SimpleNamespace(hardware="hw", method="full", gpus=gpus, tokens_per_s=tokens_per_s, fits=fits)

    # per-GPU throughput 100, 87.5, 81, 78 -> efficiencies 1, 0.875, 0.81, 0.78: the knee is 256
    curve, = scaling_curves([option(8, 800), option(64, 5600), option(256, 20736), option(512, 39936)])
    assert [round(e, 4) for _, _, e in curve.points] == [1.0, 0.875, 0.81, 0.78]
    assert curve.knee == 256 and not curve.beyond_range
    # a dip below 80% ends the run even if a larger count recovers; a count that does not fit is no baseline
    curve, = scaling_curves([option(1, 0, fits=False), option(8, 800), option(16, 1200), option(32, 3200)])
    assert curve.points[0][0] == 8 and curve.knee == 8
    curve, = scaling_curves([option(8, 800), option(64, 6400)])
    assert curve.knee == 64 and curve.beyond_range


def test_capacity_json_equals_the_planner_for_every_option(capacity) -> None:
    rows = {row["key"]: row for row in capacity.json["options"]}
    assert set(rows) == set(capacity.truth)
    for key, truth in capacity.truth.items():
        row = rows[key]
        assert row["fits"] == truth["fits"], key
        if not truth["fits"]:
            assert row["why_not"] == truth["why"]
            continue
        est = truth["estimate"]
        assert row["layout"] == truth["layout"].short()
        assert row["tokens_per_s"] == pytest.approx(est.throughput.tokens_per_s, rel=1e-12)
        assert row["mfu"] == pytest.approx(est.throughput.mfu, rel=1e-12)
        assert row["step_s"] == pytest.approx(est.time.step_s, rel=1e-12)
        assert row["peak_bytes"] == est.memory.peak and row["capacity_bytes"] == est.memory.capacity
        assert row["meets_compute_rule"] == truth["meets_rule"] and row["nodes"] == truth["nodes"]
        for field, name in (("train_hours", None), ("wall_hours", None), ("gpu_hours", "gpu_hours"),
                            ("cost", "cost"), ("checkpoint_interval_s", "interval_s"),
                            ("checkpoint_write_s", "write_s"), ("checkpoint_overhead", "checkpoint_fraction"),
                            ("expected_failures", "failures"), ("failure_overhead", "failure_fraction"),
                            ("headroom", "headroom")):
            expected = {"train_hours": truth["train_s"] / 3600, "wall_hours": truth["wall_s"] / 3600}.get(field) \
                if name is None else truth[name]
            assert row[field] == pytest.approx(expected, rel=1e-9), f"{key} {field}"
        assert row["meets_deadline"] == (truth["wall_s"] <= DEADLINE_S)
    assert {r["meets_deadline"] for r in rows.values()} == {True, False}  # the deadline separates options


def test_recommendation_follows_its_stated_rule(capacity) -> None:
    # fits, meets the 2-day deadline, the first method given (full): the fastest costing <= 1.25 x the cheapest
    truth = {k: t for k, t in capacity.truth.items() if t["fits"] and t["wall_s"] <= DEADLINE_S and k.endswith("/full")}
    cheapest = min(t["cost"] for t in truth.values())
    affordable = {k: t for k, t in truth.items() if t["cost"] <= 1.25 * cheapest}
    expected = min(affordable, key=lambda k: affordable[k]["wall_s"])
    assert capacity.json["recommended"] == expected
    text = capacity.json["recommendation"]
    hw, gpus, _ = expected.split("/")
    assert text.startswith(f"Train {MODEL} with full fine-tuning on {gpus} x {hw}")
    assert f"${truth[expected]['cost']:,.0f}" in text
    assert capacity.json["main_risk"]  # always named


def test_knees_match_the_definition_on_the_planners_throughput(capacity) -> None:
    for curve in capacity.json["scaling"]:
        fitting = sorted((int(k.split("/")[1]), t["estimate"].throughput.tokens_per_s)
                         for k, t in capacity.truth.items()
                         if t["fits"] and k.startswith(curve["hardware"] + "/") and k.endswith("/" + curve["method"]))
        base = fitting[0][1] / fitting[0][0]
        knee = None
        for gpus, tps in fitting:
            if tps / gpus / base < 0.8:
                break
            knee = gpus
        assert curve["knee_gpus"] == knee
        for point, (gpus, tps) in zip(curve["points"], fitting):
            assert point["gpus"] == gpus and point["efficiency"] == pytest.approx(tps / gpus / base, rel=1e-12)


def test_capacity_page_loads_in_chromium_with_every_chart_and_the_planners_figures(capacity) -> None:
    assert_loads_cleanly(capacity.out / "capacity.html", CAPACITY_CHARTS)
    cells = page_cells(capacity.html)
    checked = 0
    for key, t in capacity.truth.items():
        if not t["fits"]:
            assert f"{key}:wall_days" not in cells.cells
            continue
        est = t["estimate"]
        for field, expected in (("wall_days", t["wall_s"] / 86400), ("gpu_hours", t["gpu_hours"]), ("cost", t["cost"]),
                                ("tokens_per_s", est.throughput.tokens_per_s), ("mfu", est.throughput.mfu),
                                ("peak_gib", est.memory.peak / GiB), ("headroom", t["headroom"]),
                                ("checkpoint_overhead", t["checkpoint_fraction"]), ("failures", t["failures"]),
                                ("failure_overhead", t["failure_fraction"])):
            assert_shown(cells, f"{key}:{field}", expected)
            checked += 1
    assert checked == 10 * len(capacity.truth)
    assert_shown(cells, f"{capacity.json['recommended']}:wall_hours",
                 capacity.truth[capacity.json["recommended"]]["wall_s"] / 3600)
    # the knee is defined on the page, and the recommendation leads it
    assert "stays at or above 80%" in capacity.html
    assert capacity.html.index('id="recommendation"') < capacity.html.index('id="options"')


def test_capacity_markdown_twin_and_png_charts_match_the_page(capacity) -> None:
    md = (capacity.out / "capacity.md").read_text()
    cells = page_cells(capacity.html)
    for name in CAPACITY_CHARTS:
        png = (capacity.out / "charts" / f"{name}.png").read_bytes()
        assert png.startswith(PNG_MAGIC)
        assert f"](charts/{name}.png)" in md
        assert cells.charts[name] == "data:image/png;base64," + base64.b64encode(png).decode()
    assert capacity.json["recommendation"] in md
    for key, (_, text) in cells.cells.items():  # every figure of the page's tables is in the twin
        assert f"| {text} |" in md, key


def test_capacity_report_plans_each_option_once_and_in_bounded_time(capacity) -> None:
    # 8 planning runs (~2 s) and 5 charts (~3 s with the matplotlib import) on an idle 2-core CPU;
    # the bound only catches pathologies on a shared, loaded machine
    assert capacity.seconds < 60, capacity.seconds
    assert len(capacity.json["options"]) == len(HARDWARE) * len(GPUS) * len(METHODS)


# Runs the command in a fresh process (pytest's own has torch loaded, where the report must not fork),
# with `plan_option` wrapped to write the id of the process that plans each option; each option
# holds its worker a little, so that both workers of the pool take one
_PLANNING_PROCESSES = """
import os, sys, time
import reports.capacity as capacity
from advisor.cli import app

planned = capacity.plan_option


def recorded(*args):
    with open(sys.argv[1], "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(0.3)
    return planned(*args)


capacity.plan_option = recorded
print(os.getpid())
app(sys.argv[2:])
"""


@pytest.mark.parametrize("jobs", [1, 2])
def test_capacity_jobs_plans_in_that_many_processes(jobs, tmp_path) -> None:
    """`--jobs N` plans the options in N worker processes, `--jobs 1` in the command's own (issue 30: it
    ran in one process, silently, while the planner loaded torch)."""
    log = tmp_path / "pids.txt"
    done = subprocess.run([sys.executable, "-c", _PLANNING_PROCESSES, str(log), "report", "capacity", "--model",
                           "llama3-8b", "--tokens", "1e10", "--hardware", "h100-80g", "--gpus", "8,16",
                           "--out", str(tmp_path / "cap"), "--jobs", str(jobs)],
                          capture_output=True, text=True, timeout=300, env=os.environ)
    assert done.returncode == 0, done.stderr[-2000:]
    command = int(done.stdout.splitlines()[0])
    planners = [int(line) for line in log.read_text().split()]
    # four options (8 and 16 GPUs, full and LoRA), then the command itself prices the recommended
    # one as Megatron-LM runs it
    assert len(planners) == 5 and planners[-1] == command
    options = planners[:-1]
    assert (set(options) == {command}) if jobs == 1 else (len(set(options)) == jobs and command not in options)


def test_options_that_do_not_fit_are_listed_with_the_planners_reason_and_fixes(tmp_path) -> None:
    # a 60 MiB "device" with no host RAM to offload to: demo-tiny's full model states (16 bytes x
    # 3.95 M parameters) do not fit one, LoRA does, and two devices fit full fine-tuning
    small = {**preset_data("hardware", "cpu"), "name": "small-cpu", "memory_gib": 0.06, "reserved_gib": 0.0,
             "host_memory_gib": 0.05}
    hw_file = tmp_path / "small-cpu.yaml"
    hw_file.write_text(yaml.safe_dump(small))
    result = runner.invoke(app, ["report", "capacity", "--model", "demo-tiny", "--tokens", "1e7", "--hardware",
                                 str(hw_file), "--gpus", "1,2", "--seq-len", "512", "--global-batch", "8",
                                 "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["key"]: row for row in json.loads(result.stdout)["options"]}
    with pytest.raises(InfeasiblePlan) as refusal:
        make_plan(PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware(str(hw_file)), nodes=1,
                              gpus_per_node=1, seq=512, global_batch=8, method="full", tokens=1e7, top_k=1))
    why, *fixes = str(refusal.value).splitlines()
    refused = rows["small-cpu/1/full"]
    assert not refused["fits"] and refused["why_not"] == why
    assert refused["fixes"] == [line.strip()[2:] for line in fixes if line.strip().startswith("- ")]
    assert any(f.startswith("--method lora: fits") for f in refused["fixes"])
    assert all(rows[k]["fits"] for k in ("small-cpu/1/lora", "small-cpu/2/full", "small-cpu/2/lora"))
    page = (tmp_path / "out" / "capacity.html").read_text()
    refused_table = page[page.index('id="refused"'):]
    assert html.escape(why) in refused_table and "--method lora: fits" in refused_table
    assert "small-cpu/1/full:wall_days" not in page  # no figures for an option that does not fit
    # one-GPU LoRA is the baseline of the LoRA scaling curve; full fine-tuning's starts at two
    curves = {c["method"]: c for c in json.loads(result.stdout)["scaling"]}
    assert curves["full"]["points"][0]["gpus"] == 2 and curves["lora"]["points"][0]["gpus"] == 1


@pytest.mark.parametrize("args, message", [
    (["--model", "llama2-7b"], "exactly one of --tokens N or --task"),
    (["--model", "llama2-7b", "--tokens", "1e9", "--gpus", "8,x"], "--gpus takes comma-separated integers"),
    (["--model", "llama2-7b", "--tokens", "1e9", "--method", "full,sgd"], "--method takes full, lora or qlora"),
    (["--model", "llama2-7b", "--tokens", "1e9", "--price-per-gpu-hour", "cheap"], "cannot read --price-per-gpu-hour"),
    (["--model", "llama2-7b", "--tokens", "1e9", "--deadline", "soon"], "cannot read duration"),
])
def test_capacity_usage_errors_are_one_line_with_exit_2(args, message, tmp_path) -> None:
    result = runner.invoke(app, ["report", "capacity", *args, "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------
# run report


STAGE_STEPS = 6
PREDICTED = {"peak_bytes": 3 * GiB, "step_s": 0.5, "tokens_per_s": 8192.0}
MEASURED = {"peak_bytes": 3.6 * GiB, "step_s": 0.625, "tokens_per_s": 6553.6,
            "peak_source": "torch.cuda.max_memory_allocated"}
EVALS = {"language": {"language": 3.1}, "reasoning": {"language": 3.2, "reasoning": 2.5},
         "instructions": {"language": 3.4, "reasoning": 2.6, "instructions": 2.0},
         "mixed": {"language": 3.3, "reasoning": 2.45, "instructions": 1.9}}
SPIKE_STEP, ROLLBACK_TO = 9, 6  # a spike in the second stage, rolled back to the checkpoint at step 6


def write_run_dir(run_dir: Path) -> dict:
    """A run dir by the contract: plan.yaml from the planner, and metrics, events, checkpoints and a
    summary whose every number is known. Returns the truth per stage."""
    plan = make_plan(PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("cpu"), task=load_task("demo")))
    plan.write(run_dir / "plan.yaml")
    truth: dict[str, dict] = {}
    metrics, events, step = [], [], 0
    events.append({"event": "checkpoint", "step": 0, "stage": "language", "path": "checkpoints/step_00000000",
                   "reason": "start"})
    for index, stage in enumerate(plan.task.stages):
        events.append({"event": "stage_start", "stage": stage.name, "step": step, "steps": STAGE_STEPS})
        rows = []
        for i in range(STAGE_STEPS):
            step += 1
            loss = 6.0 / (1 + 0.3 * step) + 0.05 * index
            lr = stage.lr * min(1.0, (i + 1) / 3) * (1 - 0.1 * i)
            rows.append({"step": step, "stage": stage.name, "loss": loss, "lr": lr, "grad_norm": 1.0 + 0.1 * i,
                         "tokens_per_s": 6000.0 + 100 * i, "step_s": 0.6 + 0.01 * i})
            if i == 2:
                events.append({"event": "checkpoint", "step": step, "stage": stage.name,
                               "path": f"checkpoints/step_{step:08d}", "reason": "interval"})
            if step == SPIKE_STEP - 1:
                events.append({"event": "spike", "step": SPIKE_STEP, "stage": stage.name, "loss": 11.5,
                               "grad_norm": 40.0, "reason": "loss 11.5 > 4 sigma above the running mean"})
                events.append({"event": "rollback", "to": f"step_{ROLLBACK_TO:08d}", "step": ROLLBACK_TO,
                               "skipped": [1, 64, 80], "lr_scale": 0.5})
        metrics += rows
        events.append({"event": "eval", "stage": stage.name, "step": step, "losses": EVALS[stage.name]})
        events.append({"event": "stage_end", "stage": stage.name, "step": step})
        events.append({"event": "checkpoint", "step": step, "stage": stage.name,
                       "path": f"checkpoints/step_{step:08d}", "reason": "stage_end"})
        truth[stage.name] = {"steps": STAGE_STEPS, "planned": plan.stages[index].steps,
                             "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"],
                             "min_loss": min(r["loss"] for r in rows), "peak_lr": max(r["lr"] for r in rows),
                             "final_lr": rows[-1]["lr"],
                             "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                             "checkpoints": 2 if index else 3}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for kept in (step - STAGE_STEPS + 3, step):  # the trainer keeps the newest few
        folder = run_dir / "checkpoints" / f"step_{kept:08d}"
        folder.mkdir(parents=True)
        (folder / "state.pt").write_bytes(b"\0" * (3 * 2**20))
    summary = {"predicted": PREDICTED, "measured": MEASURED, "steps": step, "rollbacks": 1, "finished": True,
               "stages": [{"name": s.name, "steps": STAGE_STEPS, "final_loss": truth[s.name]["final_loss"],
                           "eval": EVALS[s.name]} for s in plan.task.stages]}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return truth


def test_run_report_shows_predicted_against_measured_stages_spikes_checkpoints_and_evals(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    truth = write_run_dir(run_dir)
    result = runner.invoke(app, ["report", "run", str(run_dir)])
    assert result.exit_code == 0, result.output
    html_path = run_dir / "report" / "run.html"
    assert_loads_cleanly(html_path, RUN_CHARTS, width=390)
    cells = page_cells(html_path.read_text())

    for key in ("peak_bytes", "step_s", "tokens_per_s"):
        scale = GiB if key == "peak_bytes" else 1
        assert_shown(cells, f"predicted:{key}", PREDICTED[key] / scale)
        assert_shown(cells, f"measured:{key}", MEASURED[key] / scale)
        assert_shown(cells, f"ratio:{key}", MEASURED[key] / PREDICTED[key])
    # 3.6 / 3 GiB = 1.2; 0.625 / 0.5 s = 1.25; 6553.6 / 8192 = 0.8
    assert cells.cells["ratio:peak_bytes"][1] == "1.20" and cells.cells["ratio:tokens_per_s"][1] == "0.800"

    spike_stage = "reasoning"  # step 9 is the third step of the second stage
    for name, t in truth.items():
        k = f"stage:{name}"
        for field in ("first_loss", "final_loss", "min_loss", "peak_lr", "final_lr", "tokens_per_s"):
            assert_shown(cells, f"{k}:{field}", t[field])
        assert_shown(cells, f"{k}:steps", t["steps"])
        assert_shown(cells, f"{k}:planned_steps", t["planned"])
        assert_shown(cells, f"{k}:checkpoints", t["checkpoints"])
        assert_shown(cells, f"{k}:spikes", 1 if name == spike_stage else 0)
        assert_shown(cells, f"{k}:rollbacks", 1 if name == spike_stage else 0)
    for after, losses in EVALS.items():
        for skill, loss in losses.items():
            assert_shown(cells, f"eval:{after}:{skill}", loss)
    page = html_path.read_text()
    # forgetting: language ends 6% above its best eval loss (more than the 2% noise allowance); the others do not
    assert "language: eval loss rose from 3.10 (after language) to 3.30 (after mixed): forgetting" in page
    assert "reasoning: eval loss rose" not in page
    assert "instructions" in page and "dp=" in page  # the plan that ran, with its layout
    assert (run_dir / "report" / "run.md").read_text().count("](charts/") == len(RUN_CHARTS)
    # each skill's story in loss: after its stage, worst before the mixed stage (instructions), the end
    for skill, (own, worst, end) in {"language": (3.1, 3.4, 3.3), "reasoning": (2.5, 2.6, 2.45)}.items():
        for key, value in (("own", own), ("worst", worst), ("end", end), ("forgetting", worst - own),
                           ("healed", worst - end)):
            assert_shown(cells, f"story:{skill}:{key}:loss", value)


def test_run_report_tells_each_skills_story_in_exact_match_with_a_chart(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_run_dir(run_dir)
    # reasoning: 60% after its stage, 10% after instructions, 55% after the mixed stage
    exact = {"reasoning": {"reasoning": 0.6}, "instructions": {"reasoning": 0.1, "instructions": 0.8},
             "mixed": {"reasoning": 0.55, "instructions": 0.75}}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    for event in events:
        if event["event"] == "eval" and event["stage"] in exact:
            event["exact_match"] = exact[event["stage"]]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    result = runner.invoke(app, ["report", "run", str(run_dir)])
    assert result.exit_code == 0, result.output
    cells = page_cells((run_dir / "report" / "run.html").read_text())
    for key, value in (("own", 0.6), ("worst", 0.1), ("end", 0.55), ("forgetting", 0.5), ("healed", 0.45)):
        assert_shown(cells, f"story:reasoning:{key}:exact", value)
    # trained last before the mixed stage: nothing between to forget it, nothing to heal
    assert_shown(cells, "story:instructions:own:exact", 0.8)
    assert_shown(cells, "story:instructions:end:exact", 0.75)
    assert "story:instructions:worst:exact" not in cells.cells and "story:instructions:healed:exact" not in cells.cells
    assert (run_dir / "report" / "charts" / "exact-match.png").read_bytes()[:4] == b"\x89PNG"


def test_run_report_tolerates_a_crashed_run_with_only_metrics(tmp_path) -> None:
    run_dir = tmp_path / "crashed"
    run_dir.mkdir()
    rows = [{"step": s, "stage": "only", "loss": 5.0 - 0.1 * s, "lr": 1e-3, "step_s": t, "tokens_per_s": 4096 / t}
            for s, t in zip(range(1, 6), (0.5, 0.4, 0.45, 0.7, 0.42))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "sta')
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", "run", str(run_dir), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    step = next(c for c in data["comparisons"] if c["name"] == "step_s")
    assert step["measured"] == statistics.median([0.5, 0.4, 0.45, 0.7, 0.42]) and step["predicted"] is None
    assert data["finished"] is None and data["stages"][0]["steps"] == 5
    page = (out / "run.html").read_text()
    assert "metrics.jsonl: skipped 1 unreadable line" in page
    assert "No plan.yaml" in page and "No evaluation results" in page
    charts = set(re.findall(r'data-chart="(\w+)"', page))
    assert charts == {"predicted_measured", "loss", "lr"}


def test_run_report_refuses_a_folder_that_is_not_a_run_dir(tmp_path) -> None:
    result = runner.invoke(app, ["report", "run", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not a run dir" in result.stderr and "Traceback" not in result.stderr
    missing = runner.invoke(app, ["report", "run", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "run dir not found" in missing.stderr


def test_plan_file_in_the_run_dir_is_the_one_reported(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_run_dir(run_dir)
    plan = yaml.safe_load((run_dir / "plan.yaml").read_text())
    result = runner.invoke(app, ["report", "run", str(run_dir), "--out", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    page = (tmp_path / "r" / "run.html").read_text()
    layout = plan["chosen"]["layout"]
    assert f"dp={layout['dp']},tp={layout['tp']},pp={layout['pp']}" in page


def test_run_report_shows_the_verification_trials_and_the_profile_refit(tmp_path) -> None:
    """`advisor run` leaves verify.json and feedback.json: the report shows each trial's predicted
    and measured step with its error, the decision, and the factors and errors of the refit."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "stage": "a", "loss": 5.0, "step_s": 1.0}) + "\n")
    trials = [{"rank": 1, "layout": "dp=2,zero=1,mbs=8", "predicted_step_s": 1.2, "measured_step_s": 1.5,
               "measured_tokens_per_s": 2730.0, "harness": "fork", "step_error": 1.2 / 1.5 - 1},
              {"rank": 2, "layout": "dp=2,zero=2,mbs=8", "predicted_step_s": 1.25, "measured_step_s": 1.3,
               "measured_tokens_per_s": 3150.0, "harness": "fork", "step_error": 1.25 / 1.3 - 1}]
    (run_dir / "verify.json").write_text(json.dumps({"chosen_rank": 2, "reason": "rank 2 measured 15% faster",
                                                     "steps": 4, "trials": trials}))
    (run_dir / "feedback.json").write_text(json.dumps({
        "profile": "p.json", "added": 3, "used": 9, "factors_before": {"gemm": 0.7, "node_contention": 0.1},
        "factors_after": {"gemm": 0.65, "node_contention": 0.2}, "error_before": 0.12, "error_after": 0.05,
        "new_error_before": 0.2}))
    out = tmp_path / "report"
    result = runner.invoke(app, ["report", "run", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    page = (out / "run.html").read_text()
    values = dict(re.findall(r'data-key="(verify:[^"]+)" data-value="([^"]+)"', page))
    assert float(values["verify:1:measured_step_s"]) == 1.5 and float(values["verify:2:predicted_step_s"]) == 1.25
    assert "dp=2,zero=2,mbs=8</code> (trained)" in page or "dp=2,zero=2,mbs=8` (trained)" in page
    assert "-20.0%" in page and "rank 2 measured 15% faster" in page
    markdown = (out / "run.md").read_text()
    assert "| node_contention | 0.100 | 0.200 |" in markdown
    assert "after the refit: 5.0%" in markdown and "predicted before the run: 20.0%" in markdown
