"""One prepared script for a lent GPU: the CUDA/NCCL paths, the profile's rates beside plain
torch's, then predicted against measured memory and step time of a ~1B GQA Llama (and an 8B one
where the card holds it) through `advisor train`'s own engines, packed rows on the document kernel,
and `advisor run` as a user starts it. Under 8 minutes on one GPU.

    python -m bench.gpu_check [--quick] [--steps 8] [--profile P] [--no-write] [--no-run]
    python -m bench.gpu_check --cpu-smoke      # the same code on CPU with a tiny model (tests run this)

1. Checks: CUDA visible, NCCL available, bf16 supported (the ZeRO-Offload row runs an NCCL group).
2. `advisor profile --quick --device cuda --model llama-1b.json` (skipped with --profile P), and
   plain torch's warm bf16 GEMM at 8192^3 and device copy rate beside the profile's (`reference_rates`).
3. Each layout of LAYOUTS (mbs, seq, recomputation, LoRA, QLoRA, DeepSpeed ZeRO-Offload on one
   device), then LAYOUTS_DENSE (8 of Llama-3-8B's layers, with and without recomputation, and at seq 4096) and
   LAYOUTS_8B where the cost model says they fit, runs `trainer.timed_steps.time_layout`:
   the trainer's model, engine and optimizer step, random tokens, the median step after the warm-up,
   the peak of `torch.cuda.max_memory_allocated` over the steps. The prediction is the cost model's
   (`planner.cost_model.estimate`) on the profile. A layout the capability declaration does not run
   on CUDA is listed as skipped, with the reason.
4. Packed rows (4 documents a row) through the trainer's attention kernel (trainer/attention.py:
   varlen FlashAttention on CUDA) against SDPA under transformers' document mask: the largest
   output difference, each one's time and peak (`packed_rows`).
5. `advisor run` with no options but a step cap (the demo), its predicted and measured step.
6. The tables go to docs/benchmarks.md (section `gpu_check`) unless --no-write.
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
# Llama-3-8B's architecture (8.03 B parameters): hidden 4096, 32 layers, GQA 32/8, vocab 128256.
LLAMA_8B = {**LLAMA_1B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0}
# 16 bytes of model state per parameter (bf16-mixed): an 80 GB card holds an 8B full fine-tune only
# with its optimizer offloaded, a 141 GB one with full recomputation
LAYOUTS_8B = ["mbs=1,gas=1,seq=2048,recompute=full", "mbs=1,gas=1,seq=2048,method=lora,recompute=full"]
# 8 of Llama-3-8B's layers (2.8 B parameters), compute-bound at micro-batch 4: the published FSDP runs
# on H100s are priced 15-35% fast, most of all without recomputation (bench/published_bench.py), where
# eager dense steps on an H200 were within about 7%; these rows time the same layers both ways on one card
LLAMA_8B_SLICE = {**LLAMA_8B, "num_hidden_layers": 8}
# the third: the same 8,192 tokens at fms-fsdp's and Megatron-Core's H100 sequence (4096), where the
# published H100 rows sit furthest above the presets' price (docs/benchmarks.md, published bench)
LAYOUTS_DENSE = ["mbs=4,gas=1,seq=2048", "mbs=4,gas=1,seq=2048,recompute=full", "mbs=2,gas=1,seq=4096"]
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


def _warm_min_s(call, device_type: str, samples: int = 10) -> float:
    """Fastest of `samples` warm calls (three untimed first), CUDA events on a GPU."""
    import torch

    for _ in range(3):
        call()
    times = []
    for _ in range(samples):
        if device_type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begun = time.perf_counter()
            call()
            times.append(time.perf_counter() - begun)
    return min(times)


def reference_rates(hardware, device_type: str) -> list[str]:
    """Plain torch's warm bf16 GEMM (8192^3 on a GPU) and device copy rate (1 GiB; counted as the
    profile counts it, read plus write) beside the profile's: the profile must measure warm kernels
    (issue 28: its cold quick profile read 18-23 TFLOP/s where plain torch reaches ~780)."""
    import torch

    size, nbytes = (8192, 2**30) if device_type == "cuda" else (512, 2**24)
    a = torch.randn(size, size, device=device_type, dtype=torch.bfloat16)
    gemm_tflops = 2 * size**3 / _warm_min_s(lambda: a @ a, device_type) / 1e12
    src = torch.empty(nbytes // 4, device=device_type)
    dst = torch.empty_like(src)
    copy_gbs = 2 * nbytes / _warm_min_s(lambda: dst.copy_(src), device_type) / 1e9
    profiled_tflops, profiled_gbs = hardware.peak_tflops.get("bf16", 0.0), hardware.memory_bandwidth_gbs
    return ["| figure | plain torch | profile | profile / torch |", "|---|---|---|---|",
            f"| bf16 GEMM {size}^3 | {gemm_tflops:.1f} TFLOP/s | {profiled_tflops:.1f} TFLOP/s | "
            f"{profiled_tflops / gemm_tflops:.2f} |",
            f"| device copy {nbytes >> 20} MiB | {copy_gbs:.0f} GB/s | {profiled_gbs:.0f} GB/s | "
            f"{profiled_gbs / copy_gbs:.2f} |",
            # no plain-torch twin: the H200 evidence's 1.1B steps at mbs 1 and 4 implied 31 us per op
            f"| host time per launched op | | {hardware.efficiency.host_op_s * 1e6:.1f} us | |",
            f"| host Adam for offload | | {hardware.cpu_adam_params_per_s / 1e9:.2f} G params/s | |"]


def adapter_gemms(device_type: str, tokens: int = 8192, rank: int = 16) -> list[str]:
    """LoRA's four adapter GEMMs of one TinyLlama projection (2048 in, 5632 out) over `tokens` tokens,
    timed warm in fp32 (TF32 off and on) and bf16, beside the time their bytes take at the copy rate:
    the H200 evidence's LoRA step took ~90 ms more than its priced traffic and launches, and the
    weight-gradient GEMMs (a 2048 x 16 output over 8,192 tokens) are the suspect (issue 29)."""
    import torch

    if device_type != "cuda":
        tokens = 256
    shapes = {"A forward (T x in) @ (in x r)": ((tokens, 2048), (2048, rank)),
              "B forward (T x r) @ (r x out)": ((tokens, rank), (rank, 5632)),
              "A weight grad (r x T) @ (T x in)": ((rank, tokens), (tokens, 2048)),
              "B weight grad (out x T) @ (T x r)": ((5632, tokens), (tokens, rank))}
    src = torch.empty(2**28 // 4, device=device_type)
    dst = torch.empty_like(src)
    copy_rate = 2 * 2**28 / _warm_min_s(lambda: dst.copy_(src), device_type)
    lines = ["| adapter GEMM | dtype | time | at the copy rate | ratio |", "|---|---|---|---|---|"]
    for name, (a_shape, b_shape) in shapes.items():
        for dtype, tf32 in ((torch.float32, False), (torch.float32, True), (torch.bfloat16, False)):
            if device_type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = tf32
            a = torch.randn(a_shape, device=device_type, dtype=dtype)
            b = torch.randn(b_shape, device=device_type, dtype=dtype)
            seconds = _warm_min_s(lambda: a @ b, device_type)
            moved = (a.numel() + b.numel() + a_shape[0] * b_shape[1]) * a.element_size()
            label = "tf32" if tf32 else str(dtype).removeprefix("torch.")
            lines.append(f"| {name} | {label} | {seconds * 1e6:.0f} us | {moved / copy_rate * 1e6:.0f} us | "
                         f"{seconds * copy_rate / moved:.1f} |")
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as the trainer's workers set it (profiler.ranks)
    return lines


def packed_rows(config: dict, seq: int, device_type: str) -> list[str]:
    """One forward and backward of `config` (fp32 weights, bf16 autocast on a GPU) over rows of 4
    packed documents, through the trainer's attention kernel and through SDPA under transformers'
    document mask: the largest logit difference, each one's warm time and (on a GPU) peak."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.attention import register_document_attention

    cfg = AutoConfig.for_model(**{**config, "use_cache": False})
    ids = torch.randint(0, cfg.vocab_size, (2, seq), device=device_type)
    lengths = [seq // 2, seq // 4, seq // 8, seq - seq // 2 - seq // 4 - seq // 8]
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1).to(device_type)
    lines, logits = ["| attention | packed step | peak | max logit difference |", "|---|---|---|---|"], {}
    for impl in ("sdpa", register_document_attention()):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32).to(device_type)

        def step(model: torch.nn.Module = model) -> torch.Tensor:
            with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
                out = model(input_ids=ids, labels=ids, position_ids=positions)
            out.loss.backward()
            return out.logits.detach().float()

        if device_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        logits[impl] = step()
        seconds = _warm_min_s(step, device_type, samples=3)
        peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if device_type == "cuda" else "n/a (CPU)"
        difference = (logits[impl] - logits["sdpa"]).abs().max().item()
        lines.append(f"| {impl} | {seconds * 1e3:.1f} ms | {peak} | {difference:.2e} |")
        del model
    return lines


