"""`advisor data prepare` killed outright midway (SIGKILL, after a set number of scanned parts), then
run again with the same command, writes what an uninterrupted prepare writes, reusing the parts
the killed run finished; and the executor flags are checked in one line."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import yaml
from typer.testing import CliRunner

from advisor.cli import app
from presets import load_task
from trainer.data.prepare import prepare

ROWS_PER_PART = 30
KILL_AFTER = 3


def write_corpus(folder: Path) -> Path:
    """Two JSON-lines files of 240 rows (8 parts each), with exact and near duplicates across them."""
    rng = random.Random(11)
    vocab = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 8))) for _ in range(800)]
    docs = [" ".join(rng.choice(vocab) for _ in range(rng.randint(20, 70))) for _ in range(420)]
    rows = docs + docs[:40] + [d.replace(" ", "  ", 1) + " extra" for d in docs[40:60]]
    rng.shuffle(rows)
    for k in range(2):
        (folder / f"c{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in rows[k * 240:(k + 1) * 240]))
    task = {"name": "resume", "model": "demo-tiny", "seq_len": 64, "data": {"filters": {"min_tokens": 1}},
            "stages": [{"name": "only", "tokens": 1000, "sources": [{"path": "c0.jsonl"}, {"path": "c1.jsonl"}]}]}
    (folder / "task.yaml").write_text(yaml.safe_dump(task))
    return folder / "task.yaml"


def prepare_command(task: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "advisor.cli", "data", "prepare", "--task", str(task), "--out", str(out),
            "--workers", "2", "--rows-per-part", str(ROWS_PER_PART)]


def run_command(command: list[str], env: dict[str, str], log: Path) -> subprocess.CompletedProcess:
    """Run in its own process group, and end whatever of it is left (datatrove's pool, its
    forkserver) once the prepare itself has exited, as a kill -9 of the whole job would. Output
    goes to a file: a pipe would stay open as long as any of those processes lives."""
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return subprocess.CompletedProcess(command, proc.returncode, log.read_text(), log.read_text())


def output_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()
            and p.name != "manifest.json"}


def comparable_manifest(out: Path) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    return {k: v for k, v in manifest.items() if k not in ("created", "seconds")}


def test_a_prepare_killed_midway_resumes_to_the_uninterrupted_output(tmp_path: Path) -> None:
    task = write_corpus(tmp_path)
    whole, _ = prepare(load_task(str(task)), tmp_path / "whole", rows_per_part=ROWS_PER_PART)
    out = tmp_path / "resumed"
    env = {**os.environ, "ADVISOR_PREPARE_KILL_AFTER_PARTS": str(KILL_AFTER)}
    killed = run_command(prepare_command(task, out), env, tmp_path / "killed.log")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists()
    work = list(tmp_path.glob(".resumed.scan-*"))
    assert len(work) == 1
    finished = len(list((work[0] / "datatrove" / "completions").iterdir()))
    assert KILL_AFTER <= finished < 16  # killed before the next part: never all of them
    check_partial_stats(out, work[0], finished)

    env.pop("ADVISOR_PREPARE_KILL_AFTER_PARTS")
    again = run_command(prepare_command(task, out), env, tmp_path / "again.log")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resuming: {finished} of 16 parts were scanned before" in " ".join(again.stderr.split())
    assert output_files(out) == output_files(whole)
    assert comparable_manifest(out) == comparable_manifest(whole)
    assert not list(tmp_path.glob(".resumed.scan-*"))


def check_partial_stats(out: Path, work: Path, finished: int) -> None:
    """`advisor data stats` on the killed prepare (its output folder, its work folder or the folder it
    was writing aside) reports the parts finished of 16 and their rows (every part is 30 rows)."""
    (aside,) = out.parent.glob(f".{out.name}.tmp-*")
    for where in (out, work, aside):
        result = CliRunner().invoke(app, ["data", "stats", str(where), "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["partial"] is True and report["phase"] == "scanning" and report["work"] == str(work)
        assert report["parts"] == {"done": finished, "total": 16}
        assert report["rows_scanned"] == finished * ROWS_PER_PART and report["rows_total"] == 480
        assert [s["parts"] for s in report["sources"]] == [8, 8]
        assert sum(s["rows_scanned"] for s in report["sources"]) == finished * ROWS_PER_PART
        assert report["kept"] is None and report["dropped"] is None  # judged only once the scan is whole
    table = CliRunner().invoke(app, ["data", "stats", str(out)])
    assert table.exit_code == 0 and "PARTIAL" in table.output and f"{finished}/16" in table.output, table.output


def test_stats_of_a_folder_that_is_neither_prepared_nor_partial_is_one_line(tmp_path: Path) -> None:
    (tmp_path / ".other.scan-0123abcd").mkdir()  # another output's work folder is not this one's
    result = CliRunner().invoke(app, ["data", "stats", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "no manifest.json" in lines[0] and "nor is a prepare" in lines[0], result.output


def test_executor_and_workers_flags_are_checked_in_one_line(tmp_path: Path) -> None:
    task = write_corpus(tmp_path)
    runner = CliRunner()
    for flags, message in ((["--ray-address", "auto"], "--ray-address goes with --executor ray"),
                           (["--executor", "dask"], "unknown"), (["--workers", "0"], "--workers 0")):
        result = runner.invoke(app, ["data", "prepare", "--task", str(task), "--out", str(tmp_path / "o"), *flags])
        assert result.exit_code == 2, (flags, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (flags, result.output)


def test_a_bad_row_in_a_workers_part_is_one_line_and_leaves_no_parts(tmp_path: Path) -> None:
    task = write_corpus(tmp_path)
    lines = (tmp_path / "c1.jsonl").read_text().splitlines(keepends=True)
    lines[200] = json.dumps({"text": 7}) + "\n"  # row 201, in the 7th part of the file
    (tmp_path / "c1.jsonl").write_text("".join(lines))
    result = CliRunner().invoke(app, ["data", "prepare", "--task", str(task), "--out", str(tmp_path / "o"),
                                      "--workers", "2", "--rows-per-part", str(ROWS_PER_PART)])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert "c1.jsonl, line 201 (row 201): field 'text' is int, not a string" in last, result.output
    assert not list(tmp_path.glob(".o.*")), "neither the output's temp folder nor the scan's parts are left"


def test_parts_read_domains_times_and_grades_as_a_whole_file_read_does(tmp_path: Path) -> None:
    """A file cut into parts (parsed by pyarrow range by range) gives what one whole-file read
    (`datasets`) gives, fields included: domains renumbered in first-seen order across parts, ISO
    dates, a numeric difficulty field; split by domain so that the shards show every domain."""
    rng = random.Random(5)
    rows = [{"text": " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"]) for _ in range(rng.randint(5, 40))),
             "site": rng.choice(["news", "blog", "wiki"]) if i > 50 else "forum",  # a domain first seen in part 3
             "date": f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", "level": rng.randint(0, 9)}
            for i in range(150)]
    (tmp_path / "fields.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"name": "fields", "model": "demo-tiny", "seq_len": 64,
            "data": {"filters": {"min_tokens": 1}, "dedup": {"near": False},
                     "difficulty": {"by": "field", "field": "level", "edges": [3, 6]}},
            "stages": [{"name": "only", "tokens": 1000, "split_by": "domain",
                        "sources": [{"path": "fields.jsonl", "domain_field": "site", "time_field": "date",
                                     "time_window": ["2024-02-01", "2024-11-01"]}]}]}
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    whole, whole_manifest = prepare(load_task(str(tmp_path / "task.yaml")), tmp_path / "whole")
    parts, parts_manifest = prepare(load_task(str(tmp_path / "task.yaml")), tmp_path / "parts", rows_per_part=20)
    assert output_files(parts) == output_files(whole)
    assert comparable_manifest(parts) == comparable_manifest(whole)
    groups = set(whole_manifest["stages"][0]["train"]["groups"])
    assert groups == {"forum", "news", "blog", "wiki"}
    assert whole_manifest["stages"][0]["train"]["dropped"].get("selection:time", 0) > 0


def test_a_one_worker_scan_encodes_on_one_core_and_gives_the_process_its_setting_back(
        tmp_path: Path, monkeypatch) -> None:
    """`--workers N` uses N cores: the in-process task of a 1-worker scan encodes with the
    tokenizer's thread pool off (as each pool, Slurm or Ray worker does), and the prepare's
    process has its own setting again afterwards."""
    from trainer.data import pipeline

    seen = []
    real = pipeline.scan_part

    def scan_part(*args, **kwargs):
        seen.append((os.getpid(), os.environ.get("TOKENIZERS_PARALLELISM")))
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "scan_part", scan_part)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    task = load_task(write_corpus(tmp_path))
    prepare(task, tmp_path / "out", workers=1, rows_per_part=ROWS_PER_PART)
    assert len(seen) == 16 and set(seen) == {(os.getpid(), "false")}
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"
