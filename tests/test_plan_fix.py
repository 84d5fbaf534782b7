"""`advisor plan --fix` and `--any-engine`: fixed keys hold, refusals name the binding rule, and a
plan for other engines says so and is refused by `advisor train`."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specs.capabilities import config_shape, runnable_problem
from advisor.cli import app
from specs.plan_file import load_plan
from specs.core import Layout
from planner.plan import PlanOptions, make_plan
from planner.search import SearchSpace
from presets import load_hardware, load_model

runner = CliRunner()
LLAMA8 = ["--model", "llama3-8b", "--hardware", "h100-80g", "--seq-len", "4096", "--global-batch", "512"]


def plan(*args: str):
    return runner.invoke(app, ["plan", *args])


def test_fixed_keys_hold_and_the_rest_is_the_best_of_the_restricted_space() -> None:
    result = plan(*LLAMA8, "--fix", "tp=2,zero=1", "--top", "3", "--json")
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)["plans"]
    assert plans and all(p["layout"]["tp"] == 2 and p["layout"]["zero"] == 1 for p in plans)
    # independent truth: the same search over a space that only has tp=2 and ZeRO-1
    restricted = make_plan(PlanOptions(model=load_model("llama3-8b"), hardware=load_hardware("h100-80g"), seq=4096,
                                       global_batch=512, top_k=1,
                                       space=SearchSpace(tp_degrees=(2,), zero_stages=(1,))))
    assert plans[0]["layout"] == restricted.chosen.layout.model_dump(mode="json")


def test_fixing_method_and_dtype_sets_the_request() -> None:
    result = plan("--model", "llama2-7b", "--hardware", "rtx4090-24g", "--gpus-per-node", "1",
                  "--fix", "method=lora,mbs=1", "--json")
    assert result.exit_code == 0, result.output
    best = json.loads(result.stdout)["plans"][0]["layout"]
    assert (best["method"], best["mbs"]) == ("lora", 1)


def test_fix_the_trainer_does_not_run_is_refused_with_the_declarations_line() -> None:
    result = plan(*LLAMA8, "--fix", "sp=1")
    shape = config_shape(load_model("llama3-8b").hf_config)
    problem = runnable_problem(Layout(dp=4, tp=2, sp=True, seq=4096), shape, "cuda")
    if problem is None:  # sequence parallelism runs now: the fix holds instead
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: --fix sp=1: {problem}"


@pytest.mark.parametrize("fix, reason", [
    ("tp=3", "tp=3 does not divide the 32 attention heads"),
    ("dp=3", "dp*tp*pp must equal the 8 devices; dp=3 does not divide them"),
    ("dp=2,tp=2,pp=1", "dp*tp*pp = 2*2*1 = 4 does not equal them"),
    ("pp=64", "pp=64 exceeds the 32 decoder layers"),
    ("mbs=3", "mbs=3 does not divide the global batch of 512"),
    ("tp=8,zero=1", "zero=1 with dp=1 shards nothing"),
    ("recompute=full", "chosen per pipeline stage by the solver"),
    ("loss=hf", "--fix loss: plans train with advisor train's loss"),
    ("dtype=fp8", "--fix dtype=fp8: dtype: Input should be 'bf16', 'fp16' or 'fp32'"),
])
def test_impossible_fix_says_which_rule_binds(fix: str, reason: str) -> None:
    result = plan(*LLAMA8, "--fix", fix)
    assert result.exit_code == 2
    assert reason in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_interleaving_fix_is_judged_by_the_declaration() -> None:
    result = plan(*LLAMA8, "--fix", "vpp=2")
    shape = config_shape(load_model("llama3-8b").hf_config)
    problem = runnable_problem(Layout(dp=4, pp=2, vpp=2, gas=2, zero=1, seq=4096), shape, "cuda")
    if problem is None:  # interleaved pipelines run now: the fix holds instead
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: --fix vpp=2: {problem}"


def test_runnable_fix_that_fits_no_memory_says_so() -> None:
    # llama3-70b whole on one device of each data-parallel replica: 140 GB of bf16 weights alone
    result = plan("--model", "llama3-70b", "--hardware", "h100-80g", "--nodes", "2", "--fix", "tp=1,pp=1,zero=0")
    assert result.exit_code == 2
    assert "--fix tp=1,pp=1,zero=0: does not fit memory" in result.stderr
    assert "without --fix:" in result.stderr


def test_any_engine_plan_is_marked_and_refused_by_train(tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    args = ["--model", "llama3-70b", "--hardware", "h100-80g", "--nodes", "2", "--top", "2"]
    result = plan(*args, "--any-engine", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["runnable_here"] is False
    saved = load_plan(out)
    assert saved.runnable_here is False
    problem = runnable_problem(saved.chosen.layout, config_shape(saved.model.hf_config), "cuda")
    refused = runner.invoke(app, ["train", str(out), "--out", str(tmp_path / "run")])
    if problem is None:
        pytest.skip("the space's best layout runs here too")
    assert refused.exit_code == 2
    assert problem in refused.stderr and "--any-engine" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_default_plans_are_runnable_here() -> None:
    result = plan(*LLAMA8, "--top", "2", "--json")
    assert result.exit_code == 0
    out = json.loads(result.stdout)
    assert out["runnable_here"] is True
    shape = config_shape(load_model("llama3-8b").hf_config)
    for p in out["plans"]:
        assert runnable_problem(Layout.model_validate(p["layout"]), shape, "cuda") is None


def test_planning_leaves_the_callers_options_as_given() -> None:
    """A pure planner (issue 30): make_plan works on a copy; the options a caller hands in (here with
    a fix that moves the method and sequence length, and a task whose tokens planning fills in) are
    unchanged afterwards, so a second plan from them is the same plan."""
    import copy

    from presets import load_hardware, load_model, load_task
    from planner.plan import PlanOptions, make_plan

    opts = PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("cpu"), task=load_task("demo"),
                       fix={"method": "lora", "seq": 128})
    before = copy.deepcopy(opts)
    first = make_plan(opts)
    assert opts == before
    assert make_plan(opts).chosen.layout == first.chosen.layout and first.chosen.layout.method == "lora"
