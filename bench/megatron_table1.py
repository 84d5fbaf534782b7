"""Predicted against published throughput for Table 1 of Narayanan et al. 2021 (Megatron-LM).

Each row's GPT model, layout (TP, PP, DP, micro-batch, interleaved chunks, full recomputation) and
DDP (PyTorch's or Megatron's own), as in the authors' `examples/sc21/run_table_1.sh`, and batch run
through `advisor`'s cost model on the `a100-80g` preset with explicit attention (2021 Megatron had
no FlashAttention), priced as the `megatron` engine (planner/megatron2021.py). We compare the
paper's metric: its equation (3) FLOPs, which count the recomputed forward, over the predicted
step time, per GPU. A second table adds the terms that cut the bias one at a time.

    python bench/megatron_table1.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from benchmarks_md import write_section  # noqa: E402
from paper_tables import MEGATRON_SEQ_LEN, MEGATRON_TABLE1, MEGATRON_VOCAB  # noqa: E402

from specs.core import Estimate, HardwareSpec, Layout, ModelSpec  # noqa: E402
from megatron_schedule import replay  # noqa: E402
from planner import compute_time, megatron2021, optimizer_step  # noqa: E402
from planner.cost_model import Placement, default_split, estimate, stage_time, step_seconds  # noqa: E402
from specs.engine_traits import MEGATRON  # noqa: E402
from presets import load_hardware  # noqa: E402
from profiler.model_trace import trace_model  # noqa: E402


def paper_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, equation (3): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def megatron_2021(hardware: HardwareSpec, ddp: str = "local") -> HardwareSpec:
    """The preset as the row's DDP ran: Megatron-LM's own ("local") all-reduces the gradients after the
    last backward, nothing hidden; PyTorch's ("torch") overlaps its buckets with the last micro-batch's
    backward, priced with the preset's comm_overlap."""
    if ddp == "torch":
        return hardware
    return hardware.model_copy(update={"efficiency": hardware.efficiency.model_copy(update={"comm_overlap": 0.0})})


def row_model(row: dict) -> ModelSpec:
    config = {"model_type": "gpt2", "n_embd": row["hidden"], "n_layer": row["layers"], "n_head": row["heads"],
              "n_positions": MEGATRON_SEQ_LEN, "vocab_size": MEGATRON_VOCAB, "activation_function": "gelu"}
    return ModelSpec(name=f"gpt-{row['params_billion']}b", hf_config=config)


def row_layout(row: dict) -> Layout:
    gas = row["batch_size"] // (row["dp"] * row["micro_batch"])
    return Layout(dp=row["dp"], tp=row["tp"], pp=row["pp"], vpp=row["model_chunks"], mbs=row["micro_batch"], gas=gas,
                  recompute="full", dtype="fp16", seq=MEGATRON_SEQ_LEN)


def predicted_tflops(row: dict, preset: HardwareSpec) -> tuple[Estimate, float]:
    """The cost model's estimate of a Table 1 row and its TFLOP/s per GPU in the paper's metric."""
    est = estimate(row_model(row), megatron_2021(preset, row["ddp"]), row_layout(row), attention="eager",
                   engine=MEGATRON)
    flops = paper_flops_per_iteration(row["batch_size"], MEGATRON_SEQ_LEN, row["layers"], row["hidden"],
                                      MEGATRON_VOCAB)
    return est, flops / est.time.step_s / row["gpus"] / 1e12


def replayed_over_priced(model: ModelSpec, layout: Layout, hardware: HardwareSpec) -> float:
    """Megatron's own pipeline programs replayed with the priced stage times (tests/megatron_schedule.py),
    over the priced pipeline part of the step (all but the exposed DP traffic and the optimizer)."""
    if layout.pp == 1:
        return 1.0  # no pipeline to replay
    trace = trace_model(model, layout.seq, dtype=layout.dtype, attention="eager", device_type="cuda")
    placement = Placement.of(layout, hardware.devices_per_node)
    split, recomputed = default_split(trace, layout)
    times = [stage_time(trace, layout, hardware, placement, i, n, r, MEGATRON)
             for i, (n, r) in enumerate(zip(split, recomputed))]
    priced = step_seconds(layout, times) - max(t.dp_exposed for t in times) - max(t.optimizer for t in times)
    return replay(layout.pp, layout.vpp, layout.gas, times) / priced


