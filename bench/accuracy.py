"""Held-out accuracy of the cost model: predicted against measured peak memory and step time of
real training steps of `advisor train`'s own engines, on model configs that are not presets.

Each row builds its model with the trainer's `build_model`, its engine with `make_engine` (plain,
DDP, DeepSpeed ZeRO 1-3, FSDP2, TP, pipeline: whichever `engine_for` picks) and runs optimizer
steps as the loop does (`micro_step` per micro-batch, then `optimizer_step`), in freshly forked
gloo ranks. Memory is the CPU allocator counter of `profiler.tensor_memory` (every tensor,
DeepSpeed's flat buffers included): the peak over the steady steps, max over ranks. Time is the
median steady step of the slowest rank.

Predictions come from `planner.cost_model.estimate_from_trace` for the engine that runs the row,
on the hardware profile of `advisor profile --quick` (step time), calibrated on the calibration
config only (`CALIBRATION`); every other row is held out. The rows run in passes (`--passes`, 3),
each after its own quick profile and predicted by it, each pass starting further on in the rows:
this shared machine's speed drifts by 10% and more over tens of minutes, so one profile at the
start priced the last rows at another speed, and neighbouring rows shared one slow spell. A row's
step error is the median of its passes' errors.

    python -m bench.accuracy [--only 1,5,9] [--passes 3] [--profile profile.json] [--no-write]
    python -m bench.accuracy --predict-only  # re-predict the saved passes on their own profiles
    python -m bench.accuracy --memory-only   # re-predict the saved rows' peaks; measures nothing
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # this bench runs DeepSpeed on the CPU, in its own process

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from specs.capabilities import engine_for  # noqa: E402
from benchmarks_md import write_section  # noqa: E402
from specs.core import HardwareSpec, Layout, ModelSpec  # noqa: E402
from planner.cost_model import estimate_from_trace  # noqa: E402
from planner.export import deepspeed_config  # noqa: E402
from presets import load_hardware  # noqa: E402
from profiler.model_trace import trace_model  # noqa: E402
from profiler.ranks import finish_rank, free_port, init_rank, launch  # noqa: E402
from profiler.tensor_memory import TensorMemory, load_counter  # noqa: E402

SEED = 0
LEARNING_RATE = 1e-4


def _llama(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
           tied: bool) -> dict[str, Any]:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
            "max_position_embeddings": 2048, "tie_word_embeddings": tied, "rms_norm_eps": 1e-5}


# Not presets, not tuned on: vocabularies 4k-64k, MHA and GQA, tied and untied, several widths
# and depths. CALIBRATION is the one `advisor profile --quick` runs its steps on.
CONFIGS: dict[str, dict[str, Any]] = {
    "calib-8k": _llama(8192, 256, 4, 4, 4, 704, tied=False),
    "mha-16k": _llama(16384, 256, 4, 4, 4, 688, tied=False),
    "gqa-32k-tied": _llama(32000, 384, 3, 6, 2, 1024, tied=True),
    "deep-4k": _llama(4096, 192, 8, 6, 3, 512, tied=False),
    "wide-64k-tied": _llama(65536, 512, 2, 8, 2, 1376, tied=True),
    "gqa-50k": _llama(50304, 320, 4, 8, 4, 864, tied=False),
}
CALIBRATION = "calib-8k"


@dataclass(frozen=True)
class Row:
    config: str
    layout: Layout
    engine: str = "auto"  # the plan's engine choice (auto, deepspeed, fsdp2)


def _rows() -> list[Row]:
    L = Layout
    f32 = {"dtype": "fp32"}
    return [
        Row("calib-8k", L(mbs=2, seq=256, **f32)),
        Row("mha-16k", L(mbs=1, seq=128, **f32)),
        Row("mha-16k", L(mbs=4, seq=512, **f32)),
        Row("mha-16k", L(mbs=8, seq=1024, **f32)),
        Row("mha-16k", L(mbs=4, seq=512, recompute="full", **f32)),
        Row("mha-16k", L(dp=2, mbs=2, seq=512, **f32)),
        Row("mha-16k", L(dp=2, zero=1, mbs=2, seq=512, **f32)),
        Row("mha-16k", L(dp=2, zero=3, mbs=2, seq=256, **f32)),
        Row("mha-16k", L(dp=2, zero=2, mbs=2, seq=256, **f32), engine="fsdp2"),
        Row("mha-16k", L(tp=2, mbs=2, seq=512, **f32)),
        Row("gqa-32k-tied", L(mbs=1, seq=256, **f32)),
        Row("gqa-32k-tied", L(mbs=4, seq=512, **f32)),
        Row("gqa-32k-tied", L(mbs=2, seq=1024, recompute="full", **f32)),
        Row("gqa-32k-tied", L(mbs=4, seq=256, method="lora", **f32)),
        Row("gqa-32k-tied", L(dp=2, zero=2, mbs=2, seq=512, **f32)),
        Row("gqa-32k-tied", L(dp=2, zero=3, mbs=4, seq=256, **f32), engine="fsdp2"),
        Row("gqa-32k-tied", L(dp=2, mbs=2, seq=256, gas=2, **f32)),
        Row("gqa-32k-tied", L(dp=4, zero=1, mbs=1, seq=512, **f32)),
        Row("deep-4k", L(mbs=8, seq=512, **f32)),
        Row("deep-4k", L(mbs=4, seq=1024, recompute="full", **f32)),
        Row("deep-4k", L(pp=2, mbs=2, gas=4, seq=256, **f32)),
        Row("deep-4k", L(pp=2, dp=2, zero=1, mbs=1, gas=2, seq=256, **f32)),
        Row("gqa-50k", L(tp=2, dp=2, mbs=2, seq=256, **f32)),
        Row("deep-4k", L(dp=2, zero=3, mbs=4, seq=512, **f32)),
        Row("wide-64k-tied", L(mbs=1, seq=256, **f32)),
        Row("wide-64k-tied", L(mbs=4, seq=256, **f32)),
        Row("wide-64k-tied", L(mbs=2, seq=512, method="lora", **f32)),
        Row("wide-64k-tied", L(dp=2, zero=1, mbs=2, seq=256, **f32)),
        Row("wide-64k-tied", L(tp=2, mbs=2, seq=256, **f32)),
        Row("gqa-50k", L(mbs=2, seq=512, **f32)),
        Row("gqa-50k", L(mbs=8, seq=128, **f32)),
        Row("gqa-50k", L(dp=2, mbs=4, seq=256, **f32)),
        Row("gqa-50k", L(pp=2, mbs=2, gas=2, seq=512, **f32)),
        Row("gqa-50k", L(dp=2, zero=2, mbs=2, seq=512, gas=2, **f32)),
        # each recompute mode on the same layout (rows 3 and 5; 13): torch's op-level selective policy
        Row("mha-16k", L(mbs=4, seq=512, recompute="selective", **f32)),
        Row("gqa-32k-tied", L(mbs=2, seq=1024, recompute="selective", **f32)),
        Row("gqa-32k-tied", L(mbs=2, seq=1024, **f32)),
        Row("deep-4k", L(dp=2, mbs=4, seq=512, recompute="selective", **f32)),
        # a small vocabulary under DeepSpeed ZeRO-2: its bucket, set up at the first gradient, beside
        # every activation makes the peak (the loss's buffers are smaller)
        Row("deep-4k", L(dp=2, zero=2, mbs=2, seq=256, **f32)),
    ]


ROWS = _rows()


def spec_of(config: str) -> ModelSpec:
    return ModelSpec(name=config, hf_config=CONFIGS[config])


# ------------------------------------------------------------------------------------------------
# measuring: the trainer's own model, engine and step


def _worker(rank: int, row: Row, steps: int, port: int, out_dir: str, threads: int) -> None:
    from trainer.engines import make_engine  # deferred: the parent imports it before forking
    from trainer.options import TrainOptions
    from trainer.model import build_model

    layout = row.layout
    backend = engine_for(layout, row.engine)
    distributed = layout.devices > 1 or backend == "deepspeed"
    init_rank(rank, layout.devices, port, distributed, threads)
    memory = TensorMemory(torch.device("cpu"))
    spec = spec_of(row.config)
    model = build_model(spec, layout, SEED)
    ds_config = None
    if backend == "deepspeed":
        ds_config = deepspeed_config(SimpleNamespace(model=spec, hardware=load_hardware("cpu")), layout)
    # clipping as `advisor train` runs it (its default), as calibration's timed steps do
    engine = make_engine(model, layout, ds_config, TrainOptions().clip, row.engine)  # type: ignore[arg-type]
    del model
    vocab = int(CONFIGS[row.config]["vocab_size"])
    record: dict[str, list[float]] = {"static": [], "peak": [], "step_s": [], "forward_backward_peak": [],
                                       "optimizer_peak": []}
    data_rank = getattr(engine, "data_rank", rank)
    for step in range(steps):
        static = memory.live()
        memory.reset_peak()
        started = time.perf_counter()
        for micro in range(layout.gas):
            gen = torch.Generator().manual_seed(SEED + 1000 * data_rank + 10 * step + micro)
            ids = torch.randint(0, vocab, (layout.mbs, layout.seq), generator=gen)
            engine.micro_step(ids)
            del ids
        fb_peak = memory.peak()
        memory.reset_peak()
        engine.optimizer_step(LEARNING_RATE)
        record["step_s"].append(time.perf_counter() - started)
        record["static"].append(static)
        record["optimizer_peak"].append(memory.peak())
        record["forward_backward_peak"].append(fb_peak)
        record["peak"].append(max(fb_peak, memory.peak()))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    del engine
    finish_rank(distributed)


def prepare_parent(rows: list[Row]) -> None:
    """Import and build the native pieces once, so that forked ranks inherit them loaded."""
    import deepspeed  # noqa: F401
    from peft import get_peft_model  # noqa: F401
    from transformers import AutoModelForCausalLM, LlamaForCausalLM  # noqa: F401

    import trainer.engines  # noqa: F401
    import trainer.model  # noqa: F401

    load_counter()
    if any(engine_for(r.layout, r.engine) == "deepspeed" for r in rows):
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()


def measure(row: Row, threads: int, steps: int = 4, warmup: int = 2) -> dict[str, Any]:
    """Train `row` for `steps` optimizer steps in forked ranks of `threads` CPU threads each (what
    `advisor train` pins them to): steady peak (max over ranks and steps after `warmup`, Adam's
    states exist from step 1 on) and the median steady step time."""
    with tempfile.TemporaryDirectory(prefix="accuracy_") as out_dir:
        launch(_worker, row.layout.devices, (row, steps, free_port(), out_dir, threads))
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(row.layout.devices)]
    steady = slice(warmup, None)
    slowest = [max(times) for times in zip(*(r["step_s"] for r in ranks))]
    return {
        "peak_bytes": max(max(r["peak"][steady]) for r in ranks),
        "static_bytes": max(r["static"][warmup] for r in ranks),
        "forward_backward_peak": max(max(r["forward_backward_peak"][steady]) for r in ranks),
        "optimizer_peak": max(max(r["optimizer_peak"][steady]) for r in ranks),
        "step_s": statistics.median(slowest[steady]),
    }


# ------------------------------------------------------------------------------------------------
# predicting


def on_this_node(row: Row, hardware: HardwareSpec) -> HardwareSpec:
    """The profile's node holding all of `row`'s ranks: a row of more ranks than the profile has
    devices puts them on this one node, which time-shares its cores (`HardwareSpec.oversubscription`)."""
    if row.layout.devices <= hardware.devices_per_node:
        return hardware
    return hardware.model_copy(update={"devices_per_node": row.layout.devices})


def predict(row: Row, hardware: HardwareSpec) -> Any:
    hardware = on_this_node(row, hardware)
    layout = row.layout
    trace = trace_model(spec_of(row.config), layout.seq, layout.dtype, layout.method, layout.lora_rank,
                        device_type="cpu")
    return estimate_from_trace(trace, layout, hardware, engine_for(layout, row.engine))


def describe(row: Row) -> str:
    layout = row.layout
    engine = engine_for(layout, row.engine)
    name = {"plain": "DDP" if layout.dp > 1 else "plain", "deepspeed": f"DeepSpeed ZeRO-{layout.zero}",
            "fsdp2": ("FSDP2" + (f" zero {layout.zero}" if layout.dp > 1 else "")) if layout.tp == 1
            else ("TP" if layout.dp == 1 else "DP×TP"), "pipeline": "PP" if layout.dp == 1 else "DP×PP"}[engine]
    parts = [f"{layout.devices}r {name}", f"mbs {layout.mbs}", f"seq {layout.seq}"]
    if layout.gas > 1:
        parts.append(f"gas {layout.gas}")
    if layout.recompute != "none":
        parts.append(f"{layout.recompute} rc")
    if layout.method != "full":
        parts.append(layout.method)
    return ", ".join(parts)


def quick_profile(out: Path) -> Path:
    """`advisor profile --quick` with its calibration steps on the calibration config (a fresh
    process: its own ranks, its own timing)."""
    import subprocess

    config = out.with_name(f"{CALIBRATION}.json")
    config.write_text(json.dumps(CONFIGS[CALIBRATION]))
    subprocess.run([sys.executable, "-m", "advisor.cli", "profile", "--quick", "--model", str(config),
                    "--out", str(out)], check=True, cwd=Path(__file__).resolve().parent.parent)
    return out


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1


def step_error(result: dict[str, Any]) -> float:
    """The median of a row's passes' errors (each pass predicted by its own profile); a row saved
    from a single measurement, its one error."""
    if "step_error" in result:
        return float(result["step_error"])
    return _error(result["predicted_step_s"], result["step_s"])


def _pass_errors(result: dict[str, Any]) -> str:
    return " / ".join(f"{100 * _error(p['predicted_step_s'], p['step_s']):+.0f}" for p in result.get("passes", []))


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| # | config | layout | measured MiB | predicted MiB | error | measured s | predicted s | error | "
             "each pass's error, % |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['index']} | {r['config']}{' (calibration)' if r['config'] == CALIBRATION else ''} | {r['row']} | "
            f"{r['peak_bytes'] / 2**20:.1f} | {r['predicted_peak'] / 2**20:.1f} | "
            f"{100 * _error(r['predicted_peak'], r['peak_bytes']):+.1f}% | {r['step_s']:.3f} | "
            f"{r['predicted_step_s']:.3f} | {100 * step_error(r):+.1f}% | {_pass_errors(r)} |")
    held = [r for r in results if r["config"] != CALIBRATION]
    memory = [abs(_error(r["predicted_peak"], r["peak_bytes"])) for r in held]
    time_ = [abs(step_error(r)) for r in held]
    profiles = sorted({p["profile"] for r in results for p in r.get("passes", [])})
    configs = "; ".join(f"`{name}`: vocab {c['vocab_size']}, hidden {c['hidden_size']}, {c['num_hidden_layers']} "
                        f"layers, {c['num_attention_heads']}/{c['num_key_value_heads']} heads, "
                        f"{'tied' if c['tie_word_embeddings'] else 'untied'}" for name, c in CONFIGS.items())
    return "\n".join(lines) + (
        f"\n\nHeld-out rows: {len(held)} of {len(results)}. Peak memory |error|: median "
        f"{100 * statistics.median(memory):.1f}%, worst {100 * max(memory):.1f}% (targets 5% / 10%). Step time "
        f"|error|: median {100 * statistics.median(time_):.1f}%, worst {100 * max(time_):.1f}% (targets 10% / 20%). "
        f"Each row measured in {max(len(r.get('passes', [])) for r in results)} passes over all rows, each pass "
        f"after its own `advisor profile --quick` ({len(profiles)} profiles) and predicted by it; measured and "
        "predicted seconds are the passes' medians, the step error the median of the passes' errors."
        f"\n\nModels (Llama-family configs, not presets): {configs}. Measured "
        "through the trainer's own `build_model`, `make_engine` and `micro_step`/`optimizer_step` in forked gloo "
        "ranks, fp32; memory is the CPU allocator counter (`profiler/tensor_memory.py`: every tensor, DeepSpeed's "
        "flat buffers included), the steady-step peak of the most loaded rank; time is the slowest rank's median "
        "steady step. Predicted by `planner.cost_model` for the engine `engine_for` picks.\n\n"
        "What these rows taught the cost model (all measured here, then priced for every layout): the loss "
        "holds three logits-sized fp32 buffers at the start of backward (the saved log-softmax, its gradient "
        "and the gradient it returns), not two; the DTensor engines keep the embedding, LM head and logits whole "
        "on every TP rank; FSDP2 keeps fp32 shards at every ZeRO stage and, below ZeRO-3, every unit gathered "
        "from forward to backward; DeepSpeed ZeRO-3 as exported keeps up to stage3_max_live_parameters "
        "gathered and its reduce bucket alive in backward; DDP accumulating under no_sync holds fresh gradients "
        "beside its persistent buckets; a tied embedding's gradient exists three times at the end of backward (the "
        "LM head's share held by autograd until the embedding's own arrives, that one, and their sum: row 28), "
        "twice where the chunked loss summed two or more chunks, as autograd adds the embedding's into that sum in "
        "place (row 18 had been priced 12% high); "
        "the chunked loss (trainer/chunked_loss.py) holds one chunk's logits where the declaration runs it.\n\n"
        "What the step times taught it: a profile's CPU device is its threads (one core here), and every rank "
        "now trains with exactly those (`HardwareSpec.threads_per_device`; 1-rank rows had run on both cores and "
        "were 50-175% slower than predicted); ranks beyond the cores time-share them (the 4-rank rows); the "
        "optimizer step runs at the profile's measured AdamW rate, not at a fitted memory rate; FSDP2 and ZeRO-3 "
        "pay gloo's own all-gather and reduce-scatter rates (a third and a half of its all-reduce's); the loss's "
        "passes over the fp32 logits are priced; the GEMM efficiency is the measured rate's, not fitted (fitted, "
        "it traded off against the element-wise time and drifted between 0.86 and 2.0 from one profile to the "
        "next); the profile measures the rates that change with a model's shapes and prices each by it "
        "(`HardwareSpec.head_gemm`: the LM head's GEMMs by vocabulary, 0.9 of the decoder's rate at 4k and 0.7 "
        "at 64k; `attention`: the fused kernel by sequence length, 0.65 at 256 and 0.93 at 1024; "
        "`cpu_adam_by_tensor`: AdamW on an 8M-parameter embedding at a third of a decoder matrix's rate; the "
        "50k-64k rows had run 19-29% slower than priced); a pipeline's bubble is the other stages' fill and "
        "drain, not p - 1 slots of the slowest (a 50k head makes the last stage 7x the first; the pipeline rows "
        "had been priced 29-33% slow); the GEMM slope over tokens holds only over the 256-2048 tokens calibration "
        "measures; calibration runs 11 steps for its 7 unknowns, two of them data-parallel at mbs 1 and 8, "
        "which tell contention (8-11% here, measured directly with two independent ranks) from collectives "
        "under load (at mbs 2 alone it read 47% contention), and one tensor-parallel, which measures what each "
        "blocking collective waits beyond its transfer (`tp_collective_wait_s`, fitted at 4-6 ms in the "
        "runs' profiles, where the idle link prices a 1 MiB all-reduce at 1.4 ms); the trainer's TP plan "
        "runs 7 all-reduces per Llama layer, not Megatron's 4 (each HF projection all-reduces its own input "
        "gradient; counted on the engine by tests/test_collectives_as_run.py), and recomputation re-runs one "
        "of them; DeepSpeed's ZeRO-1 all-gathers the weights after its step; FSDP2 shards the optimizer's work "
        "at every ZeRO stage; the step's gradient norm and clipping (the trainer's default, now run here too) "
        "are priced. What the machine taught the bench: this 2-vCPU machine's speed drifts "
        "by 10% and more over tens of minutes (the same rows measured 10-16% apart an hour apart, and back-to-back "
        "quick profiles fitted a GEMM-token slope of -0.09 and -0.04), so one profile taken before a 30-minute "
        "run priced every row at the speed of its own minute: the calibration config itself read +4% in one run "
        "and +18% in the next. Each pass now has its own profile, and a row's error is the median of its "
        "passes'. The 4-rank rows time-share 2 "
        "cores: their collectives are gloo's copies and reductions on those cores, time-shared like the compute "
        "(the DP×TP row had read 23-34% fast when they were not: bench/time_shared_collectives.py), and a "
        "pipeline's stages that idle in its fill and drain leave the cores to the others (each rank of the "
        "DP×PP row spent 0.15-0.18 s of CPU in a 0.37 s step; priced as if the fill and drain were time-shared "
        "too, that row read 30-36% slow). DeepSpeed ZeRO-1/2 sets its gradient bucket up as the first gradient "
        "arrives, beside every activation: with a 4k vocabulary that is the peak (row 39). Known to be left: a "
        "micro-batch under 256 tokens is priced at the 256-token GEMM rate (calibration measures none smaller; "
        "row 2, 128 tokens, reads fast), and FSDP2's gather and reduce-scatter buffers, allocated afresh every "
        "step and written at page-fault speed above glibc's 32 MiB mmap ceiling, are not priced. Each row times 3 "
        "steady steps after 3 warm-up steps, as calibration does, on a quiet machine.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated 1-based row indices")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per row, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the median (calibration "
                        "leaves out the same)")
    parser.add_argument("--passes", type=int, default=3, help="passes over all rows, each after a fresh `advisor "
                        "profile --quick` and predicted by it, each starting further on in the rows; a row's step "
                        "error is the median of its passes' (this machine's speed drifts by 10%% and more over "
                        "tens of minutes: one profile at the start prices the last rows at another speed)")
    parser.add_argument("--profile", type=Path, help="an existing profile.json for every pass (default: `advisor "
                        "profile --quick` on the calibration config before each pass)")
    parser.add_argument("--no-write", action="store_true", help="print the table only: leave docs/benchmarks.md "
                        "as it is, and bench/accuracy.json too under --predict-only and --memory-only")
    parser.add_argument("--predict-only", action="store_true", help="re-predict the measurements saved in "
                        "bench/accuracy.json (each pass with the profile it was predicted on); measures nothing")
    parser.add_argument("--memory-only", action="store_true", help="re-predict the peak memory of the rows saved in "
                        "bench/accuracy.json with the current cost model (memory needs no profile); their step "
                        "times stay as measured and predicted then")
    args = parser.parse_args()
    saved = Path(__file__).with_name("accuracy.json")
    if args.memory_only:
        return _memory_only(saved, args.no_write)
    indices = [int(i) for i in args.only.split(",")] if args.only else list(range(1, len(ROWS) + 1))
    kept = {r["index"]: r for r in json.loads(saved.read_text())} if saved.is_file() else {}
    if args.predict_only:
        return _predict_only(saved, kept, [i for i in indices if i in kept], args.profile, args.no_write)
    rows = list(zip(indices, (ROWS[i - 1] for i in indices)))
    prepare_parent([row for _, row in rows])
    passes: dict[int, list[dict[str, Any]]] = {index: [] for index in indices}
    workdir = Path(tempfile.mkdtemp(prefix="accuracy_"))
    for number in range(args.passes):
        profile = args.profile or quick_profile(workdir / f"profile{number}.json")
        hardware = load_hardware(str(profile))
        for index, row in pass_order(rows, number, args.passes):
            threads = hardware.threads_per_rank(row.layout.devices, os.cpu_count() or 1)
            measured = measure(row, threads, args.steps, warmup=args.warmup)
            est = predict(row, hardware)
            passes[index].append({"step_s": measured["step_s"], "predicted_step_s": est.time.step_s,
                                  "profile": str(profile)})
            kept[index] = record(index, row, measured, est.memory.peak, passes[index])
            # rows measured earlier stay (a long run is resumable: measure the missing rows with --only)
            saved.write_text(json.dumps([kept[i] for i in sorted(kept)], indent=1) + "\n")
            print(f"[{index}] pass {number + 1} {row.config:14} {describe(row):40} peak "
                  f"{measured['peak_bytes'] / 2**20:8.1f} MiB ({_error(est.memory.peak, measured['peak_bytes']):+.1%})"
                  f"  step {measured['step_s']:.3f} s ({_error(est.time.step_s, measured['step_s']):+.1%})", flush=True)
    _write([kept[i] for i in sorted(kept)], args.no_write)


def pass_order(rows: list[tuple[int, Row]], number: int, passes: int) -> list[tuple[int, Row]]:
    """All rows, pass `number` starting `number * len / passes` rows on: each row is measured at
    another point of the run (another spell of a shared machine) in each pass."""
    shift = -(-len(rows) // passes) * number
    return rows[shift % len(rows):] + rows[:shift % len(rows)]


def record(index: int, row: Row, measured: dict[str, Any], predicted_peak: float,
           passes: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's saved result: its memory (the same in every pass), and its passes' step times, each
    predicted by the profile taken before that pass; the step error is the median of the passes'."""
    return {"index": index, "row": describe(row), "config": row.config,
            **{key: measured[key] for key in ("peak_bytes", "static_bytes", "forward_backward_peak", "optimizer_peak")},
            "predicted_peak": predicted_peak,
            "step_s": statistics.median(p["step_s"] for p in passes),
            "predicted_step_s": statistics.median(p["predicted_step_s"] for p in passes),
            "step_error": statistics.median(_error(p["predicted_step_s"], p["step_s"]) for p in passes),
            "passes": passes, "profile": passes[-1]["profile"]}


