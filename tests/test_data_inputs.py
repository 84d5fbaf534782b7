"""Data inputs that must not run code, lose a user's files, mix stages or train on stale or made-up
text: difficulty rules that are code, `--out` folders, shard names, the raw-data token cache, null
text fields, and a damaged manifest."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from advisor.cli import app
from specs.errors import UsageError
from specs.core import safe_name
from specs.task import DataSource, TaskSpec
from presets import load_task
from trainer.corpus import ByteTokenizer, load_source
from trainer.data.prepare import prepare
from trainer.data.shards import load_shard

runner = CliRunner()


def write_task(folder: Path, stages: list[dict], **data) -> Path:
    task = {"name": "t", "model": "demo-tiny", "seq_len": 64,
            "data": {"buckets": {"micro_batch_tokens": 256}, "dedup": {"near": False}, **data}, "stages": stages}
    path = folder / "task.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path


def write_rows(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


# --- code named by a task file runs only with --allow-code -------------------------------------------


@pytest.mark.parametrize("rule", ["os:system", "evil.py:grade"])
def test_a_difficulty_rule_that_is_code_is_refused_without_allow_code(tmp_path: Path, rule: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the control below runs the documents as shell commands
    pwned = tmp_path / "PWNED"
    imported = tmp_path / "IMPORTED"
    # os:system would run each document as a shell command; evil.py runs code as soon as it is imported
    write_rows(tmp_path / "docs.jsonl", [f"touch {pwned}", f"touch {pwned}  # twice"])
    (tmp_path / "evil.py").write_text(f"open({str(imported)!r}, 'w').close()\n"
                                      f"import os\ndef grade(text):\n    return float(os.system(text))\n")
    stages = [{"name": "s", "tokens": 100, "difficulty": {"by": "rule", "rule": rule},
               "sources": [{"path": "docs.jsonl"}]}]
    task = write_task(tmp_path, stages, filters={"min_tokens": 1})
    out = tmp_path / "out"
    result = runner.invoke(app, ["data", "prepare", "--task", str(task), "--out", str(out)])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert f"difficulty.rule '{rule}'" in line and "--allow-code" in line
    assert not pwned.exists() and not imported.exists() and not out.exists()
    # the control: with the flag the rule really runs (so the refusal above is what kept the file away)
    result = runner.invoke(app, ["data", "prepare", "--task", str(task), "--out", str(out), "--allow-code"])
    assert result.exit_code == 0, result.output
    assert pwned.exists()


# --- `--out`: only a folder this tool wrote is replaced ---------------------------------------------------


@pytest.fixture()
def prepared_once(tmp_path: Path):
    write_rows(tmp_path / "docs.jsonl", [f"document number {i} with some words" for i in range(30)])
    task = write_task(tmp_path, [{"name": "s", "tokens": 100, "sources": [{"path": "docs.jsonl"}]}])
    out, _ = prepare(load_task(str(task)), tmp_path / "out")
    return tmp_path, task, out


def test_out_with_its_own_manifest_and_shards_is_replaced(prepared_once) -> None:
    tmp_path, task, out = prepared_once
    manifest = json.loads((out / "manifest.json").read_text())
    before = manifest["created"] = "2000-01-01T00:00:00+00:00"  # marks the old folder, without waiting a second
    (out / "manifest.json").write_text(json.dumps(manifest))
    prepare(load_task(str(task)), out)
    assert json.loads((out / "manifest.json").read_text())["created"] != before


@pytest.mark.parametrize("damage", ["stray_file", "manifest_not_ours", "manifest_not_json"])
def test_out_holding_anything_else_is_refused_and_kept(prepared_once, damage: str) -> None:
    tmp_path, task, out = prepared_once
    if damage == "stray_file":
        (out / "s" / "notes.txt").write_text("keep me")
    elif damage == "manifest_not_ours":
        (out / "manifest.json").write_text(json.dumps({"name": "someone else's", "files": []}))
    else:
        (out / "manifest.json").write_text("{ half")
    files = sorted(p.relative_to(out) for p in out.rglob("*"))
    result = runner.invoke(app, ["data", "prepare", "--task", str(task), "--out", str(out)])
    assert result.exit_code == 2 and "not a prepared-data folder" in result.stderr, result.output
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == files


# --- shard names -----------------------------------------------------------------------------------------


def test_stages_whose_names_look_alike_keep_their_own_shards(tmp_path: Path) -> None:
    """Names that would clean to one folder (`a b`, `a_b`; `A`, `a`) are refused when the task is read
    (specs/task.py STAGE_NAME_RULE, tests/test_bad_inputs.py); names one character apart stay apart."""
    write_rows(tmp_path / "one.jsonl", [f"alpha words number {i}" for i in range(12)])
    write_rows(tmp_path / "two.jsonl", [f"beta other number {i} and more" for i in range(20)])
    stages = [{"name": "a.b", "tokens": 100, "sources": [{"path": "one.jsonl"}]},
              {"name": "a_b", "tokens": 100, "sources": [{"path": "two.jsonl"}]}]
    out, manifest = prepare(load_task(str(write_task(tmp_path, stages))), tmp_path / "out")
    paths = {s["name"]: [shard["path"] for shard in s["train"]["shards"]] for s in manifest["stages"]}
    assert not set(paths["a.b"]) & set(paths["a_b"])
    for stage in manifest["stages"]:
        sources = {Path(row["source"]).name for p in paths[stage["name"]] for row in load_shard(out / p)}
        assert sources == {"one.jsonl" if stage["name"] == "a.b" else "two.jsonl"}
        rows = sum(len(load_shard(out / p)) for p in paths[stage["name"]])
        assert rows == stage["train"]["samples"]


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(max_size=12), st.text(max_size=12))
def test_safe_names_are_injective_and_safe(a: str, b: str) -> None:
    for name in (a, b):
        cleaned = safe_name(name)
        assert cleaned and "/" not in cleaned and cleaned not in (".", "..") and "\n" not in cleaned
    if a != b:
        assert safe_name(a) != safe_name(b)


# --- the raw-data token cache ----------------------------------------------------------------------------


def test_the_token_cache_sees_an_edited_source_file(tmp_path: Path) -> None:
    data = tmp_path / "docs.jsonl"
    write_rows(data, ["first version of the text " * 4])
    task = TaskSpec.model_validate({"name": "t", "base_dir": str(tmp_path),
                                    "stages": [{"name": "s", "tokens": 10, "sources": [{"path": "docs.jsonl"}]}]})
    source: DataSource = task.stages[0].sources[0]
    cache = tmp_path / "cache"
    first = load_source(source, task, ByteTokenizer(), 16, cache)
    assert np.array_equal(load_source(source, task, ByteTokenizer(), 16, cache), first)  # a hit
    write_rows(data, ["the edited text, not the same at all " * 4])
    os.utime(data, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    edited = load_source(source, task, ByteTokenizer(), 16, cache)
    expected = list("the edited text".encode())
    assert edited.reshape(-1)[: len(expected)].tolist() == expected


# --- null and non-string text fields are bad rows --------------------------------------------------------


@pytest.mark.parametrize("row,message", [
    ('{"text": null}', "docs.jsonl, line 2 (row 2): no field 'text' (or it is null)"),
    ('{"text": 7}', "docs.jsonl, line 2 (row 2): field 'text' is int, not a string"),
])
def test_null_or_non_string_text_is_a_bad_row(tmp_path: Path, row: str, message: str) -> None:
    (tmp_path / "docs.jsonl").write_text('{"text": "a fine document"}\n' + row + "\n")
    task = write_task(tmp_path, [{"name": "s", "tokens": 100, "sources": [{"path": "docs.jsonl"}]}])
    with pytest.raises(UsageError) as err:
        prepare(load_task(str(task)), tmp_path / "out")
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


# --- `advisor data stats` on a damaged manifest ----------------------------------------------------------


@pytest.mark.parametrize("content", ['{"version": 1}', '{"version": 1, "task": "t", "seq_len": 8, '
                                     '"micro_batch_tokens": 64, "stages": [{"name": "s", "train": {"x": 1}}]}',
                                     '{"version": 1, "stages": 5}', "[1, 2]", "\x00\x01"])
def test_stats_on_a_damaged_manifest_is_one_line(tmp_path: Path, content: str) -> None:
    (tmp_path / "manifest.json").write_text(content)
    result = runner.invoke(app, ["data", "stats", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
