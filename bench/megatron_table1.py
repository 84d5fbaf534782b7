"""Predicted against published throughput for Table 1 of Narayanan et al. 2021 (Megatron-LM).

Each row's GPT model, layout (TP, PP, DP, micro-batch, interleaved chunks, full recomputation, as
in the authors' `examples/sc21/run_table_1.sh`) and batch run through `advisor`'s cost model on
the `a100-80g` preset with explicit attention (2021 Megatron had no FlashAttention). We compare the
paper's metric: its equation (3) FLOPs, which count the recomputed forward, over the predicted
step time, per GPU.

    python bench/megatron_table1.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from benchmarks_md import write_section  # noqa: E402
from paper_tables import MEGATRON_SEQ_LEN, MEGATRON_TABLE1, MEGATRON_VOCAB  # noqa: E402

from advisor.specs import Estimate, HardwareSpec, Layout, ModelSpec  # noqa: E402
from megatron_schedule import replay  # noqa: E402
from planner.cost_model import Placement, default_split, estimate, stage_time, step_seconds  # noqa: E402
from planner.memory import MEGATRON  # noqa: E402
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


def main() -> None:
    preset = load_hardware("a100-80g")
    hardware = megatron_2021(preset)
    rows = []
    for r in MEGATRON_TABLE1:
        est, predicted = predicted_tflops(r, preset)
        layout = row_layout(r)
        rows.append((r, layout, est, predicted, predicted / r["tflops_per_gpu"] - 1,
                     replayed_over_priced(row_model(r), layout, megatron_2021(preset, r["ddp"]))))

    lines = ["| params (B) | GPUs | TP | PP | DP | mbs | chunks | batch | published TFLOP/s | predicted | error "
             "| step s | compute % | bubble s | replayed / priced | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, layout, est, predicted, error, replayed in rows:
        lines.append(
            f"| {r['params_billion']} | {r['gpus']} | {layout.tp} | {layout.pp} | {layout.dp} | {layout.mbs} | "
            f"{layout.vpp} | {r['batch_size']} | {r['tflops_per_gpu']} | {predicted:.1f} | {100 * error:+.1f}% | "
            f"{est.time.step_s:.2f} | {100 * est.compute_fraction:.0f} | {est.time.bubble_s:.2f} | "
            f"{f'{replayed:.4f}' if layout.pp > 1 else '-'} | "
            f"{est.memory.peak / 2**30:.1f} |")
    worst = max(abs(row[4]) for row in rows)
    replay_gap = max(abs(row[5] - 1) for row in rows)
    body = "\n".join(lines) + (
        f"\n\nWorst error {100 * worst:.1f}% (goal: within 10%). Hardware: `a100-80g` preset "
        f"(gemm efficiency {hardware.efficiency.gemm}, NVLink {hardware.intra_node_bandwidth_gbs} GB/s, "
        f"IB {hardware.inter_node_bandwidth_gbs} GB/s per GPU). Layouts from the authors' run_table_1.sh; "
        "TFLOP/s in the paper's own metric (equation 3, recomputation counted).\n\n"
        "Why the table was optimistic (+5 ... +18%, every row): two systematic terms were missing. Megatron-LM's "
        "2021 DDP all-reduces the gradients after the last backward (no overlap): now priced with comm_overlap 0 "
        "for this engine. Eager attention's score matmuls have an arithmetic intensity of 2 head_dim / 2 bytes = "
        "96-160 FLOP/byte, at or under the A100's ridge point, so they run at memory speed (roofline), which "
        "weighs most on the small models (s/6h is 15% of their FLOPs at h = 2304).\n\n"
        "What remains is largest on the interleaved rows (76B, 145B, 310B), and it is not the pipeline schedule. "
        "Column *replayed / priced*: Megatron-LM's own 1F1B and interleaved-1F1B programs (the SC21 commit's "
        "warm-up counts, one blocking combined send/receive per forward+backward chunk pair, the ring from the "
        "last device back to the first, the embedding and head on the model's first and last chunk) replayed "
        "event by event with the priced stage times (tests/megatron_schedule.py). The replay lands within "
        f"{100 * replay_gap:.1f}% of the priced pipeline on every row: the bubble ((p - 1)/v slots), the 2v "
        "activation and gradient messages per micro-batch and device (both directions are charged; the ends "
        "of the model send one fewer) and their blocking waits are already what runs. With the scatter/gather "
        "optimisation each message is 1/tp of a boundary activation (5-20 MB at 20 GB/s), so all p2p traffic is "
        "about 1% of a step; doubling it would move the 76B row by 1 point. The interleaved rows' excess (4-7 "
        "points over the non-interleaved rows' +5 ... +10%) must come from outside the schedule as priced "
        "(e.g. what interleaving costs per chunk that the paper does not report: kernel-launch gaps after each "
        "blocking exchange's device synchronisation); we leave it unpriced rather than fit a factor to these rows.")
    print(body)
    write_section("megatron_table1", "Throughput: Narayanan et al. 2021, Table 1 (a100-80g)",
                  "python bench/megatron_table1.py", body)


if __name__ == "__main__":
    main()
