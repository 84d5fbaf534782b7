"""The stage ILP's solver back-ends (PuLP with HiGHS in process, PuLP's bundled CBC as the fallback)
against brute force, and the search's enumeration at command-line sizes no loop over 1..n survives."""

import dataclasses
import itertools
import json
import math
import os
import resource
import subprocess
import sys

import pytest

from specs.errors import UsageError
from specs.capabilities import config_shape
from specs.core import Layout, ModelSpec
from planner import search
from planner.cost_model import estimate_from_trace
from planner.cost_model import model_shape
from planner.search import PlanRequest, SearchSpace, StageProgram, _all_coefficients, _divisors
from profiler.model_trace import trace_model
from test_plan_search import SEQ, TINY, compositions, hardware


def best_split(trace, shape: Layout, hw) -> float | None:
    """The least step of any layer split and per-stage recompute counts that fits: brute force."""
    best = None
    for split in compositions(trace.num_layers, shape.pp):
        for recomputed in itertools.product(*[range(n + 1) for n in split]):
            layout = shape.model_copy(update={"stage_layers": split, "recompute_layers": list(recomputed)})
            try:
                est = estimate_from_trace(trace, layout, hw)
            except UsageError:
                continue
            if est.memory.peak <= hw.usable_bytes and (best is None or est.time.step_s < best):
                best = est.time.step_s
    return best


@pytest.mark.parametrize("backend", ["highs", "cbc"])
@pytest.mark.parametrize("memory_share", [1.0, 0.7])
def test_each_backend_solves_the_stage_ilp_to_the_brute_force_optimum(backend, memory_share, monkeypatch) -> None:
    if backend == "cbc":  # as on a machine where highspy does not import
        monkeypatch.setattr(search, "_has_highspy", lambda: False)
    import pulp

    assert isinstance(search._solver(True), pulp.HiGHS if backend == "highs" else pulp.PULP_CBC_CMD)
    trace = trace_model(TINY, SEQ, "bf16", attention="eager", device_type="cuda")
    shape = Layout(pp=2, gas=4, recompute="full", dtype="bf16", seq=SEQ)
    keep_all = shape.model_copy(update={"stage_layers": [2, 2], "recompute_layers": [0, 0]})
    hw = hardware(estimate_from_trace(trace, keep_all, hardware(1e6)).memory.peak * memory_share / 2**20)
    truth = best_split(trace, shape, hw)
    assert truth is not None
    program = StageProgram(_all_coefficients(trace, shape, hw), shape, trace.num_layers, hw.usable_bytes, 0.0)
    assert program.relaxed_step_s() <= truth * (1 + 1e-9)  # the relaxation bounds every split
    chosen = program.solve()
    assert estimate_from_trace(trace, chosen, hw).time.step_s == pytest.approx(truth, rel=1e-9)
    assert any(chosen.recompute_layers or []) == (memory_share < 1)  # 0.7: only splits that recompute fit
    assert program.solve(cutoff=truth * 0.9) is None  # nothing beats the optimum (by more than tolerances)


