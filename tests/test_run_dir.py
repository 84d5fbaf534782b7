"""The run-dir contract (specs/run_dir.py): the tolerant JSON-lines reader, the typed events (every
event a real run writes reads as its record and is written back byte for byte), summary.json's
per-segment figures on a run with an out-of-memory fallback, `advisor run`'s refit reading the
segment its plan's layout trained, the docs' table, and no run-dir file name spelled outside the spec."""

from __future__ import annotations

import ast
import json
import statistics
from pathlib import Path

import pytest

from specs import run_dir as rd
from specs.plan_file import load_plan
from test_trainer import make_plan_file, read_jsonl
from trainer.loop import TrainOptions, train

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specs", "presets", "profiler", "planner", "trainer", "reports", "advisor")

# One record of each event, as the trainer and `advisor run` write them (key order included).
LAYOUT = "dp=1,tp=1,pp=1,zero=0,mbs=4,gas=1,recompute=none,dtype=fp32,seq=32"
WRITTEN = {
    "resume": [{"event": "resume", "from": None, "note": "no checkpoint yet: starting fresh"},
               {"event": "resume", "from": "step-00000002", "step": 2}],
    "torn_lines": [{"event": "torn_lines", "file": "metrics.jsonl", "skipped": 1}],
    "data": [{"event": "data", "source": "prepared", "dir": "/data/prepared"}],
    "length_changed": [{"event": "length_changed", "step": 4, "stage_steps": [4, 8], "was": [4, 4]}],
    "resharded": [{"event": "resharded", "from": "step-00000004", "saved_layout": LAYOUT, "layout": LAYOUT}],
    "moved_aside": [{"event": "moved_aside", "to": "/runs/x/previous-20261206T113000123456Z"}],
    "checkpoint": [{"event": "checkpoint", "step": 8, "stage": None, "path": "checkpoints/step-00000008",
                    "reason": "stage_end"}],
    "checkpoint_damaged": [{"event": "checkpoint_damaged", "path": "step-00000004", "problem": "no trainer.json"}],
    "stage_start": [{"event": "stage_start", "stage": "math", "step": 4, "steps": 4, "epochs": 2, "lr": 0.002,
                     "warmup_steps": 2, "rows": {"truncated": 0, "dropped": 0}}],
    "eval": [{"event": "eval", "stage": "a", "step": 4, "losses": {"a": 5.25}, "exact_match": {"a": None, "b": 0.5}},
             {"event": "eval", "stage": "a", "step": 4, "losses": {"a": 5.25}, "exact_match_note": "pipeline"}],
    "data_padding": [{"event": "data_padding", "stage": "a", "tokens": 90, "slots": 128, "padding_fraction": 0.296875,
                      "slots_unbucketed": 160, "padding_fraction_unbucketed": 0.4375, "slots_saved": 32}],
    "stage_end": [{"event": "stage_end", "stage": "a", "step": 4, "epochs": {"a:data/lang.jsonl": 0.02}}],
    "model": [{"event": "model", "stage": "a", "step": 4, "path": "stages/a/model", "kind": "full"}],
    "oom_fallback": [{"event": "oom_fallback", "step": 4, "stage": "a", "error": "out of memory", "failed": LAYOUT,
                      "replacement": None, "from": "step-00000002", "skipped": ["x: not runnable here"]},
                     {"event": "oom_fallback", "step": 4, "stage": "a", "error": "out of memory", "failed": LAYOUT,
                      "replacement": LAYOUT, "from": "step-00000002", "skipped": [], "relaunch": True}],
    "stop": [{"event": "stop", "reason": "more than 3 rollbacks"}],
    "spike": [{"event": "spike", "step": 27, "stage": "a", "loss": float("nan"), "grad_norm": 3.5, "reason": "nan"}],
    "rollback": [{"event": "rollback", "to": "step-00000025", "step": 25, "skipped": [104, 108], "lr_scale": 0.5,
                  "steps_back": 0, "discarded": []}],
    "segment_start": [{"event": "segment_start", "step": 0, "stage": "a", "layout": LAYOUT, "why": "start"}],
    "verify": [{"event": "verify", "rank": 1, "layout": LAYOUT, "predicted_step_s": 0.02,
                "predicted_tokens_per_s": 6000.0, "predicted_peak_bytes": 1569200, "harness": "loop", "threads": 2,
                "steps": 4, "measured_step_s": 0.3, "measured_tokens_per_s": 400.0, "steps_s": [0.5, 0.4, 0.3, 0.3],
                "peak_bytes": 1568288, "peak_source": "CPU allocator counter", "seconds": 3.5, "error": None}],
    "feedback": [{"event": "feedback", "profile": "/cache/profiles/host.json", "error_before": 0.4,
                  "error_after": 0.1, "factors_after": {"gemm": 0.5}}],
}


