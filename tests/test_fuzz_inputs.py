"""Fuzzing what users type and write: layout strings, task, plan, profile and hardware files, and the
command line's numbers. Whatever goes in, a case either loads (and then holds only finite numbers)
or stops with exit code 2 and one line that names the flag or the file, never a traceback or an
"internal error" (exit 1), and it writes nothing where it runs. In-process (CliRunner and the
loaders), so the ~1,200 cases take tens of seconds.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from advisor.cli import app
from specs.errors import UsageError
from specs.plan_file import Plan, load_plan
from specs.profile import PROFILE_VERSION, load_profile
from specs.core import LAYOUT_KEYS_HELP, Layout, resolve_layout, validate
from planner.plan import PlanOptions, make_plan
from presets import PRESETS_DIR, load_hardware, load_hardware_file, load_model, load_task

def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=dt.timedelta(seconds=10), database=None,  # every case bounded
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
runner = CliRunner()

NASTY_NUMBERS = ["nan", "NaN", "inf", "-inf", "Infinity", "-1", "-0.5", "0", "", " ", "abc", "1e400", "-1e400",
                 "1.2.3", "0x10", "1_0", "1e", "--", "\u0661\u0662", "9" * 40, "-" + "9" * 40, "None", "[]", "{}"]
NASTY_VALUES: list[Any] = [math.nan, math.inf, -math.inf, -1, 0, -1e308, 1e308, 10**30, -(10**30), "", "nan", "inf",
                           "-1", [], {}, None, True, False, "x" * 300, [math.nan], {"a": math.inf}, "\x00", "\ud800x"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
nasty = st.sampled_from(NASTY_VALUES) | st.floats() | st.integers() | st.text(max_size=10) | json_values


# --- helpers ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A fresh working directory for one case; afterwards it must hold only what the case put there."""
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(old)


def tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def assert_refused(result, *names: str) -> None:
    """Exit 2, no traceback; our own errors are one line naming one of `names`; click's own type
    errors (a word where a number goes) come as its usage box, which names the option."""
    out = result.output
    assert result.exit_code == 2, f"exit {result.exit_code}: {out}"
    assert "Traceback" not in out and "internal error" not in out, out
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    if errors:  # progress lines (`data prepare`'s "scanned ...") may come first
        assert len(errors) == 1 and errors == result.stderr.strip().splitlines()[-1:], result.stderr
        assert any(n in errors[0] for n in names), (names, result.stderr)
    else:
        assert "Usage:" in result.stderr and any(n in result.stderr for n in names), (names, result.stderr)


def non_finite(value: Any, path: str = "") -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return path or "value"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if key in ("measurements", "rounds"):  # evidence, not inputs: a failed benchmark may be NaN
            continue
        found = non_finite(item, f"{path}.{key}")
        if found:
            return found
    return None


def load_or_refuse(loader: Callable[[Path], Any], path: Path) -> None:
    """The loader returns a spec with finite numbers, or raises one UsageError line naming the file."""
    try:
        spec = loader(path)
    except UsageError as exc:
        message = str(exc)
        assert "\n" not in message, message
        assert path.name in message, message
        return
    assert non_finite(spec.model_dump(mode="python")) is None


def paths_of(data: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, item in items:
        out += paths_of(item, prefix + (key,))
    return out


def fresh(value: Any) -> Any:
    """A copy of a drawn nasty value: NASTY_VALUES' lists and dicts are shared between cases, and a
    later mutation inside one (a second replace at a path into it) would change the module's value,
    or nest it in itself (a cycle: a RecursionError, found by a deeper search)."""
    return copy.deepcopy(value)


@st.composite
def mutated(draw, base: dict, most: int = 3) -> Any:
    """`base` with one to `most` places replaced by a nasty value, removed, or given an unknown key."""
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, most))):
        places = paths_of(data)
        where = draw(st.sampled_from(places))
        if not where:
            return fresh(draw(nasty))
        parent = data
        for key in where[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "extra"]))
        if action == "replace":
            parent[where[-1]] = fresh(draw(nasty))
        elif action == "delete":
            del parent[where[-1]]
        elif isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=6))] = fresh(draw(nasty))
    return data


def write(path: Path, data: Any, as_json: bool, raw: bytes | None = None) -> Path:
    if raw is not None:
        path.write_bytes(raw)
    else:
        text = json.dumps(data, default=str) if as_json else \
            data if isinstance(data, str) else yaml.safe_dump(data, allow_unicode=False, default_flow_style=False)
        path.write_bytes(text.encode("utf-8", "surrogatepass"))  # a lone surrogate makes a non-UTF-8 file
    return path