def cumulative_terms(preset: HardwareSpec) -> list[tuple[str, list[float]]]:
    """Each row's error as the terms that cut the bias are added one at a time, in the order they
    were found: every later term switched off (with unittest.mock, around the cost model's own
    functions) for the earlier lines. The last line is the model as it stands."""
    without_waves = preset.model_copy(update={"sm_count": None, "gemm_tile": None})
    generic_elementwise = compute_time.elementwise_bytes

    def as_our_engines(trace, layout, engine, layers, recomputed):  # the ELEMENTWISE_PASSES estimate
        return generic_elementwise(trace, layout, "plain", layers, recomputed)

    def errors(hardware: HardwareSpec, ddp_as_run: bool = True) -> list[float]:
        rows = [r if ddp_as_run else {**r, "ddp": "local"} for r in MEGATRON_TABLE1]
        return [predicted_tflops(r, hardware)[1] / r["tflops_per_gpu"] - 1 for r in rows]

    no_accumulation = mock.patch.object(megatron2021, "gradient_accumulation_bytes", lambda layout, trainable: 0.0)
    fused_adam_only = mock.patch.object(megatron2021, "ADAM_BYTES_PER_PARAM", optimizer_step.ADAM_BYTES_PER_PARAM_FUSED)
    lines = []
    with mock.patch.object(compute_time, "elementwise_bytes", as_our_engines), no_accumulation, fused_adam_only:
        lines.append(("before (every row's DDP priced without overlap)", errors(without_waves, ddp_as_run=False)))
        lines.append(("+ DDP as run_table_1.sh ran it (PyTorch DDP, overlapped, for 1.7B-18.4B)",
                      errors(without_waves)))
    with no_accumulation, fused_adam_only:
        lines.append(("+ Megatron-2021's element-wise kernels, counted kernel by kernel", errors(without_waves)))
    with fused_adam_only:
        lines.append(("+ gradient accumulation into `.grad` (gas > 1)", errors(without_waves)))
    lines.append(("+ Megatron's fp16 optimizer step (52 B/param, was 28)", errors(without_waves)))
    lines.append(("+ tile and wave quantization of the GEMMs (108 SMs, 256x128 tiles)", errors(preset)))
    return lines


def main() -> None:
    preset = load_hardware("a100-80g")
    rows = predicted_rows(preset)
    worst = max(abs(row[4]) for row in rows)
    replay_gap = max(abs(row[5] - 1) for row in rows)
    steps = cumulative_terms(preset)
    before = steps[0][1]
    body = "\n".join(results_table(rows)) + (
        f"\n\nWorst error {100 * worst:.1f}% (goal: within 10%; it was {100 * max(before):+.1f}% before the terms "
        f"below). Hardware: `a100-80g` preset (gemm efficiency {preset.efficiency.gemm}, "
        f"{preset.sm_count} SMs and {preset.gemm_tile[0]}x{preset.gemm_tile[1]} GEMM tiles, NVLink "
        f"{preset.intra_node_bandwidth_gbs} GB/s, IB {preset.inter_node_bandwidth_gbs} GB/s per GPU). Layouts and "
        "DDP from the authors' run_table_1.sh; TFLOP/s in the paper's own metric (equation 3, recomputation "
        "counted). The engine is `megatron` (planner/megatron2021.py): what Megatron-LM ran at the SC21 commit, "
        "not one of ours.\n\n" + "\n".join(ablation_table(steps)) + "\n\n" + why_the_bias_fell(replay_gap))
    print(body)
    write_section("megatron_table1", "Throughput: Narayanan et al. 2021, Table 1 (a100-80g)",
                  "python bench/megatron_table1.py", body)


def predicted_rows(preset: HardwareSpec) -> list[tuple[dict, Layout, Estimate, float, float, float]]:
    """Per Table 1 row: the row, its layout, the estimate, predicted TFLOP/s, its error against the
    published figure, and Megatron's replayed pipeline over the priced one."""
    rows = []
    for r in MEGATRON_TABLE1:
        est, predicted = predicted_tflops(r, preset)
        layout = row_layout(r)
        rows.append((r, layout, est, predicted, predicted / r["tflops_per_gpu"] - 1,
                     replayed_over_priced(row_model(r), layout, megatron_2021(preset, r["ddp"]))))
    return rows


