"""One prepared script for a lent GPU: the CUDA/NCCL paths, then predicted against measured memory
and step time of a ~1B Llama through `advisor train`'s own engines. Under 8 minutes on one GPU.

    python -m bench.gpu_check [--quick] [--steps 8] [--profile P] [--no-write]
    python -m bench.gpu_check --cpu-smoke      # the same code on CPU with a tiny model (tests run this)

1. Checks: CUDA visible, NCCL available, bf16 supported (the ZeRO-Offload row runs an NCCL group).
2. `advisor profile --quick --device cuda --model llama-1b.json` (skipped with --profile P).
3. Each layout of LAYOUTS (mbs, seq, recomputation, LoRA, QLoRA, DeepSpeed ZeRO-Offload on one
   device) runs `trainer.timed_steps.time_layout`: the trainer's model, engine and optimizer step,
   random tokens, the median step after the warm-up, the peak of `torch.cuda.max_memory_allocated`
   over the steps. The prediction is the cost model's (`planner.cost_model.estimate`) on the profile.
   A layout the capability declaration does not run on CUDA is listed as skipped, with the reason.
4. The table goes to docs/benchmarks.md (section `gpu_check`) unless --no-write.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# TinyLlama-1.1B's architecture (1.10 B parameters): hidden 2048, 22 layers, GQA 32/4, vocab 32000.
LLAMA_1B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu",
}
TINY = {**LLAMA_1B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}
LAYOUTS = [
    "mbs=1,gas=1,seq=2048",
    "mbs=4,gas=1,seq=1024",
    "mbs=2,gas=2,seq=2048,recompute=selective",
    "mbs=4,gas=1,seq=2048,recompute=full",
    "mbs=4,gas=1,seq=2048,method=lora",
    "mbs=4,gas=1,seq=2048,method=qlora",
    "mbs=2,gas=1,seq=2048,zero=2,offload=optimizer",  # DeepSpeed's CPU Adam builds on first use: last
]
SMOKE_LAYOUTS = ["mbs=2,gas=2,seq=64", "mbs=2,gas=1,seq=64,recompute=full"]
BUDGET_S = 7 * 60  # stop starting new layouts after this, so the whole check stays under 8 minutes


def check_paths() -> list[str]:
    """The CUDA and NCCL paths the trainer's workers use, each as a line of the report."""
    import torch
    import torch.distributed as dist

    lines = [f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}",
             f"bf16 supported: {torch.cuda.is_bf16_supported()}", f"NCCL available: {dist.is_nccl_available()}"]
    return lines


def profile(config: Path, out: Path, quick: bool) -> Path:
    from typer.testing import CliRunner

    from advisor.cli import app

    command = ["profile", "--model", str(config), "--out", str(out), "--device", "cuda", "--nproc", "1"]
    result = CliRunner().invoke(app, command + (["--quick"] if quick else []))
    print(result.output)
    if result.exit_code != 0:
        raise SystemExit(f"advisor profile failed (exit {result.exit_code})")
    return out


def row(index: int, text: str, model, hardware, steps: int, warmup: int, device_type: str) -> str:
    from advisor.capabilities import config_shape, runnable_problem
    from advisor.specs import resolve_layout
    from planner.cost_model import estimate
    from trainer.timed_steps import time_layout

    layout = resolve_layout(text, 1, hardware)
    problem = runnable_problem(layout, config_shape(model.hf_config), device_type)
    if problem:
        return f"| {index} | {text} | skipped: {problem} | | | | |"
    predicted = estimate(model, hardware, layout, attention="sdpa")
    measured = time_layout(model, layout, steps=steps, warmup=warmup)
    peak = measured.peak_bytes
    peak_text = (f"{peak / 2**30:.2f} GiB | {predicted.memory.peak / 2**30:.2f} GiB | "
                 f"{100 * (predicted.memory.peak / peak - 1):+.1f}%") if peak else "n/a (CPU) | | "
    return (f"| {index} | {text} | {measured.step_s * 1e3:.1f} ms | {predicted.time.step_s * 1e3:.1f} ms | "
            f"{100 * (predicted.time.step_s / measured.step_s - 1):+.1f}% | {peak_text} |")


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, help="reuse this profile instead of profiling first")
    parser.add_argument("--quick", action="store_true", help="advisor profile --quick")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: the code path, no figures")
    args = parser.parse_args(argv)

    import torch

    from advisor.specs import ModelSpec
    from presets import load_hardware

    started = time.perf_counter()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_check.py needs a CUDA device (or --cpu-smoke)")
    config = TINY if smoke else LLAMA_1B
    model = ModelSpec(name="llama-1b" if not smoke else "tiny-llama", hf_config=config)
    lines = ["cpu smoke run"] if smoke else check_paths()
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp, "config.json")
        config_path.write_text(json.dumps(config))
        if smoke:
            hardware = load_hardware("cpu")
        else:
            path = args.profile or profile(config_path, Path(tmp, "gpu_profile.json"), args.quick)
            hardware = load_hardware(str(path))
        rows = ["| # | layout (bf16, 1 device) | measured step | predicted step | error | measured peak | "
                "predicted peak | error |", "|---|---|---|---|---|---|---|---|"]
        for index, text in enumerate(SMOKE_LAYOUTS if smoke else LAYOUTS, 1):
            if time.perf_counter() - started > BUDGET_S:
                rows.append(f"| {index} | {text} | not run: the {BUDGET_S // 60}-minute budget was spent | | | | | |")
                continue
            rows.append(row(index, text, model, hardware, 3 if smoke else args.steps, 1 if smoke else args.warmup,
                            "cpu" if smoke else "cuda"))
            print(rows[-1], flush=True)
    body = "\n".join(lines + [""] + rows) + (
        f"\n\nTotal {time.perf_counter() - started:.0f} s. Measured through trainer.timed_steps (the trainer's "
        "model, engine and optimizer step): median step after the warm-up; peak = torch.cuda.max_memory_allocated "
        "over the steps. Predicted: planner.cost_model.estimate on the profile, attention sdpa.")
    print(body)
    if not (args.no_write or smoke):
        from benchmarks_md import write_section

        write_section("gpu_check", "Step time and memory on CUDA: predicted against measured (Llama 1.1B)",
                      "python -m bench.gpu_check", body)
    return rows


if __name__ == "__main__":
    main()
