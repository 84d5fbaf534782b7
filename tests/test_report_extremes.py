"""The run report is built from whatever a run dir holds: every figure drawn from 0, negative, tiny,
huge, inf and nan (a calibration factor at its bound, a diverged loss, an empty stage) still gives
the page, its Markdown twin and its charts, never an exception."""

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from reports.run_report import run_report

EXTREMES = st.sampled_from([0.0, -0.0, -1.0, 1e-12, 3.5, 1e15, 1e300, float("inf"), float("-inf"), float("nan")])
FIGURES = st.one_of(EXTREMES, st.floats(allow_nan=True, allow_infinity=True))


def _write(run_dir: Path, predicted: dict, measured: dict, losses: list[float], lrs: list[float],
           evals: list[float]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    stages = ["language", "reasoning"]
    metrics = [{"step": i + 1, "stage": stages[i * 2 // len(losses)], "loss": loss, "lr": lr, "grad_norm": loss,
                "tokens_per_s": measured["tokens_per_s"], "step_s": measured["step_s"]}
               for i, (loss, lr) in enumerate(zip(losses, lrs))]
    events = [{"event": "eval", "stage": stage, "step": len(losses), "losses": {"language": e, "reasoning": -e}}
              for stage, e in zip(stages, evals)]
    events.append({"event": "spike", "step": 1, "stage": "language", "loss": losses[0], "grad_norm": lrs[0]})
    # json.dumps writes NaN and Infinity, as Python's own writers of these files would
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = {"predicted": predicted, "measured": measured, "steps": len(losses), "finished": True,
               "stages": [{"name": s, "steps": len(losses) // 2, "final_loss": losses[-1]} for s in stages]}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    # `advisor run`'s files: the refit put micro_batch_overhead_s at its bound, exactly 0.0 (the crash)
    (run_dir / "verify.json").write_text(json.dumps({"chosen_rank": 1, "steps": 3, "trials": [
        {"rank": 1, "layout": "dp=1,mbs=4", "predicted_step_s": predicted["step_s"], "measured_step_s": measured["step_s"],
         "step_error": evals[0], "measured_tokens_per_s": measured["tokens_per_s"], "harness": "fork"}]}))
    (run_dir / "feedback.json").write_text(json.dumps({
        "profile": "p.json", "added": 1, "used": 2,
        "factors_before": {"gemm": evals[1], "micro_batch_overhead_s": 0.0},
        "factors_after": {"gemm": lrs[0], "micro_batch_overhead_s": 0.0},
        "error_before": lrs[1], "error_after": 0.0, "new_error_before": lrs[2]}))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    predicted=st.fixed_dictionaries({k: FIGURES for k in ("peak_bytes", "step_s", "tokens_per_s")}),
    measured=st.fixed_dictionaries({k: FIGURES for k in ("peak_bytes", "step_s", "tokens_per_s")}),
    losses=st.lists(FIGURES, min_size=2, max_size=6),
    lrs=st.lists(FIGURES, min_size=6, max_size=6),
    evals=st.lists(FIGURES, min_size=2, max_size=2),
)
def test_run_report_is_built_from_any_figures(tmp_path_factory, predicted, measured, losses, lrs, evals) -> None:
    run_dir = tmp_path_factory.mktemp("run")
    _write(run_dir, predicted, measured, losses, lrs, evals)
    _, document = run_report(run_dir)
    written = document.write(run_dir / "report", "run")
    assert (run_dir / "report" / "run.html").read_text().strip()
    assert (run_dir / "report" / "run.md").read_text().strip()
    assert all(p.stat().st_size > 0 for p in written)
