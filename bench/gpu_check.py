"""On a CUDA machine: profile it, then check predicted against measured step time of a ~1B Llama.

Not run on the CPU-only development machines (it needs a GPU); written to run as is on one node:

    python -m bench.gpu_check [--nproc 1] [--steps 12] [--quick] [--out gpu_profile.json]

1. `advisor profile --model llama-1b.json --out PROFILE` (the same profile as on CPU: inventory,
   GEMM per dtype over the model's shapes, memory and host<->device bandwidth, CPU Adam,
   collectives when --nproc > 1). Calibration steps run on CPU only for now, so the efficiency
   factors stay 1.0 of the measured rates: the table below is the uncalibrated accuracy.
2. Real steps on GPU 0: the model built from its config (random init, fp32 master weights,
   bf16 autocast, SDPA attention, fused AdamW), STEPS optimizer steps per layout, median after
   WARMUP steps, timed with CUDA events' wall-clock equivalent (synchronize + perf_counter).
3. `advisor estimate --hardware PROFILE --layout dp=1,...,dtype=bf16 --attention sdpa --json`.

Writes a table to docs/benchmarks.md (section `gpu_check`) unless --no-write.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# TinyLlama-1.1B's architecture (1.10 B parameters): hidden 2048, 22 layers, GQA 32/4, vocab 32000.
LLAMA_1B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
LAYOUTS = [
    "dp=1,mbs=1,seq=2048",
    "dp=1,mbs=2,seq=2048",
    "dp=1,mbs=4,seq=1024",
    "dp=1,mbs=4,seq=2048,recompute=full",
    "dp=1,mbs=8,seq=1024,method=lora",
]


def parse(text: str) -> dict:
    fields = dict(kv.split("=") for kv in text.split(","))
    return {"mbs": int(fields["mbs"]), "seq": int(fields["seq"]), "recompute": fields.get("recompute", "none"),
            "method": fields.get("method", "full")}


def measure(layout: dict, steps: int, warmup: int) -> float:
    """Median seconds of one optimizer step of the 1B model on cuda:0 (bf16 autocast, fused AdamW)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda:0")
    torch.manual_seed(0)
    cfg = dict(LLAMA_1B)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    if layout["recompute"] == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if layout["method"] == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, fused=True)
    ids = torch.randint(0, LLAMA_1B["vocab_size"], (layout["mbs"], layout["seq"]), device=device)
    times = []
    for _ in range(steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    del model, optimizer, trainable, ids, loss
    torch.cuda.empty_cache()
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_profile.json"))
    parser.add_argument("--profile", type=Path, help="reuse this profile instead of profiling first")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()

    import torch
    from typer.testing import CliRunner

    from advisor.cli import app

    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_check.py needs a CUDA device (torch.cuda.is_available() is False)")
    runner = CliRunner()
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp, "config.json")
        config_path.write_text(json.dumps(LLAMA_1B))
        profile_path = args.profile
        if profile_path is None:
            profile_path = args.out
            command = ["profile", "--model", str(config_path), "--out", str(profile_path), "--device", "cuda",
                       "--nproc", str(args.nproc)] + (["--quick"] if args.quick else [])
            started = time.perf_counter()
            result = runner.invoke(app, command)
            print(result.output)
            if result.exit_code != 0:
                raise SystemExit(f"advisor profile failed (exit {result.exit_code})")
            print(f"profiled in {time.perf_counter() - started:.0f} s")
        rows = ["| # | layout (Llama 1.1B, bf16) | measured step | predicted step | error | predicted MFU |",
                "|---|---|---|---|---|---|"]
        for i, text in enumerate(LAYOUTS, 1):
            measured = measure(parse(text), args.steps, args.warmup)
            result = runner.invoke(app, ["estimate", "--model", str(config_path), "--hardware", str(profile_path),
                                         "--layout", f"{text},dtype=bf16", "--attention", "sdpa", "--json"])
            if result.exit_code != 0:
                raise SystemExit(result.output)
            predicted = json.loads(result.stdout)
            step = predicted["time"]["step_s"]
            rows.append(f"| {i} | {text} | {measured * 1e3:.1f} ms | {step * 1e3:.1f} ms | "
                        f"{100 * (step / measured - 1):+.1f}% | {100 * predicted['throughput']['mfu']:.0f}% |")
            print(rows[-1], flush=True)
    body = "\n".join(rows) + (
        f"\n\nDevice: {torch.cuda.get_device_name(0)}; profile {profile_path} (efficiency factors not "
        "calibrated on CUDA yet). Measured: median of steps after the warm-up, fp32 master weights, "
        "bf16 autocast, fused AdamW, SDPA.")
    if not args.no_write:
        from benchmarks_md import write_section

        write_section("gpu_check", "Step time on CUDA: predicted against measured (Llama 1.1B)",
                      "python -m bench.gpu_check", body)


if __name__ == "__main__":
    main()