# -- the JSON-lines reader and writer -----------------------------------------------------------------

def test_reader_skips_a_torn_last_line_and_blank_lines_and_counts_only_the_torn(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n\n   \n{"step": 2, "loss": 2.25}\n[1, 2]\n{"step": 3, "lo')
    read = rd.read_json_lines(path)
    assert read.records == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]
    assert read.skipped == 2  # the torn line and the line that is not an object; blank lines are not counted
    assert rd.read_json_lines(tmp_path / "absent.jsonl") == rd.JsonLinesRead([], 0)


def test_writer_appends_whole_lines_and_truncation_drops_torn_and_later_lines(tmp_path) -> None:
    log = rd.JsonLines(tmp_path / "events.jsonl")
    log.write({"event": "stop", "reason": "x", "step": 1})
    with open(log.path, "a") as f:
        f.write('{"step": 2}\n\x00\x00{"st')  # a crash mid-append leaves NUL bytes and partial JSON
    assert rd.last_json_line(log.path) == {"step": 2}
    assert log.truncate_after(1) == 1
    assert log.path.read_text() == '{"event": "stop", "reason": "x", "step": 1}\n'
    rd.JsonLines(tmp_path / "off.jsonl", enabled=False).write({"a": 1})  # another rank: writes nothing
    assert not (tmp_path / "off.jsonl").exists()


# -- typed events -------------------------------------------------------------------------------------

def test_every_event_kind_reads_as_its_record_and_writes_back_byte_identically() -> None:
    assert set(WRITTEN) == set(rd.EVENT_NAMES)  # a fixture for every kind the code declares
    by_name = {cls.event_name(): cls for cls in rd.KNOWN_EVENTS}
    for name, records in WRITTEN.items():
        for record in records:
            typed = rd.parse_event(record)
            assert type(typed) is by_name[name], record
            assert json.dumps(rd.event_record(typed)) == json.dumps(record)


def test_unknown_or_unreadable_events_read_as_other_events_and_keep_their_fields() -> None:
    newer = rd.parse_event({"event": "warp_drive", "step": 3, "speed": 9})
    assert type(newer) is rd.OtherEvent and newer.event == "warp_drive" and newer.model_extra["speed"] == 9
    broken = rd.parse_event({"event": "model", "stage": "a", "step": 1, "path": "p", "kind": "half"})
    assert type(broken) is rd.OtherEvent and broken.event == "model"
    assert type(rd.parse_event({"type": "spike", "step": 1})) is rd.OtherEvent  # only `event` tells the kind


@pytest.fixture(scope="module")
def fallback_run(tmp_path_factory) -> tuple[Path, object, dict]:
    """A two-stage run of 4 steps each, checkpointing every 2 steps, whose step 4 runs out of memory:
    steps 1-2 train under the plan's layout, steps 3-8 under its first alternative."""
    root = tmp_path_factory.mktemp("fallback")
    plan = load_plan(make_plan_file(root, steps=4, checkpoint_every=2))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ADVISOR_INJECT_OOM", "step=4")
        summary = train(plan, root / "run", resume=False, options=TrainOptions(show_progress=False))
    return root / "run", plan, summary


def test_every_event_a_real_run_writes_validates_as_its_typed_record(fallback_run) -> None:
    run, _, _ = fallback_run
    lines = (run / rd.EVENTS_FILE).read_text().splitlines()
    kinds = set()
    for line in lines:
        typed = rd.parse_event(json.loads(line))
        assert type(typed) is not rd.OtherEvent, line
        assert json.dumps(rd.event_record(typed)) == line  # written through the record: byte for byte
        kinds.add(typed.event)
    assert {"checkpoint", "segment_start", "stage_start", "oom_fallback", "eval", "stage_end", "model"} <= kinds


# -- summary.json's segments and the refit ------------------------------------------------------------------

def _steady_median(step_times: list[float]) -> float:
    return statistics.median(step_times[2:] or step_times)


def test_summary_pairs_each_layouts_prediction_with_the_steps_it_trained(fallback_run) -> None:
    run, plan, summary = fallback_run
    metrics = read_jsonl(run / rd.METRICS_FILE)
    assert [m["step"] for m in metrics] == list(range(1, 9))
    chosen, fallback = plan.chosen, plan.alternatives[0]
    first, second = summary["segments"]
    assert (first["first_step"], first["last_step"], first["steps"]) == (1, 2, 2)
    assert (second["first_step"], second["last_step"], second["steps"]) == (3, 8, 6)
    assert first["layout"] == chosen.layout.short() and first["planned"] and first["why"] == "start"
    assert second["layout"] == fallback.layout.short() and not second["planned"] and second["why"] == "oom_fallback"
    assert second["stages"] == ["language", "math"]
    assert first["predicted"]["step_s"] == chosen.estimate.time.step_s
    assert second["predicted"]["step_s"] == fallback.estimate.time.step_s
    assert first["measured"]["step_s"] == _steady_median([m["step_s"] for m in metrics[:2]])
    assert second["measured"]["step_s"] == _steady_median([m["step_s"] for m in metrics[2:]])
    assert second["measured"]["peak_bytes"] == summary["measured"]["peak_bytes"]  # this launch's peak: the last
    assert first["measured"]["peak_bytes"] is None
    assert summary["predicted"]["step_s"] == chosen.estimate.time.step_s  # the whole-run keys stay


def test_advisor_runs_refit_reads_the_segment_its_plans_layout_trained(fallback_run) -> None:
    from advisor.cli.run_chain import _observations

    run, plan, summary = fallback_run
    [observed] = _observations(plan, None, summary, run, threads=0)
    first = summary["segments"][0]
    assert observed.layout == plan.chosen.layout and observed.steps == 2
    assert observed.step_s == first["measured"]["step_s"] != summary["measured"]["step_s"]
    assert observed.predicted_step_s == plan.chosen.estimate.time.step_s
    assert rd.matching_segment(summary, plan.alternatives[0].layout.short()) is None  # a fallback is no pair


# -- the docs and the names ------------------------------------------------------------------------------------

def test_contracts_md_holds_the_declared_files_table_and_events() -> None:
    doc = (ROOT / "docs" / "contracts.md").read_text()
    start = doc.index("<!-- run-dir files: generated from specs/run_dir.py, do not edit by hand -->\n")
    table = doc[doc.index("\n", start) + 1:doc.index("<!-- end of run-dir files -->")]
    assert table == rd.files_table()
    assert ", ".join(f"`{name}`" for name in rd.EVENT_NAMES) in doc


def _declared_names() -> tuple[set[str], set[str]]:
    files = {e.name for e in rd.ENTRIES if not e.folder} | {rd.CHECKPOINT_STATE_FILE}
    folders = {e.name for e in rd.ENTRIES if e.folder} - {rd.MODEL_DIR}  # `model` is also a common key
    return files, folders


def test_no_module_outside_the_spec_spells_a_run_dir_file_name() -> None:
    """Any string equal to a declared file name, and any `path / "<declared folder>"`, outside
    specs/run_dir.py: the name belongs in the spec."""
    files, folders = _declared_names()
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "specs" / "run_dir.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and node.value in files:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}")
                elif (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                      and isinstance(node.right, ast.Constant) and node.right.value in folders):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} / {node.right.value!r}")
    assert not found, found


def test_run_report_shows_each_segments_prediction_against_its_steps(fallback_run, tmp_path) -> None:
    from reports.run_report import run_report

    run, plan, summary = fallback_run
    _, document = run_report(run)
    markdown = next(p for p in document.write(tmp_path / "report", "run") if p.suffix == ".md").read_text()
    rows = [line for line in markdown.splitlines() if line.startswith(("| 1-2 |", "| 3-8 |"))]
    assert len(rows) == 2
    assert f"| {plan.chosen.layout.short()} | start | 2 |" in rows[0]
    assert f"| {plan.alternatives[0].layout.short()} | oom_fallback (not the plan's) | 6 |" in rows[1]
