"""The five rows the project measured on an H200 (docs/evidence/h200/gpu_check-3-mha-preset.txt),
priced from the `h200-141g` preset: step within 15%, peak within 5% (issue 29).

Rows 1 and 2 set the preset's host time per kernel (`host_op_s`: 30.8 and 31.6 us), so they check
that one figure holds both; rows 3-5 are predictions. The rows were measured through the trainer as
it stood before issue 28: the plain engine cast the
model to bf16 and ran Adam on it (no fp32 master) with TF32 off, which `specs.capabilities`
keeps as the priced-only engine `plain-pure16`; ZeRO-2 with offload ran on DeepSpeed as it still
does. TinyLlama's architecture with 32 key-value heads (the GQA model could not be traced then),
attention priced as SDPA, as bench/gpu_check.py priced it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specs.engine_traits import PURE16_PLAIN
from specs.core import ModelSpec, resolve_layout
from bench.gpu_check import LLAMA_1B
from planner.cost_model import estimate
from presets import load_hardware

EVIDENCE = Path(__file__).resolve().parents[1] / "docs" / "evidence" / "h200" / "gpu_check-3-mha-preset.txt"
TINYLLAMA_MHA = {**LLAMA_1B, "num_key_value_heads": 32}  # the MHA variant the evidence measured
STEP_BOUND, PEAK_BOUND = 0.15, 0.05
# What this session's pricing still misses, each failing its bound as measured (strict: a fix must drop it)
KNOWN_MISSES = {
    (3, "step"): "LoRA priced 31% fast (194 ms against 281 measured): bound by peft's fp32 element-wise "
                 "traffic (414 GB counted, 96 ms) and its 3,600 short launches (111 ms), it took ~90 ms more; "
                 "suspect: the adapters' weight-gradient GEMMs (an in x 16 output over 8,192 tokens) keep a "
                 "few of the 132 SMs busy (bench/gpu_check.py times them)",
    (4, "step"): "QLoRA priced 20% fast (399 ms against 502 measured): the same ~100 ms as LoRA's",
}


def evidence_rows() -> list[tuple[int, str, float, float]]:
    """(row, layout, measured step in seconds, measured peak in bytes) of the evidence's table."""
    rows = {}
    for line in EVIDENCE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].isdigit() and cells[2].endswith(" ms"):
            peak = float(re.sub(" GiB$", "", cells[5])) * 2**30
            rows[int(cells[0])] = (int(cells[0]), cells[1], float(cells[2].removesuffix(" ms")) / 1e3, peak)
    return [rows[k] for k in sorted(rows)]


def _priced(layout_text: str):
    hardware = load_hardware("h200-141g")
    layout = resolve_layout(layout_text, 1, hardware)
    engine = "auto" if layout.zero else PURE16_PLAIN
    return estimate(ModelSpec(name="tinyllama-mha", hf_config=TINYLLAMA_MHA), hardware, layout,
                    attention="sdpa", engine=engine)


def test_the_evidence_holds_five_rows() -> None:
    rows = evidence_rows()
    assert [r[0] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0][1] == "mbs=1,gas=1,seq=2048" and rows[0][2] == pytest.approx(0.0929)


def _cases() -> list:
    cases = []
    for row, layout, step, peak in evidence_rows():
        for quantity, measured, bound in (("step", step, STEP_BOUND), ("peak", peak, PEAK_BOUND)):
            marks = [pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[(row, quantity)])] \
                if (row, quantity) in KNOWN_MISSES else []
            cases.append(pytest.param(layout, quantity, measured, bound, id=f"row{row}-{quantity}", marks=marks))
    return cases


@pytest.mark.parametrize("layout, quantity, measured, bound", _cases())
def test_evidence_row_is_priced_within_its_bound(layout: str, quantity: str, measured: float, bound: float) -> None:
    priced = _priced(layout)
    predicted = priced.time.step_s if quantity == "step" else priced.memory.peak
    assert abs(predicted / measured - 1) <= bound, f"{layout} {quantity}: {predicted:.4g} vs {measured:.4g}"