def demo_task_data() -> dict:
    return yaml.safe_load((PRESETS_DIR / "tasks" / "demo.yaml").read_text())


HARDWARE = yaml.safe_load((PRESETS_DIR / "hardware" / "a100-80g.yaml").read_text())
TASK = demo_task_data()
MODEL = load_model("demo-tiny").hf_config


@pytest.fixture(scope="module")
def plan_data() -> dict:
    plan = make_plan(PlanOptions(model=load_model("demo-tiny"), hardware=load_hardware("a100-80g"),
                                 gpus_per_node=1, task=load_task("demo"), top_k=1))
    return plan.model_dump(mode="json")


@pytest.fixture(scope="module")
def profile_data() -> dict:
    return {"version": PROFILE_VERSION, "created": dt.datetime(2026, 12, 1).isoformat(), "quick": True,
            "fingerprint": {"hostname": "h", "cpu_model": "c", "torch_version": "2"},
            "inventory": {"device_type": "cpu", "backend": "gloo", "device_name": "cpu", "devices_per_node": 2,
                          "device_memory_gib": 11.5, "device_reserved_gib": 0.3, "cpu_cores": 2,
                          "threads_per_device": 1, "host_memory_gib": 23.0, "host_memory_available_gib": 20.0,
                          "intra_node_link": "shm", "inter_node_link": "none"},
            "measurements": [{"name": "gemm/fp32", "value": 0.03, "unit": "TFLOP/s"}],
            "hardware": load_hardware("cpu").model_dump(mode="json")}


