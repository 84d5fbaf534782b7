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

from advisor.specs import HardwareSpec, Layout, ModelSpec  # noqa: E402
from planner.cost_model import estimate  # noqa: E402
from planner.memory import MEGATRON  # noqa: E402
from presets import load_hardware  # noqa: E402


def paper_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, equation (3): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def megatron_2021(hardware: HardwareSpec) -> HardwareSpec:
    """The preset as Megatron-LM 2021 used it: no gradient all-reduce hidden behind backward."""
    return hardware.model_copy(update={"efficiency": hardware.efficiency.model_copy(update={"comm_overlap": 0.0})})


def main() -> None:
    hardware = megatron_2021(load_hardware("a100-80g"))
    rows = []
    for r in MEGATRON_TABLE1:
        config = {"model_type": "gpt2", "n_embd": r["hidden"], "n_layer": r["layers"], "n_head": r["heads"],
                  "n_positions": MEGATRON_SEQ_LEN, "vocab_size": MEGATRON_VOCAB, "activation_function": "gelu"}
        model = ModelSpec(name=f"gpt-{r['params_billion']}b", hf_config=config)
        gas = r["batch_size"] // (r["dp"] * r["micro_batch"])
        layout = Layout(dp=r["dp"], tp=r["tp"], pp=r["pp"], vpp=r["model_chunks"], mbs=r["micro_batch"], gas=gas,
                        recompute="full", dtype="fp16", seq=MEGATRON_SEQ_LEN)
        est = estimate(model, hardware, layout, attention="eager", engine=MEGATRON)
        flops = paper_flops_per_iteration(r["batch_size"], MEGATRON_SEQ_LEN, r["layers"], r["hidden"], MEGATRON_VOCAB)
        predicted = flops / est.time.step_s / r["gpus"] / 1e12
        rows.append((r, layout, est, predicted, predicted / r["tflops_per_gpu"] - 1))

    lines = ["| params (B) | GPUs | TP | PP | DP | mbs | chunks | batch | published TFLOP/s | predicted | error "
             "| step s | compute % | bubble s | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, layout, est, predicted, error in rows:
        lines.append(
            f"| {r['params_billion']} | {r['gpus']} | {layout.tp} | {layout.pp} | {layout.dp} | {layout.mbs} | "
            f"{layout.vpp} | {r['batch_size']} | {r['tflops_per_gpu']} | {predicted:.1f} | {100 * error:+.1f}% | "
            f"{est.time.step_s:.2f} | {100 * est.compute_fraction:.0f} | {est.time.bubble_s:.2f} | "
            f"{est.memory.peak / 2**30:.1f} |")
    worst = max(abs(e) for *_, e in rows)
    body = "\n".join(lines) + (
        f"\n\nWorst error {100 * worst:.1f}% (goal: within 10%). Hardware: `a100-80g` preset "
        f"(gemm efficiency {hardware.efficiency.gemm}, NVLink {hardware.intra_node_bandwidth_gbs} GB/s, "
        f"IB {hardware.inter_node_bandwidth_gbs} GB/s per GPU). Layouts from the authors' run_table_1.sh; "
        "TFLOP/s in the paper's own metric (equation 3, recomputation counted).\n\n"
        "Why the table was optimistic (+5 ... +18%, every row): two systematic terms were missing. Megatron-LM's "
        "2021 DDP all-reduces the gradients after the last backward (no overlap): now priced with comm_overlap 0 "
        "for this engine. Eager attention's score matmuls have an arithmetic intensity of 2 head_dim / 2 bytes = "
        "96-160 FLOP/byte, at or under the A100's ridge point, so they run at memory speed (roofline), which "
        "weighs most on the small models (s/6h is 15% of their FLOPs at h = 2304). What remains is largest on the "
        "interleaved rows (76B, 145B, 310B): the cost model charges an interleaved pipeline only its smaller "
        "bubble and v times the forward sends, not the backward sends nor the p2p synchronisation of each chunk.")
    print(body)
    write_section("megatron_table1", "Throughput: Narayanan et al. 2021, Table 1 (a100-80g)",
                  "python bench/megatron_table1.py", body)


if __name__ == "__main__":
    main()
