"""Pre-trace the preset models for the shapes people ask about first, into `presets/traces`.

A cold `advisor estimate` otherwise spends seconds importing transformers before it can trace.
The store is keyed by torch/peft major.minor and the transformers major version; other versions
trace afresh. Rerun after changing a model preset or what a trace records:

    python -m profiler.ship_traces
"""

from __future__ import annotations

import itertools

from presets import load_model, preset_names
from profiler.model_trace import SHIPPED_DIR, ship_trace

SEQS = (2048, 4096, 8192)
METHODS = ("full", "lora", "qlora")


def main() -> None:
    for old in SHIPPED_DIR.glob("*.json"):
        old.unlink()
    count = 0
    for name in preset_names("models"):
        model = load_model(name)
        if name == "demo-tiny":  # the embedded demo runs on this CPU in fp32, planned on packed rows
            for seq, method, packed in itertools.product((256, 512, 1024), ("full", "lora"), (False, True)):
                ship_trace(model, seq, "fp32", method, device_type="cpu", packed=packed)
                count += 1
            continue
        for seq, method in itertools.product(SEQS, METHODS):
            ship_trace(model, seq, "bf16", method)
            count += 1
        print(f"{name}: traced", flush=True)
    print(f"wrote {count} traces to {SHIPPED_DIR}")


if __name__ == "__main__":
    main()
