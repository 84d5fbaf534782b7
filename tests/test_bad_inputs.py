"""Bad input from outside, each case once: stage names that would climb out of the run dir, plan-file
typos and non-finite or absurd numbers deep in a plan, empty layout items, an --out that is a file,
infinite flags, malformed environment variables and YAML alias bombs. Every one stops with exit 2
and one line (or, for an environment variable training can do without, a one-line warning), before
anything is written or moved. In-process and fast: nothing here trains.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from advisor.cli import app
from specs.errors import UsageError
from specs.plan_file import load_plan
from specs.task import STAGE_NAME_RULE
from specs.core import MAX_ALIASED_VALUES, parse_user_yaml
from planner.plan import PlanOptions, make_plan
from presets import PRESETS_DIR, load_hardware, load_model, load_task

runner = CliRunner()
PLAN = ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1"]


def one_line_exit_2(result, *words: str) -> str:
    """The refusal: exit 2, a single `error:` line holding every one of `words`, no traceback."""
    assert result.exit_code == 2, f"exit {result.exit_code}: {result.output}"
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert all(word in lines[0] for word in words), (words, lines[0])
    return lines[0]


def refused_naming(result, flag: str) -> None:
    """Exit 2 naming `flag`: our one line, or click's usage box where its own type check stops the value."""
    assert result.exit_code == 2, f"exit {result.exit_code}: {result.output}"
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    if result.stderr.startswith("error:"):
        one_line_exit_2(result, flag)
    else:
        assert "Usage:" in result.stderr and flag in result.stderr, result.stderr


def demo_task(tmp_path: Path, **stage0) -> Path:
    """The demo task with its first stage changed, replaying nothing (so renames stay consistent)."""
    task = yaml.safe_load((PRESETS_DIR / "tasks" / "demo.yaml").read_text())
    for stage in task["stages"]:
        stage["replay"] = {}
    task["stages"][0].update(stage0)
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(task))
    return path


@pytest.fixture(scope="module")
def plan_data() -> dict:
    plan = make_plan(PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("cpu"), gpus_per_node=1,
                                 task=load_task("demo"), top_k=2))
    return plan.model_dump(mode="json")


def write_plan(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# --- stage names are folder names ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../victim", "/tmp/victim", "", "a/b", "a\\b", ".hidden", "a..b", "..",
                                  "x" * 65, "tab\there", "-dash-first"])
def test_a_stage_name_that_is_no_plain_folder_name_is_refused_at_plan_time(tmp_path, name: str) -> None:
    result = runner.invoke(app, [*PLAN, "--task", str(demo_task(tmp_path, name=name)), "--out",
                                 str(tmp_path / "plan.yaml")])
    one_line_exit_2(result, "stage name", STAGE_NAME_RULE)
    assert not (tmp_path / "plan.yaml").exists()


@pytest.mark.parametrize("name", ["language.v2", "Stage_1", "a-b", "x" * 64, "9lives"])
def test_plain_stage_names_plan(tmp_path, name: str) -> None:
    assert load_task(str(demo_task(tmp_path, name=name))).stages[0].name == name


def test_stage_names_that_one_folder_would_hold_are_refused(tmp_path) -> None:
    """`Math` and `math` are one folder on a case-insensitive file system: one run would overwrite the other."""
    task = yaml.safe_load(demo_task(tmp_path).read_text())
    task["stages"][1]["name"] = task["stages"][0]["name"].upper()
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    with pytest.raises(UsageError, match="stage names must be unique"):
        load_task(str(tmp_path / "task.yaml"))


@pytest.mark.parametrize("where", ["task", "stages"])
def test_a_plan_file_edited_to_climb_out_of_the_run_dir_is_refused_by_train(tmp_path, plan_data, where) -> None:
    data = copy.deepcopy(plan_data)
    if where == "task":
        data["task"]["stages"][0]["name"] = "../../victim"
    else:
        data["stages"][0]["name"] = "../../victim"
    plan = write_plan(tmp_path, data)
    with pytest.raises(UsageError, match="stage name '../../victim'"):
        load_plan(plan)
    result = runner.invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--dry-run"])
    one_line_exit_2(result, "../../victim")
    assert not (tmp_path / "run").exists()


