"""`advisor data prepare --executor ray` runs the same scan tasks on Ray (a local instance started in
this process, 2 CPUs), resumes from the completion markers a local scan left, and writes byte for
byte the shards that `--executor local` writes; a part that fails on Ray stops the prepare with
that part's own one-line error.

Skipped only when Ray cannot be imported or cannot start on this machine (the reason is printed).
Ray starts once for the whole file (several seconds); each part then starts a fresh Ray worker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from advisor.cli import app
from presets import load_task
from test_data_resume import comparable_manifest, output_files, write_corpus
from trainer.data.prepare import prepare

ROWS_PER_PART = 120  # 2 files of 240 rows: 4 parts, 2 at a time on the 2 Ray CPUs
# datatrove 0.10.1 passes Ray's placement group the older way, which Ray 2.60 still accepts
pytestmark = pytest.mark.filterwarnings("ignore:placement_group:DeprecationWarning")


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[None]:
    try:
        import ray
    except ImportError as exc:
        pytest.skip(f"ray cannot be imported: {exc}")
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    except Exception as exc:  # whatever keeps Ray from starting here: the reason goes in the skip
        pytest.skip(f"ray.init() failed on this machine: {type(exc).__name__}: {exc}")
    yield
    ray.shutdown()


def scan_first_parts_locally(task: Path, out: Path, count: int) -> None:
    """The first `count` scan tasks of the prepare of `out`, run by datatrove's local executor into
    the work folder that prepare will use, as a local prepare stopped after them leaves it."""
    from datatrove.executor.local import LocalPipelineExecutor

    from trainer.data.pipeline import scan_steps
    from trainer.data.prepare import _context, _scan_job

    entries, units, ctx = _context(load_task(str(task)), None, False, 1, ROWS_PER_PART)
    job, _ = _scan_job(entries, units, ctx, out.resolve())
    LocalPipelineExecutor(scan_steps(job), tasks=len(job.parts), local_tasks=count, workers=1,
                          logging_dir=str(job.work / "datatrove")).run()


def test_ray_resumes_a_local_scan_and_writes_the_shards_and_manifest_that_local_writes(
        tmp_path: Path, ray_instance: None) -> None:
    task = write_corpus(tmp_path)
    local, local_manifest = prepare(load_task(str(task)), tmp_path / "local", rows_per_part=ROWS_PER_PART, workers=2)
    ray_out = tmp_path / "ray"
    scan_first_parts_locally(task, ray_out, 2)
    result = CliRunner().invoke(app, ["data", "prepare", "--task", str(task), "--out", str(ray_out),
                                      "--executor", "ray", "--workers", "2", "--rows-per-part", str(ROWS_PER_PART)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "resuming: 2 of 4 parts were scanned before" in said and "on 2 Ray worker(s)" in said, said
    assert output_files(ray_out) == output_files(local)
    assert comparable_manifest(ray_out) == comparable_manifest(local)
    # the corpus's planted duplicates (40 exact copies, 20 one-space-and-a-word edits) are what was dropped
    dropped = json.loads((ray_out / "manifest.json").read_text())["stages"][0]["train"]["dropped"]
    assert dropped == local_manifest["stages"][0]["train"]["dropped"] == {"exact_duplicate": 40, "near_duplicate": 20}
    assert not list(tmp_path.glob(".ray.*")), "the scan's work folder and the aside folder are gone"


def test_a_bad_row_in_a_ray_part_is_its_one_line_error(tmp_path: Path, ray_instance: None) -> None:
    task = write_corpus(tmp_path)
    lines = (tmp_path / "c1.jsonl").read_text().splitlines(keepends=True)
    lines[200] = json.dumps({"text": 7}) + "\n"  # row 201 of c1.jsonl, one part a file
    (tmp_path / "c1.jsonl").write_text("".join(lines))
    result = CliRunner().invoke(app, ["data", "prepare", "--task", str(task), "--out", str(tmp_path / "o"),
                                      "--executor", "ray", "--rows-per-part", "240"])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert "c1.jsonl, line 201 (row 201): field 'text' is int, not a string" in last, result.output
    assert not list(tmp_path.glob(".o.*")), "neither the output's temp folder nor the scan's parts are left"
