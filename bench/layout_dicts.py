"""The memory benches' layouts, written as short dicts (``world, zero, mbs, seq, gas, recompute,
method, dtype``), and the `specs.core.Layout` each one is: what `advisor train` runs for it
(trainer/timed_steps.py measures that). The model is the `demo-tiny` preset."""

from __future__ import annotations

from typing import Any

from specs.core import Layout
from presets import load_model
from trainer.engines import select_backend
from trainer.engines.plain import DDP_SETTINGS  # noqa: F401  (re-exported: the memory bench records it)

LayoutDict = dict[str, Any]

MODEL = load_model("demo-tiny")
LAYOUT_DEFAULTS: LayoutDict = {"world": 1, "zero": 0, "mbs": 1, "seq": 256, "gas": 1, "recompute": "none",
                               "method": "full", "dtype": "fp32"}


def normalize_layout(layout: LayoutDict) -> LayoutDict:
    """Fill the defaults in."""
    return {**LAYOUT_DEFAULTS, **layout}


def trainer_layout(layout: LayoutDict) -> Layout:
    """The `specs.core.Layout` of a layout dict."""
    full = normalize_layout(layout)
    return Layout(dp=full["world"], zero=full["zero"], mbs=full["mbs"], seq=full["seq"], gas=full["gas"],
                  recompute=full["recompute"], method=full["method"], dtype=full["dtype"])


def uses_deepspeed(layout: LayoutDict) -> bool:
    return select_backend(trainer_layout(layout)) == "deepspeed"