# --- plan files: typos, NaN, infinities, absurd sizes, deep in the file ------------------------------------


@pytest.mark.parametrize("edit,words", [
    (lambda p: p["stages"][0].update(checkpoint_every_step=10), ["stages.0.checkpoint_every_step", "unknown key"]),
    (lambda p: p["chosen"].update(layuot={}), ["chosen.layuot", "unknown key"]),
    (lambda p: p["chosen"]["estimate"]["time"].update(step_z=1.0), ["step_z", "unknown key"]),
    (lambda p: p["alternatives"][0]["estimate"]["time"].update(step_s=math.nan),
     ["alternatives.0.estimate.time.step_s", "not a finite number"]),
    (lambda p: p["chosen"]["estimate"]["throughput"].update(mfu=math.inf), ["mfu", "not a finite number"]),
    (lambda p: p["stages"][0].update(hours=-1.0), ["stages.0.hours", "greater than or equal to 0"]),
    (lambda p: p["stages"][0].update(steps=10**30), ["stages.0.steps", "less than or equal"]),
    (lambda p: p["hardware"].update(memory_gib=1e308), ["hardware.memory_gib", "less than or equal"]),
    (lambda p: p["chosen"]["layout"].update(mbs=10**12), ["chosen.layout.mbs", "less than or equal"]),
    (lambda p: p["task"]["stages"][0].update(tokens=10**30), ["task.stages.0.tokens", "less than or equal"]),
])
def test_plan_file_parts_forbid_typos_and_non_finite_or_absurd_numbers(tmp_path, plan_data, edit, words) -> None:
    data = copy.deepcopy(plan_data)
    edit(data)
    result = runner.invoke(app, ["train", str(write_plan(tmp_path, data)), "--dry-run"])
    one_line_exit_2(result, "plan file", *words)


def test_a_hardware_file_of_1e308_gib_is_refused_not_overflowed(tmp_path) -> None:
    hardware = yaml.safe_load((PRESETS_DIR / "hardware" / "cpu.yaml").read_text())
    hardware["memory_gib"] = 1e308
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(hardware))
    result = runner.invoke(app, ["estimate", "--model", "demo-tiny", "--hardware", str(tmp_path / "hw.yaml")])
    one_line_exit_2(result, "memory_gib", "less than or equal to")


def test_a_plan_file_that_is_not_utf8_is_one_line(tmp_path) -> None:
    (tmp_path / "plan.yaml").write_bytes(b"version: 1\nname: \xff\xfe\n")
    one_line_exit_2(runner.invoke(app, ["train", str(tmp_path / "plan.yaml"), "--dry-run"]), "not UTF-8")


# --- layout strings --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text,words", [("", ["--layout is empty"]), ("  ", ["--layout is empty"]),
                                        ("dp=1,,tp=1", ["empty item"]), ("tp=1,", ["empty item"]),
                                        (",mbs=2", ["empty item"])])
def test_empty_layouts_and_empty_layout_items_are_refused(text: str, words: list[str]) -> None:
    result = runner.invoke(app, ["estimate", "--model", "demo-tiny", "--hardware", "cpu", "--layout", text])
    one_line_exit_2(result, *words)


def test_layout_items_may_still_be_separated_by_a_comma_and_spaces() -> None:
    result = runner.invoke(app, ["estimate", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "2",
                                 "--layout", "dp=2, mbs=2 gas=1", "--json"])
    assert result.exit_code == 0, result.output
    assert '"dp":2' in result.stdout.replace(" ", "") and '"mbs":2' in result.stdout.replace(" ", "")


# --- --out naming a file, and the flags typer's `min` lets through ------------------------------------------


