"""Calibration on real steps: `advisor profile`'s measuring (the trainer's step harness) and the
planner's fit, on a Llama-family config that is not a preset and that nothing was tuned on.

The truth is the machine itself. The fit starts from a profile whose efficiencies are far off (a
third of the preset's GEMM and memory rates, as a wrong datasheet or a throttled device would give);
it must explain the steps it was fitted on, and predict a layout it never saw. Switching the fit off
(the factors stay wrong) or breaking it fails both."""

from __future__ import annotations

import pytest

from advisor.cli.compose import _time_layout_steps
from advisor.specs import Layout, ModelSpec
from planner.calibration import calibrate
from planner.cost_model import estimate_from_trace
from profiler.calibration_steps import measure_calibration_steps
from profiler.model_trace import trace_model
from test_profile import synthetic_profile

# 384 wide, GQA, a 6k vocabulary, untied: unlike demo-tiny (256 wide, 2k vocabulary)
MODEL = ModelSpec(name="llama-384-untuned", hf_config={
    "model_type": "llama", "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 6,
    "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 6000, "max_position_embeddings": 512,
    "tie_word_embeddings": False})
THREADS = 2


def _far_off_profile():
    profile = synthetic_profile()
    eff = profile.hardware.efficiency
    wrong = eff.model_copy(update={"gemm": eff.gemm / 3, "memory_bandwidth": eff.memory_bandwidth / 3})
    return profile.model_copy(update={"hardware": profile.hardware.model_copy(update={"efficiency": wrong})})


@pytest.mark.slow
def test_calibration_fitted_on_real_steps_explains_them_and_predicts_a_held_out_layout() -> None:
    measured = measure_calibration_steps(MODEL, devices=1, threads=THREADS, quick=True,
                                         step_runner=_time_layout_steps, steps=6)
    fitted = calibrate(_far_off_profile(), measured)

    before = [abs(s.predicted_before_s / s.measured_s - 1) for s in fitted.calibration.steps]
    after = [abs(s.predicted_after_s / s.measured_s - 1) for s in fitted.calibration.steps]
    assert min(before) > 0.5, before  # the start is wrong on every step
    assert max(after) < 0.25, after

    held_out = Layout(mbs=2, gas=2, seq=192, dtype="fp32")  # not one of the fit's layouts
    real = _time_layout_steps(held_out, steps=6, hf_config=measured.small.hf_config, threads=THREADS, warmup=3)
    trace = trace_model(measured.small, held_out.seq, dtype="fp32", device_type="cpu")
    predicted = estimate_from_trace(trace, held_out, fitted.hardware).time.step_s
    assert abs(predicted / real["step_s"] - 1) < 0.35, (predicted, real["step_s"])