def results_table(rows: list[tuple[dict, Layout, Estimate, float, float, float]]) -> list[str]:
    """The Markdown table of every row's predicted against published throughput."""
    lines = ["| params (B) | GPUs | TP | PP | DP | mbs | chunks | DDP | batch | published TFLOP/s | predicted | error "
             "| step s | compute % | bubble s | replayed / priced | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, layout, est, predicted, error, replayed in rows:
        lines.append(
            f"| {r['params_billion']} | {r['gpus']} | {layout.tp} | {layout.pp} | {layout.dp} | {layout.mbs} | "
            f"{layout.vpp} | {r['ddp']} | {r['batch_size']} | {r['tflops_per_gpu']} | {predicted:.1f} | "
            f"{100 * error:+.1f}% | {est.time.step_s:.2f} | {100 * est.compute_fraction:.0f} | "
            f"{est.time.bubble_s:.2f} | {f'{replayed:.4f}' if layout.pp > 1 else '-'} | "
            f"{est.memory.peak / 2**30:.1f} |")
    return lines


def ablation_table(steps: list[tuple[str, list[float]]]) -> list[str]:
    """The Markdown table of each row's error as the terms are added one at a time."""
    names = " | ".join(f"{r['params_billion']}B" for r in MEGATRON_TABLE1)
    ablation = [f"| error as terms are added | {names} |", "|---" * (len(MEGATRON_TABLE1) + 1) + "|"]
    ablation += [f"| {name} | " + " | ".join(f"{100 * e:+.1f}%" for e in errs) + " |" for name, errs in steps]
    return ablation


def why_the_bias_fell(replay_gap: float) -> str:
    """What each term of the ablation prices, what remains unmeasured, and why the schedule is not the bias."""
    return (
        "Why every row was optimistic, and what cut it (table above, each line adds one term to the one before; "
        "no term is fitted to the table, none is per row):\n\n"
        "- *Already priced before*: Megatron's local DDP all-reduces after the last backward (no overlap), and "
        "eager attention's score matmuls run at memory speed (roofline: 2 head_dim / 2 bytes FLOP/byte, under "
        "the A100's ridge point).\n"
        "- *DDP as run*: the script runs the four smallest models with PyTorch's DDP, whose bucketed all-reduce "
        "hides behind the last micro-batch's backward (the preset's comm_overlap 0.5). Pricing what ran makes "
        "those rows *more* optimistic (+3 to +6 points): what remains is not the gradient all-reduce.\n"
        "- *Element-wise kernels*: the generic estimate (ELEMENTWISE_PASSES = 4 passes over the activations a "
        "layer saves, plus one for recomputation) misses what the 2021 code moves besides its saved tensors: "
        "PyTorch 1.8's F.linear adds the QKV bias in a separate pass over a 3-D output, the context permute "
        "copies, softmax and dropout read and write the s x s scores again in backward, apex's LayerNorm "
        "backward reads its input twice, the residual gradients are summed by separate adds, and split's "
        "backward concatenates the q, k, v gradients. Counted kernel by kernel "
        "(planner/megatron2021.py), one layer's full-recompute traffic is 90 + 118/t + 29 as/(ht) bytes per "
        "b s h element instead of 50 + 120/t + 25 as/(ht): +41% at TP 8, +18% at TP 1.\n"
        "- *Gradient accumulation*: every micro-batch after the first reads its fp16 gradients and the sum and "
        "writes the sum (autograd's AccumulateGrad; Megatron fused it into the weight-gradient GEMM in 2022). "
        "6 bytes per parameter weigh most where a micro-batch computes least per parameter: mbs 1 (310B-1T), "
        "3-4 points.\n"
        "- *Optimizer step*: Megatron's Float16Optimizer copies fp16 gradients to fp32, unscales and checks "
        "them, reads them for the clipping norm, runs Adam and copies the master back: 52 bytes per parameter, "
        "not a fused kernel's 28 (under 1 point).\n"
        "- *Tile and wave quantization*: a GEMM runs its output as 256x128 tiles, 108 at a time (one per SM, "
        "NVIDIA's GEMM performance guide); a GEMM of 4.4 waves takes 5. Tensor parallelism cuts the GEMMs' "
        "widths to h/8: for 76B (mbs 2, 4096 tokens) the QKV GEMM has 480 tiles = 4.44 waves (89% useful) and "
        "the attention projection's input gradient 160 tiles (74%). Over a layer's GEMMs the rows lose 3-8%; "
        "the `efficiency.gemm` of 0.75 stays what a full-wave GEMM reaches. cuBLAS may pick smaller tiles or "
        "split K where a GEMM has few tiles, so this term is at the high end of the quantization: with "
        "128x128 tiles instead the rows lose 0-4%, and without the term every row still lands within "
        "10%.\n\n"
        "What remains is within the figures nobody measured on these runs: the share of PyTorch DDP's "
        "all-reduce hidden behind compute (the preset's assumed 0.5; 0 or 1 moves the four smallest rows by "
        "up to 6 points either way) and `efficiency.gemm` itself (the preset's typical 0.75 of peak).\n\n"
        "Left out, each under 0.2% of a step: the tied embedding's all-reduce between the first and last "
        "stage (at most 330 MB over IB once a step), local DDP's flatten and unflatten copies around its "
        "all-reduce (12 bytes per parameter once a step).\n\n"
        "The pipeline schedule is not the bias. Column *replayed / priced*: Megatron-LM's own 1F1B and "
        "interleaved-1F1B programs (the SC21 commit's warm-up counts, one blocking combined send/receive per "
        "forward+backward chunk pair, the ring from the last device back to the first, the embedding and head on "
        "the model's first and last chunk) replayed event by event with the priced stage times "
        "(tests/megatron_schedule.py) land within "
        f"{100 * replay_gap:.1f}% of the priced pipeline on every row.")


if __name__ == "__main__":
    main()
