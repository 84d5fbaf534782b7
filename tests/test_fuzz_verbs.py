"""Fuzzing every verb's options and the environment (issue 31): each leaf command of the `advisor`
app, found by walking the app itself (a new verb or option is fuzzed without editing this file),
gets one to five of its own options with drawn values, under drawn environment variables. Whatever
goes in, the command exits 0 or 2, prints no traceback and no "internal error", finishes within
10 s, and writes nothing outside the folder it runs in.

A case that passes every check reaches the work itself (training, profiling, a capacity grid, a
curriculum comparison): that call is replaced by one raising `Reached`, so a case costs milliseconds
and counts as accepted input. `bench/fuzz_campaign.py` runs this file with tests/test_fuzz_inputs.py
and writes the counts to docs/benchmarks.md.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import typer.main
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_fuzz_inputs import NASTY_NUMBERS, scratch, tree
from typer.testing import CliRunner

from advisor.cli import app
from planner.plan import PlanOptions, make_plan
from presets import load_hardware, load_model, load_task

BOUND_S = 10.0
runner = CliRunner()


class Reached(BaseException):
    """The case passed every check and reached the work (a BaseException: no `except Exception` of
    the CLI turns it into an "internal error")."""


# the calls that start the work each verb exists for, replaced by `Reached`
WORK = [("trainer.launch", "run"), ("advisor.cli.run_chain", "run_chain"),
        ("advisor.cli.compose", "profile_this_machine"), ("reports.capacity", "capacity_report"),
        ("reports.run_report", "run_report"), ("trainer.data.prepare", "prepare"),
        ("advisor.cli.data", "generate_demo_corpus"), ("reports.curriculum", "compare")]
# generating the demo corpus into the cache is a side step, not the work: skipped
CACHE_STEPS = [("advisor.cli.data", "ensure_generated_data"), ("advisor.cli.train", "ensure_generated_data"),
               ("advisor.cli.curriculum", "ensure_generated_data"), ("advisor.cli.run_chain", "ensure_generated_data")]


def _reached(*args: Any, **kwargs: Any) -> Any:
    raise Reached


@pytest.fixture(scope="module", autouse=True)
def no_work() -> Iterator[None]:
    import importlib
    with pytest.MonkeyPatch.context() as patch:
        for module, name in WORK:
            patch.setattr(importlib.import_module(module), name, _reached)
        for module, name in CACHE_STEPS:
            patch.setattr(importlib.import_module(module), name, lambda *a, **k: False)
        yield


def leaf_commands() -> dict[str, Any]:
    """'plan' -> its command, 'report capacity' -> ..., walked from the app."""
    found: dict[str, Any] = {}

    def walk(command: Any, words: tuple[str, ...]) -> None:
        children = getattr(command, "commands", None)
        if children:
            for name, child in children.items():
                walk(child, (*words, name))
        else:
            found[" ".join(words)] = command
    walk(typer.main.get_command(app), ())
    return found


VERBS = leaf_commands()


@functools.lru_cache(maxsize=1)
def valid_plan_text() -> str:
    plan = make_plan(PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("cpu"), gpus_per_node=1,
                                 task=load_task("demo"), top_k=1))
    return plan.model_dump_json()


PLAUSIBLE = ["demo-tiny", "llama3-8b", "cpu", "a100-80g", "h100-80g", "demo", "dp=1", "mbs=2,gas=2", "1", "2", "8",
             "0.5", "out", "run", "plan.yaml", "profile.json", "data.jsonl", "none", "lora", "ours", "megatron"]
PATHS = ["/", "/dev/null", "no-such.yaml", "../x", ".", "plan.yaml", "out/../..", "~", "a" * 300, "-", "--"]
text_values = st.sampled_from(PLAUSIBLE + PATHS + NASTY_NUMBERS) | st.text(max_size=10)


@st.composite
def option_values(draw, option: Any) -> list[str]:
    """One option as argv: a flag alone, or one of its names and a drawn value."""
    name = draw(st.sampled_from(option.opts + option.secondary_opts))
    return [name] if option.is_flag or option.count else [name, draw(text_values)]


def options_of(command: Any, kind: str) -> list[Any]:
    return [p for p in command.params if p.param_type_name == kind and p.name != "help"]


@st.composite
def command_lines(draw) -> tuple[str, list[str]]:
    verb = draw(st.sampled_from(sorted(VERBS)))
    argv = verb.split()
    for _ in options_of(VERBS[verb], "argument"):  # train's plan file
        argv.append(draw(st.sampled_from(["plan.yaml", "no-plan.yaml", "/dev/null", ".", ""])))
    options = options_of(VERBS[verb], "option")
    for option in draw(st.lists(st.sampled_from(options), max_size=5)) if options else []:
        argv += draw(option_values(option))
    return verb, argv


ENVIRONMENT = ["ADVISOR_INJECT_OOM", "ADVISOR_CHECKPOINT_DELAY_S", "ADVISOR_PROFILE_SLOW_RANKS", "ADVISOR_CACHE",
               "ADVISOR_WORKER_LOG", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS",
               "SLURM_JOB_NUM_NODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "MASTER_ADDR", "MASTER_PORT", "COLUMNS"]
env_values = (st.sampled_from(NASTY_NUMBERS + ["step=1", "tokens=x", "0=2.5", "1=-1,x", "n[1-2]", "cache", "log"])
              | st.text(max_size=10)).filter(lambda v: "\x00" not in v)
environments = st.dictionaries(st.sampled_from(ENVIRONMENT), env_values, max_size=3)


def run_case(argv: list[str], env: dict[str, str], here: Path) -> Any:
    for key in ("ADVISOR_CACHE", "ADVISOR_WORKER_LOG"):  # paths drawn here stay inside the case's folder
        if key in env:
            env[key] = str(here / (env[key].replace("/", "_").lstrip(".") or "x"))
    (here / "plan.yaml").write_text(valid_plan_text())
    started = time.perf_counter()
    try:
        result = runner.invoke(app, argv, env={**env, "ADVISOR_DEBUG": ""})
    except Reached:  # CliRunner passes a BaseException through
        result = None
    elapsed = time.perf_counter() - started
    assert elapsed < BOUND_S, f"{argv} took {elapsed:.1f} s"
    return result


def check_outcome(result: Any, argv: list[str]) -> None:
    if result is None:
        return  # every check passed: the verb would start its work now
    out = result.output
    assert result.exit_code in (0, 2), f"{argv}: exit {result.exit_code}: {out[-1500:]} {result.exception!r}"
    assert "Traceback" not in out and "internal error" not in out, f"{argv}: {out[-1500:]}"


@settings(max_examples=600, deadline=dt.timedelta(seconds=BOUND_S), database=None, phases=(Phase.generate, Phase.shrink),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(case=command_lines(), env=environments)
def test_every_verb_under_drawn_options_and_environment_exits_0_or_2_within_10_s(case, env) -> None:
    verb, argv = case
    with scratch() as here:
        result = run_case(argv, dict(env), here)
        check_outcome(result, argv)
        written = {p.split(os.sep)[0] for p in tree(here)}
        assert written <= {"plan.yaml", "out", "run", "runs", "report", "profile.json", "cache", "log", "x",
                           *(a for a in argv if a and "/" not in a),
                           *(v.replace("/", "_").lstrip(".") for v in env.values())}, (argv, written)


def test_the_walk_finds_every_verb_and_their_options() -> None:
    """The fuzzer reaches what a user can type: all twelve leaf commands, and train's options."""
    assert {"plan", "train", "run", "profile", "estimate", "presets", "report capacity", "report run",
            "data prepare", "data stats", "data generate-demo", "curriculum compare"} <= set(VERBS)
    names = {o for p in options_of(VERBS["train"], "option") for o in p.opts}
    assert {"--steps", "--data", "--resume", "--timeout-s", "--nnodes"} <= names