@pytest.mark.parametrize("command", [
    ["train", "PLAN", "--out", "FILE"],
    ["run", "--out", "FILE"],
    ["report", "capacity", "--model", "demo-tiny", "--tokens", "1e9", "--out", "FILE"],
    ["data", "generate-demo", "--out", "FILE"],
    [*PLAN, "--out", "FILE/plan.yaml"],
    [*PLAN, "--out", "DIR"],
])
def test_an_out_that_is_a_file_is_one_line(tmp_path, plan_data, command: list[str]) -> None:
    (tmp_path / "afile").write_text("the user's file\n")
    (tmp_path / "adir").mkdir()
    swap = {"PLAN": str(write_plan(tmp_path, plan_data)), "FILE": str(tmp_path / "afile"),
            "FILE/plan.yaml": str(tmp_path / "afile" / "plan.yaml"), "DIR": str(tmp_path / "adir")}
    result = runner.invoke(app, [swap.get(word, word) for word in command])
    one_line_exit_2(result, "--out")
    assert (tmp_path / "afile").read_text() == "the user's file\n" and not any((tmp_path / "adir").iterdir())


@pytest.mark.parametrize("flag,value", [("--epochs", "inf"), ("--epochs", "nan"), ("--epochs", "0"),
                                        ("--epochs", "1e300"), ("--timeout-s", "inf"), ("--timeout-s", "nan"),
                                        ("--timeout-s", "1e300"), ("--clip", "inf"), ("--spike-lr-factor", "nan")])
def test_train_float_flags_are_finite_and_bounded(tmp_path, plan_data, flag: str, value: str) -> None:
    result = runner.invoke(app, ["train", str(write_plan(tmp_path, plan_data)), "--dry-run", flag, value])
    refused_naming(result, flag)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_keep_checkpoints_keeps_at_least_one(tmp_path, plan_data, value: str) -> None:
    """0 kept every checkpoint and -1 deleted the oldest (a slice `[:-keep]`): both are refused."""
    result = runner.invoke(app, ["train", str(write_plan(tmp_path, plan_data)), "--dry-run",
                                 "--keep-checkpoints", value])
    refused_naming(result, "--keep-checkpoints")


@pytest.mark.parametrize("command", [["data", "generate-demo", "--out", "OUT"],
                                     ["curriculum", "compare", "--task", "demo", "--out", "OUT"]])
@pytest.mark.parametrize("value", ["inf", "nan", "1e9"])
def test_scale_is_finite_and_bounded(tmp_path, command: list[str], value: str) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, [*(str(out) if w == "OUT" else w for w in command), "--scale", value])
    refused_naming(result, "--scale")
    assert not out.exists()


def test_run_reads_every_input_before_it_moves_a_previous_run_aside(tmp_path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "model").mkdir()
    result = runner.invoke(app, ["run", "--model", "no-such-model", "--out", str(out)])
    one_line_exit_2(result, "no-such-model")
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n' and (out / "model").is_dir()
    assert not list(out.glob("previous-*")) and not list(out.glob("*.old-*"))


# --- environment variables ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["x", "-1", "1.5", "1_0", " 2 3"])
def test_a_malformed_restart_count_is_refused_in_one_line(monkeypatch, value: str) -> None:
    from trainer.run_identity import restarted

    monkeypatch.setenv("SLURM_RESTART_COUNT", value)
    with pytest.raises(UsageError, match="SLURM_RESTART_COUNT"):
        restarted()


@pytest.mark.parametrize("value,resumes", [("", False), ("0", False), ("2", True), (" 1 ", True)])
def test_restart_counts_that_are_numbers_still_decide_a_resume(monkeypatch, value: str, resumes: bool) -> None:
    from trainer.run_identity import restarted

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", value)
    assert restarted() is resumes