def _predict_only(saved: Path, kept: dict[int, dict[str, Any]], indices: list[int], profile: Path | None,
                  no_write: bool) -> None:
    """Every saved pass re-predicted with the current cost model, on the profile it was predicted on
    (or `profile`)."""
    for index in indices:
        old = kept[index]
        passes = old.get("passes") or [{"step_s": old["step_s"], "profile": old["profile"]}]
        passes = [{**p, "predicted_step_s": predict(ROWS[index - 1], load_hardware(str(profile or p["profile"])))
                   .time.step_s} for p in passes]
        kept[index] = record(index, ROWS[index - 1], old, predict(ROWS[index - 1], load_hardware("cpu")).memory.peak,
                             passes)
    if not no_write:
        saved.write_text(json.dumps([kept[i] for i in sorted(kept)], indent=1) + "\n")
    _write([kept[i] for i in sorted(kept)], no_write)


def _write(results: list[dict[str, Any]], no_write: bool, footnote: str = "") -> None:
    body = table(results) + footnote
    print(body)
    if not no_write:
        write_section("accuracy", "Held-out accuracy: peak memory and step time of the trainer's engines "
                      "(this CPU)", "python -m bench.accuracy", body)


def _memory_only(saved: Path, no_write: bool) -> None:
    """Peak memory re-predicted for every saved row (load-independent, no profile: the `cpu` preset
    stands for this machine's device type); measured figures and step-time predictions as saved."""
    kept = json.loads(saved.read_text())
    hardware = load_hardware("cpu")
    for result in kept:
        result["predicted_peak"] = predict(ROWS[result["index"] - 1], hardware).memory.peak
    if not no_write:
        saved.write_text(json.dumps(kept, indent=1) + "\n")
    _write(kept, no_write, "\n\nPeak memory re-predicted by `python -m bench.accuracy --memory-only` with the current "
           "cost model; the measured figures and the step-time columns are the last full run's.")


if __name__ == "__main__":
    main()