@pytest.mark.parametrize("argv, env, says", [
    (["curriculum", "compare"], {"COLUMNS": "9" * 40}, None),  # rich's width overflowed: a traceback
    (["train", "plan.yaml"], {"SLURM_JOB_NUM_NODES": "nan", "SLURM_NODEID": "0"}, "SLURM_JOB_NUM_NODES"),
    (["train", "plan.yaml"], {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "2"}, "not a node of the job"),
    (["run", "--model", "demo-tiny", "--out", ""], {}, "cannot be a run dir"),  # ran the whole chain in "."
    (["train", "plan.yaml", "--out", "/"], {}, "cannot be a run dir"),
    (["report", "capacity", "--model", "a" * 300], {}, "unknown models preset"),  # ENAMETOOLONG: internal error
    (["data", "prepare", "--task", "demo-tiny", "--out", "a" * 300], {}, "File name too long"),
    (["data", "generate-demo", "--out", "a" * 300], {}, "File name too long"),
])
def test_what_the_campaign_found(argv: list[str], env: dict[str, str], says: str | None) -> None:
    """Each case a fuzz run found on the way (an internal error, a traceback, or a run written into the
    current folder): now refused in one line, or accepted without writing outside its folder."""
    with scratch() as here:
        result = run_case(argv, dict(env), here)
        check_outcome(result, argv)
        if says is not None:
            assert result is not None and result.exit_code == 2 and says in result.stderr, result and result.output
        assert {p.split(os.sep)[0] for p in tree(here)} <= {"plan.yaml", "x"}