def alias_yaml(levels: int, width: int, where: str) -> bytes:
    """Nested anchors, each a list of `width` aliases of the one before (width**levels values), the last
    aliased under `where`: a "billion laughs" at 9 x 9, an ordinary reuse at 2 x 2."""
    lines = [f"l0: &l0 [{', '.join(['1'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return ("\n".join(lines) + f"\n{where}: *l{levels - 1}\n").encode()


alias_files = st.builds(alias_yaml, st.integers(1, 9), st.integers(1, 9),
                        st.sampled_from(["stages", "hf_config", "peak_tflops", "name", "x"]))


def file_cases(base: dict) -> st.SearchStrategy:
    """(data, as_json, raw bytes or None): a mutated file, random JSON/YAML, random bytes, or YAML aliases."""
    return st.one_of(
        st.tuples(mutated(base), st.booleans(), st.none()),
        st.tuples(mutated(base), st.booleans(), st.none()),
        st.tuples(json_values, st.booleans(), st.none()),
        st.tuples(st.none(), st.booleans(), st.binary(max_size=64)),
        st.tuples(st.none(), st.booleans(), st.binary(max_size=8).map(lambda b: b"name: x\n\xff\xfe" + b)),
        st.tuples(st.none(), st.booleans(), alias_files),
    )


# --- files -----------------------------------------------------------------------------------------------


def check_file(name: str, case: tuple, loader: Callable[[Path], Any], as_json: bool | None = None) -> None:
    """Write one drawn file into a fresh folder, load it (in well under a second: no alias bomb
    reaches validation), and check nothing else appeared there."""
    content, drawn_json, raw = case
    with scratch() as here:
        path = here / name
        path.parent.mkdir(exist_ok=True)
        write(path, content, drawn_json if as_json is None else as_json, raw)
        started = time.perf_counter()
        load_or_refuse(loader, path)
        assert time.perf_counter() - started < 2.0
        assert tree(here) == {str(p.relative_to(here)) for p in [path, *path.parents] if here in p.parents}


@fuzz(250)
@given(case=file_cases(TASK))
def test_task_files(case) -> None:
    check_file("task.yaml", case, lambda p: load_task(str(p)))


@fuzz(150)
@given(case=file_cases(HARDWARE), suffix=st.sampled_from([".yaml", ".json"]))
def test_hardware_files(case, suffix: str) -> None:
    check_file(f"hw{suffix}", case, load_hardware_file, suffix == ".json")


@fuzz(100)
@given(case=file_cases(MODEL))
def test_model_configs(case) -> None:
    check_file("model/config.json", case, lambda p: load_model(str(p.parent)), True)


@fuzz(150)
@given(data=st.data())
def test_plan_files(plan_data, data) -> None:
    check_file("plan.yaml", data.draw(file_cases(plan_data)), load_plan)


@fuzz(120)
@given(data=st.data())
def test_profile_files(profile_data, data) -> None:
    check_file("profile.json", data.draw(file_cases(profile_data)), load_profile, True)


# --- layout strings --------------------------------------------------------------------------------------


layout_items = st.tuples(st.sampled_from([*LAYOUT_KEYS_HELP, "x", "", "dp ", "seq"]),
                         st.sampled_from(NASTY_NUMBERS + ["1", "2", "4", "8", "bf16", "fp32", "full", "lora", "qlora",
                                                          "none", "selective", "optimizer", "1/1", "2/-1", "0/3"])
                         | st.text(max_size=6))
layout_strings = st.one_of(
    st.lists(layout_items, max_size=6).map(lambda items: ",".join(f"{k}={v}" for k, v in items)),
    st.text(max_size=30))


@fuzz(300)
@given(text=layout_strings, devices=st.sampled_from([1, 2, 8, 64]), seq=st.one_of(st.none(), st.integers(-5, 10**7)))
def test_layout_strings(text: str, devices: int, seq: int | None) -> None:
    try:
        layout = resolve_layout(text, devices, load_hardware("a100-80g"), seq)
    except UsageError as exc:
        assert "\n" not in str(exc) and str(exc)
        return
    assert layout.devices == devices and layout.seq >= 1


@fuzz(100)
@given(items=st.lists(st.sampled_from(["dp=1", "tp=1", "mbs=2", "gas=1", "zero=1", " ", ""]), min_size=1, max_size=5))
def test_layout_strings_with_an_empty_item_are_refused(items: list[str]) -> None:
    """An item left empty between commas (or before the first, after the last) is a slip, never skipped."""
    text = ",".join(items)
    empty = text.strip() and any(not item.strip() for item in text.strip().split(","))
    try:
        resolve_layout(text, 1, load_hardware("a100-80g"))
    except UsageError as exc:
        assert "\n" not in str(exc)
        assert not empty or "empty item" in str(exc), (text, str(exc))
        return
    assert not empty, text


@fuzz(60)
@given(name=st.text(max_size=70) | st.sampled_from(["..", "../x", "/etc", "a/../../b", ".git", "C:\\x", "~", "-"]))
def test_stage_names_load_only_as_one_folder_inside_the_run_dir(name: str) -> None:
    task = copy.deepcopy(TASK)
    task["stages"][0]["name"] = name
    for stage in task["stages"]:
        stage["replay"] = {}
    with scratch() as here:
        path = write(here / "task.yaml", task, False)
        try:
            loaded = load_task(str(path))
        except UsageError as exc:
            assert "\n" not in str(exc) and "task.yaml" in str(exc)
            return
        stages = (here / "run" / "stages").resolve()
        folder = (stages / loaded.stages[0].name).resolve()
        assert folder.parent == stages and not folder.name.startswith("."), name


@pytest.mark.parametrize("dtype", [[], ["bf16"], {"a": 1}, None, 3])
def test_a_layout_dtype_of_another_type_is_refused_in_one_line(dtype: Any) -> None:
    """The fuzzer found it in a plan file: a list where the dtype goes hashed into the refused-dtype
    table and raised TypeError (an internal error) instead of the usual refusal."""
    with pytest.raises(UsageError) as refused:
        validate(Layout, {"dp": 1, "dtype": dtype}, "plan file plan.yaml")
    assert "\n" not in str(refused.value) and "dtype" in str(refused.value)


@fuzz(40)
@given(text=layout_strings.filter(lambda t: "seq" not in t))
@example(text="tp=\u0661\u0662")  # CI found it: int() reads Arabic-Indic digits as 12
@example(text="tp=1_0")
def test_layout_strings_through_estimate(text: str) -> None:
    with scratch() as here:
        result = runner.invoke(app, ["estimate", "--model", "demo-tiny", "--hardware", "a100-80g", "--seq-len", "4096",
                                     "--layout", text])
        assert_refused(result, "layout", "--seq-len")
        assert tree(here) == set()


# --- command-line numbers --------------------------------------------------------------------------------


numbers = st.sampled_from(NASTY_NUMBERS) | st.floats().map(repr) | st.text(max_size=8) | st.integers().map(str)
PLAN = ["plan", "--model", "demo-tiny", "--hardware", "a100-80g", "--gpus-per-node", "1"]
# a guard that always fails, checked after the flag under test: every case must stop with exit 2
PLAN_GUARD = ["--seq-len", "99999"]


@fuzz(160)
@given(flag=st.sampled_from(["--tokens", "--price-per-gpu-hour", "--mtbf-hours", "--min-compute-fraction",
                             "--deadline", "--top", "--global-batch", "--nodes"]), value=numbers)
def test_plan_numbers(flag: str, value: str) -> None:
    with scratch() as here:
        result = runner.invoke(app, [*PLAN, *PLAN_GUARD, flag, value])
        assert_refused(result, flag, "--seq-len")
        assert tree(here) == set()


@fuzz(60)
@given(value=numbers)
def test_plan_seq_len(value: str) -> None:
    with scratch() as here:
        result = runner.invoke(app, [*PLAN, "--tokens", "nan", "--seq-len", value])
        assert_refused(result, "--seq-len", "--tokens")
        assert tree(here) == set()


@fuzz(60)
@given(flag=st.sampled_from(["--min-compute-fraction", "--seq-len", "--nodes", "--gpus-per-node"]), value=numbers)
def test_estimate_numbers(flag: str, value: str) -> None:
    with scratch() as here:
        # layout seq=99999 exceeds demo-tiny's positions: the guard when the value under test is fine
        result = runner.invoke(app, ["estimate", "--model", "demo-tiny", "--hardware", "a100-80g",
                                     "--layout", "seq=99999", flag, value])
        assert_refused(result, flag, "layout seq", "--seq-len", "dp*tp*pp")
        assert tree(here) == set()


@fuzz(60)
@given(flag=st.sampled_from(["--tokens", "--mtbf-hours", "--restart-minutes", "--price-per-gpu-hour", "--deadline",
                             "--gpus"]), value=numbers)
def test_report_capacity_numbers(flag: str, value: str) -> None:
    with scratch() as here:
        guard = ["--tokens", "-1"] if flag != "--tokens" else ["--mtbf-hours", "-1"]
        result = runner.invoke(app, ["report", "capacity", "--model", "demo-tiny", *guard, flag, value,
                                     "--out", str(here / "out")])
        assert_refused(result, flag, "--tokens", "--mtbf-hours")
        assert tree(here) == set()


@fuzz(60)
@given(flag=st.sampled_from(["--epochs", "--timeout-s", "--clip", "--spike-lr-factor", "--keep-checkpoints",
                             "--max-rollbacks"]), value=numbers)
def test_train_numbers(flag: str, value: str) -> None:
    """Checked before the plan is read: with no plan file as the guard, every case stops with exit 2."""
    with scratch() as here:
        result = runner.invoke(app, ["train", "no-plan.yaml", "--out", str(here / "run"), flag, value])
        assert_refused(result, flag, "plan file not found")
        assert tree(here) == set()


@pytest.mark.parametrize("text", ["1.2.3d", "d", "-1d", "0h", "inf", "nan", "1e400", "14 days", "..5"])
def test_deadline_is_strict(text: str) -> None:
    result = runner.invoke(app, [*PLAN, "--deadline", text])
    assert_refused(result, "--deadline")


# --- the one verb here that writes: `advisor data prepare` -----------------------------------------------


PREPARE_TASK = {"name": "t", "model": "demo-tiny", "seq_len": 32,
                "data": {"filters": {"min_tokens": 1}, "dedup": {"near": False}, "buckets": {"micro_batch_tokens": 64},
                         "difficulty": {"by": "length", "edges": [8]}},
                "stages": [{"name": "s", "tokens": 100, "replay": {}, "split_by": "difficulty",
                            "sources": [{"path": "docs.jsonl", "weight": 1.0, "domain": "d"}]}]}


@fuzz(60)
@given(task=mutated(PREPARE_TASK, most=1))
def test_data_prepare_writes_only_its_out_folder(task) -> None:
    with scratch() as here:
        (here / "docs.jsonl").write_text("".join(json.dumps({"text": f"words of document {i} " * (i % 7 + 1)}) + "\n"
                                                 for i in range(20)))
        write(here / "task.yaml", task, False)
        result = runner.invoke(app, ["data", "prepare", "--task", str(here / "task.yaml"), "--out", str(here / "out")])
        assert result.exit_code in (0, 2), result.output
        if result.exit_code == 2:
            assert_refused(result, "task.yaml", "docs.jsonl", "stage", "difficulty", "--out", "tokenizer", "data")
        assert {p.split("/")[0] for p in tree(here)} <= {"task.yaml", "docs.jsonl", "out"}