def advisor_run(out: Path, device_type: str) -> list[str]:
    """`advisor run` with no options but a step cap, as a user starts the main job (its own process,
    as a user's): the trained plan's predicted step before any refit against its measured trial."""
    import subprocess

    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "advisor.cli", "run", "--out", str(out), "--max-steps-per-stage",
                           "4", "--json"], capture_output=True, text=True, timeout=BUDGET_S)
    seconds = time.perf_counter() - started
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return [f"advisor run: exit {done.returncode} after {seconds:.0f} s: {(done.stderr or done.stdout)[-400:]}"]
    verification = result.get("verification") or {"trials": []}
    trial = next((t for t in verification["trials"] if t["rank"] == verification.get("chosen_rank")), None)
    if trial is None or not trial.get("measured_step_s"):
        return [f"advisor run ({device_type}): exit {done.returncode}, {seconds:.0f} s, plan {result.get('plan')}, "
                "no trial measured"]
    ratio = trial["predicted_step_s"] / trial["measured_step_s"]
    refused = f"; refused: {result['refused']}" if result.get("refused") else ""
    return [f"advisor run ({device_type}): exit {done.returncode}, {seconds:.0f} s, plan {result['plan']}: predicted "
            f"{trial['predicted_step_s'] * 1e3:.1f} ms before the refit, measured {trial['measured_step_s'] * 1e3:.1f} "
            f"ms (x{ratio:.2f}; the issue's bound: within 1.5x){refused}"]


