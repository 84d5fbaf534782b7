"""Honest presets and a readable plan (issue 32): a plan priced on a preset quotes how far that
preset was off where it was checked, recomputed here from the checks themselves; the plan table
keeps every layout key that differs from its default at 80 columns; "bound by" names a term that
is really in the step."""

from __future__ import annotations

import re
import statistics

import pytest
from rich.console import Console

import advisor.cli.render as render
from bench.published_bench import price
from bench.published_runs import ROWS
from planner.explain import binding_constraint
from planner.plan import PlanOptions, make_plan
from presets import load_hardware, load_model, preset_names
from test_h200_evidence import _priced as priced_h200
from test_h200_evidence import evidence_rows


def _record(errors: list[float]) -> tuple[int, float, float]:
    return len(errors), statistics.median(abs(e) for e in errors), max(errors, key=abs)


def _published_errors(gpu: str) -> list[float]:
    return [p.error for p in map(price, (r for r in ROWS if r.gpu == gpu)) if p.error is not None]


def _h200_errors() -> list[float]:  # throughput error: measured step / priced step - 1
    return [step / priced_h200(layout).time.step_s - 1 for _, layout, step, _ in evidence_rows()]


@pytest.mark.parametrize("name", ["a100-40g", "a100-80g", "h100-80g", "h200-141g"])
def test_a_presets_record_is_what_its_checks_measure_today(name: str) -> None:
    """The figures a plan quotes are recomputed from the published runs (or the H200 evidence): a
    change of the cost model that moves them fails here until the preset says so."""
    check = load_hardware(name).checked
    assert check is not None
    rows, median, worst = _record(_h200_errors() if name == "h200-141g" else _published_errors(name))
    assert check.rows == rows
    assert check.median_abs_error == pytest.approx(median, abs=5e-4)
    assert check.worst_error == pytest.approx(worst, abs=5e-4)


def test_presets_no_run_checked_say_so_and_a_profile_says_nothing() -> None:
    unchecked = [n for n in preset_names("hardware") if load_hardware(n).checked is None]
    assert set(unchecked) == {"cpu", "l40s-48g", "rtx4090-24g"}
    model = load_model("llama3-8b")
    on_preset = make_plan(PlanOptions(model=model, hardware=load_hardware("rtx4090-24g"), gpus_per_node=1,
                                      method="qlora"))
    assert any("rtx4090-24g preset" in n and "never been checked" in n and "advisor profile" in n
               for n in on_preset.notes)
    checked = make_plan(PlanOptions(model=model, hardware=load_hardware("h100-80g"), gpus_per_node=8))
    note = next(n for n in checked.notes if "h100-80g preset" in n)
    assert "15 published training runs" in note and "off by 10% at the median and +32% at worst" in note
    profiled = load_hardware("h100-80g").model_copy(update={"source": "/tmp/profile.json"})
    assert not [n for n in make_plan(PlanOptions(model=model, hardware=profiled, gpus_per_node=8)).notes
                if "preset" in n]


def test_the_plan_table_keeps_every_non_default_layout_key_at_80_columns(monkeypatch) -> None:
    plan = make_plan(PlanOptions(model=load_model("llama3-70b"), hardware=load_hardware("h100-80g"), nodes=4))
    narrow = Console(width=80, record=True)
    monkeypatch.setattr(render, "console", narrow)
    render.render_plan(plan)
    text = narrow.export_text()
    assert max(map(len, text.splitlines())) <= 80
    table = text.split("why #1")[0]
    rows = [line.split("│") for line in table.splitlines() if line.startswith("│")]
    cells = "".join(row[2] for row in rows).replace(" ", "")  # the layout column, its wrapped lines joined
    for planned in [plan.chosen, *plan.alternatives]:
        keys = [kv for kv in planned.layout.short().split(",")
                if kv not in ("tp=1", "pp=1", "zero=0", "recompute=none") and not kv.startswith(("dtype=", "seq="))]
        assert all(kv in cells for kv in ("mbs=", "gas=", "dp=")) and all(kv in cells for kv in keys)
    assert f"seq={plan.chosen.layout.seq}" in text.splitlines()[0]


def test_bound_by_names_a_term_that_is_in_the_step() -> None:
    """A layout whose step is all compute was "bound by communication (0% of the step)"."""
    plan = make_plan(PlanOptions(model=load_model("llama3-8b"), hardware=load_hardware("h100-80g"), gpus_per_node=8))
    for planned in [plan.chosen, *plan.alternatives]:
        est = planned.estimate
        said = binding_constraint(est, est.memory.capacity, plan.min_compute_fraction)
        share = re.search(r"\((\d+)% of the step\)", said)
        if share:  # a named overhead: it is at least 1% of the step
            assert int(share.group(1)) >= 1, said
        else:
            assert said.startswith(("memory", "compute", "the compute rule")), said
    host_bound = plan.chosen.estimate.model_copy(deep=True)
    host_bound.time.step_s = host_bound.time.compute_s * 2  # half the step is unaccounted host time
    assert binding_constraint(host_bound, 1e30, 0.0).startswith("host and launch overhead (50%")