def test_planning_prints_only_its_json() -> None:
    """highspy's first solver object prints HiGHS's banner on file descriptor 1: the search mutes it
    (a fresh process, since the banner comes once per process)."""
    code = ("from planner.search import _has_highspy\nimport highspy, json\n"
            "assert _has_highspy()\nhighspy.Highs()\nprint(json.dumps({'clean': True}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout) == {"clean": True}


def test_divisors_up_to_a_bound() -> None:
    for n in range(1, 200):
        for most in (1, 6, 64, 500):
            assert _divisors(n, most) == [d for d in range(1, n + 1) if n % d == 0 and d <= most]
    # 10**18 = 2**18 * 5**18: its divisors up to 64, found without a loop to 10**18
    assert _divisors(10**18, 64) == [1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64]


@pytest.mark.parametrize("sizes, code", [(["--global-batch", str(10**12)], 2),
                                         (["--nodes", str(1 << 17), "--global-batch", str(10**12)], 2)])
def test_plan_at_huge_batch_or_cluster_finishes(sizes, code) -> None:
    """Enumerating every integer up to the batch (or the device count) took hours here. On 8 GPUs no
    layout holds 10**12 sequences (at most 2**20 micro-steps of 64 each): one line, exit 2; on the
    largest cluster a node count may name (2**17 nodes, 2**20 GPUs) the search runs and finds that
    demo-tiny's few heads and layers cannot take the tp x pp >= 256 that 10**12's factor 2**12 leaves
    (exit 2, the planner's nearest changes)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "advisor.cli", "plan", "--model", "demo-tiny", "--hardware",
                           "h100-80g", *sizes], capture_output=True, text=True, timeout=120, env=os.environ)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime  # wall time is the load's
    assert done.returncode == code, done.stderr
    assert "internal error" not in done.stderr and "Traceback" not in done.stderr
    if code == 0:
        assert "solver:" in done.stdout
    elif "--nodes" not in sizes:
        assert len(done.stderr.strip().splitlines()) == 1 and "--global-batch" in done.stderr
    assert cpu_s <= 10, f"{cpu_s:.1f} s of CPU"


def test_the_lp_relaxation_is_the_same_through_highspy_and_through_scipy(monkeypatch) -> None:
    """The search's LP bound, solved by highspy on the matrix itself, equals scipy's `linprog` on the
    same program (the fallback where highspy does not import), fitting or not."""
    trace = trace_model(TINY, SEQ, "bf16", attention="eager", device_type="cuda")
    shape = Layout(pp=2, gas=4, recompute="full", dtype="bf16", seq=SEQ)
    keep_all = shape.model_copy(update={"stage_layers": [2, 2], "recompute_layers": [0, 0]})
    peak = estimate_from_trace(trace, keep_all, hardware(1e6)).memory.peak
    values = {}
    for share in (1.0, 0.7, 0.05):  # 0.05: nothing fits
        hw = hardware(peak * share / 2**20)
        program = StageProgram(_all_coefficients(trace, shape, hw), shape, trace.num_layers, hw.usable_bytes, 0.0)
        values[share] = program.relaxed_step_s()
        assert program._relaxation_by_scipy() is None if share == 0.05 else (
            float(program.objective @ program._relaxation_by_scipy()) + program.step_constant
            == pytest.approx(values[share], rel=1e-9))
    assert values[0.05] == float("inf") and values[1.0] <= values[0.7] < float("inf")


@pytest.mark.parametrize("pp, memory_share", [(2, 1.0), (3, 1.0), (2, 0.7)])
def test_the_search_bounds_hold_for_every_split(pp, memory_share) -> None:
    """`spread_bound` (the shape's step before its LP) is at most the LP's optimum and the brute-force
    optimum, and where memory forces the first stage to recompute (0.7 of the peak), its slot is
    above the one without the memory rows; the least busy stage's compute share the strict pass refuses by is at least the
    best any split reaches (brute force), and, 4 layers on 3 stages, tighter than the mean stage's."""
    trace = trace_model(TINY, SEQ, "bf16", attention="eager", device_type="cuda")
    shape = Layout(pp=pp, gas=4, recompute="full", dtype="bf16", seq=SEQ)
    even = shape.model_copy(update={"stage_layers": [4 // pp] * pp if pp == 2 else [2, 1, 1],
                                    "recompute_layers": [0] * pp})
    peak = estimate_from_trace(trace, even, hardware(1e6)).memory.peak
    hw = hardware(peak * memory_share / 2**20 if memory_share < 1 else 1e6)
    bound = search.lower_bound(trace, shape, hw, hw.usable_bytes)
    program = StageProgram(bound.coefficients, shape, trace.num_layers, hw.usable_bytes, 0.0)
    truth = best_split(trace, shape, hw)
    spread = search.spread_bound(bound.coefficients, shape, trace.num_layers, hw.usable_bytes)
    assert spread <= program.relaxed_step_s() * (1 + 1e-9) and spread <= truth * (1 + 1e-9)
    least_slot = search._least_slot(bound.coefficients, shape, trace.num_layers, hw.usable_bytes)
    unbounded_memory = search._least_slot(bound.coefficients, shape, trace.num_layers, math.inf)
    assert least_slot > unbounded_memory if memory_share < 1 else least_slot == unbounded_memory
    if memory_share < 1:
        return  # the compute shares below need every split to fit without recomputing
    best_share = max(estimate_from_trace(trace, shape.model_copy(update={
        "stage_layers": split, "recompute_layers": [0] * pp}), hw).compute_fraction
        for split in compositions(trace.num_layers, pp))
    assert search.may_meet_compute_rule(bound, shape, trace.num_layers, best_share)
    least_busy = shape.gas * search._least_busy_compute(bound.coefficients, shape, trace.num_layers) / bound.step_s
    assert best_share <= least_busy * (1 + 1e-9)
    if pp == 3:  # the stage with the fewest layers holds 1, the mean 4/3
        assert least_busy < bound.max_compute_fraction
        assert not search.may_meet_compute_rule(bound, shape, trace.num_layers, least_busy * 1.01)


GPT2_TIED = ModelSpec(name="tiny-gpt2", hf_config={  # no n_inner (4 x n_embd), head tied by GPT-2's default
    "model_type": "gpt2", "n_embd": 48, "n_layer": 3, "n_head": 6, "n_positions": 256, "vocab_size": 256,
    "bos_token_id": 0, "eos_token_id": 0})


@pytest.mark.parametrize("model", [TINY, GPT2_TIED], ids=lambda m: m.name)
def test_the_trainers_shape_of_a_config_is_the_traced_one(model) -> None:
    """`config_shape` (what the trainer's checks read) gives the shape of the trace the planner
    enumerates from: GPT-2's MLP width 4 x n_embd, not 4 x a missing hidden_size, and a head that
    the config leaves to its class (GPT-2 ties by default) read as tied, as the trace counts it."""
    traced = model_shape(trace_model(model, SEQ, "bf16", attention="eager", device_type="cuda"))
    assert "tie_word_embeddings" not in model.hf_config
    assert config_shape(model.hf_config) == traced
    assert traced.tied_embeddings == (model is GPT2_TIED)


@pytest.mark.parametrize("model", [TINY, GPT2_TIED], ids=lambda m: m.name)
def test_a_request_without_layouts_is_known_before_any_trace(model) -> None:
    """`plan_layouts` skips the trace where `may_have_shapes` says no layout exists: it must never
    say so where the traced enumeration finds one, over device counts, batches, the two spaces and
    a fixed pp; and it must say so for the requests with none (the test's teeth)."""
    trace = trace_model(model, SEQ, "bf16", attention="eager", device_type="cuda")
    nones = 0
    for devices, batch, runnable_only, fixed in itertools.product(
            (1, 2, 3, 4, 6, 8, 12, 64, 4096), (1, 6, 7, 64, 2**26 + 2), (True, False), ({}, {"pp": 3})):
        req = PlanRequest(model=model, hardware=hardware(1e6), devices=devices, seq=SEQ, global_batch=batch,
                          dtype="bf16", space=SearchSpace(runnable_only=runnable_only, fixed=fixed))
        found = bool(search.enumerate_shapes(trace, req, "full"))
        assert search.may_have_shapes(req, "full") or not found, (devices, batch, runnable_only, fixed)
        nones += not search.may_have_shapes(req, "full")
    assert nones >= 40


def test_planning_a_request_no_layout_splits_traces_nothing(monkeypatch) -> None:
    """No layout of 2**20 devices splits a 10**12 batch of demo-tiny: the plan says why, in a line
    naming the rules, without the six cold traces (method, sequence length) it took before."""
    from planner.plan import InfeasiblePlan, PlanOptions, make_plan
    from presets import load_hardware, load_model

    monkeypatch.setattr(search, "trace_model", lambda *a, **k: pytest.fail("traced a request with no layout"))
    opts = PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("h100-80g"), nodes=2**17,
                       global_batch=10**12)
    with pytest.raises(InfeasiblePlan, match="has no layout on 1,048,576 x h100-80g .* tp divides the attention"):
        make_plan(opts)