def row(index: int, text: str, model, hardware, steps: int, warmup: int, device_type: str) -> str:
    from specs.capabilities import config_shape, runnable_problem
    from specs.core import resolve_layout
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


def layout_rows(model, hardware, layouts: list[str], first: int, started: float, args, smoke: bool) -> list[str]:
    """A table row per layout (`row`), within the budget; an 8B layout the card cannot hold is skipped."""
    from specs.core import resolve_layout
    from planner.cost_model import estimate

    rows = []
    for index, text in enumerate(layouts, first):
        if time.perf_counter() - started > BUDGET_S:
            rows.append(f"| {index} | {text} | not run: the {BUDGET_S // 60}-minute budget was spent | | | | | |")
        elif not estimate(model, hardware, resolve_layout(text, 1, hardware), attention="sdpa").memory.fits:
            rows.append(f"| {index} | {model.name} {text} | skipped: does not fit this card (cost model) | | | | | |")
        else:
            rows.append(row(index, text, model, hardware, 3 if smoke else args.steps, 1 if smoke else args.warmup,
                            "cpu" if smoke else "cuda"))
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, help="reuse this profile instead of profiling first")
    parser.add_argument("--quick", action="store_true", help="advisor profile --quick")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--no-run", action="store_true", help="leave out `advisor run` (about a minute)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: the code path, no figures")
    args = parser.parse_args(argv)

    import torch

    from specs.core import ModelSpec
    from presets import load_hardware

    started = time.perf_counter()
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu_check.py needs a CUDA device (or --cpu-smoke)")
    device_type = "cpu" if smoke else "cuda"
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
        rows += layout_rows(model, hardware, SMOKE_LAYOUTS if smoke else LAYOUTS, 1, started, args, smoke)
        if not smoke:
            rows += layout_rows(ModelSpec(name="llama-8b-8-layers", hf_config=LLAMA_8B_SLICE), hardware,
                                LAYOUTS_DENSE, len(LAYOUTS) + 1, started, args, smoke)
            rows += layout_rows(ModelSpec(name="llama-8b", hf_config=LLAMA_8B), hardware, LAYOUTS_8B,
                                len(LAYOUTS) + len(LAYOUTS_DENSE) + 1, started, args, smoke)
        # computed here, after the rows' forked ranks: a CPU parent that ran OpenMP work hangs its forks
        lines += ["", *reference_rates(hardware, device_type)]
        rows += ["", *packed_rows(config, 128 if smoke else 4096, device_type)]
        rows += ["", *adapter_gemms(device_type)]
        if not (smoke or args.no_run):
            rows += ["", *advisor_run(Path(tmp, "run"), device_type)]
    body = "\n".join(lines + [""] + rows) + (
        f"\n\nTotal {time.perf_counter() - started:.0f} s. Measured through trainer.timed_steps (the trainer's "
        "model, engine and optimizer step): median step after the warm-up; peak = torch.cuda.max_memory_allocated "
        "over the steps. Predicted: planner.cost_model.estimate on the profile, attention sdpa.")
    print(body)
    if not (args.no_write or smoke):
        from benchmarks_md import write_section

        write_section("gpu_check", f"Step time and memory on CUDA: predicted against measured "
                      f"({torch.cuda.get_device_name(0)})", "python -m bench.gpu_check", body)
    return rows


if __name__ == "__main__":
    main()