@pytest.mark.parametrize("value,threads", [("4,2", 3), ("abc", 3), ("0", 3), ("-2", 3), ("5", 5)])
def test_omp_num_threads_that_is_not_one_count_is_ignored_with_a_warning(monkeypatch, capsys, value: str,
                                                                          threads: int) -> None:
    import trainer.launch as launch

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    monkeypatch.setattr(launch, "cpu_cores", lambda: 6)
    hardware = load_hardware("cpu").model_copy(update={"threads_per_device": None})
    assert launch.cpu_threads(hardware, ranks_on_node=2) == threads  # 6 cores shared by 2 ranks, unless told
    warned = capsys.readouterr().err.strip().splitlines()
    assert warned == ([] if threads == 5 else [f"warning: OMP_NUM_THREADS={value!r} is not a whole number > 0: "
                                               "ignored, the ranks share the cores out"])


# --- YAML alias bombs --------------------------------------------------------------------------------------


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """`a: &a [x, x, ...]`, `b: &b [*a, *a, ...]`, ...: width**levels values in a few hundred bytes."""
    names = "abcdefghijklmnop"[:levels]
    lines = [f"{names[0]}: &{names[0]} [{', '.join(['x'] * width)}]"]
    lines += [f"{name}: &{name} [{', '.join([f'*{before}'] * width)}]" for before, name in zip(names, names[1:])]
    return "\n".join(lines) + "\n"


def bombed(base: dict, where: list, bomb_key: str) -> str:
    """`base` as YAML with the bomb's anchors in front and its last alias at `where`."""
    text = yaml.safe_dump(base, sort_keys=False)
    marker = "BOMB_GOES_HERE"
    data = copy.deepcopy(base)
    parent = data
    for key in where[:-1]:
        parent = parent[key]
    parent[where[-1]] = marker
    text = yaml.safe_dump(data, sort_keys=False).replace(marker, f"*{bomb_key}")
    return "anchors: " + "\n  ".join(("\n" + alias_bomb()).splitlines()) + "\n" + text


@pytest.mark.parametrize("what", ["plan", "task", "hardware"])
def test_a_yaml_alias_bomb_is_refused_in_under_a_second(tmp_path, plan_data, what: str) -> None:
    """Nine levels of nine aliases (387 million values in ~500 bytes), placed where the schema takes
    free-form values or a list: refused while parsing, before validation walks it."""
    if what == "plan":
        text, command = bombed(plan_data, ["model", "hf_config", "bomb"], "i"), ["train", "FILE", "--dry-run"]
    elif what == "task":
        task = yaml.safe_load((PRESETS_DIR / "tasks" / "demo.yaml").read_text())
        text, command = bombed(task, ["stages"], "i"), [*PLAN, "--task", "FILE"]
    else:
        hardware = yaml.safe_load((PRESETS_DIR / "hardware" / "cpu.yaml").read_text())
        text, command = bombed(hardware, ["peak_tflops"], "i"), ["estimate", "--model", "demo-tiny", "--hardware",
                                                                  "FILE"]
    path = tmp_path / f"{what}.yaml"
    path.write_text(text)
    assert len(alias_bomb()) < 600
    started = time.perf_counter()
    result = runner.invoke(app, [str(path) if word == "FILE" else word for word in command])
    assert time.perf_counter() - started < 1.0
    one_line_exit_2(result, "aliases expand to more than")


def test_a_few_reused_anchors_still_load() -> None:
    """A hand-written task may share one block between stages: small expansions pass."""
    text = "shared: &f {min_chars: 8, min_tokens: 4}\nstages:\n" + "".join(f"  - {{name: s{i}, filters: *f}}\n"
                                                                         for i in range(50))
    data = parse_user_yaml(text, "task file t.yaml")
    assert data["stages"][49]["filters"] == {"min_chars": 8, "min_tokens": 4}
    with pytest.raises(UsageError, match="aliases expand"):
        parse_user_yaml(text + "more: [" + ", ".join(["*f"] * (MAX_ALIASED_VALUES // 5)) + "]\n", "task file t.yaml")


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(UsageError, match="recursive YAML alias"):
        parse_user_yaml("a: &a [1, *a]\n", "plan file p.yaml")
