"""The compute time of one micro-batch on one device of a stage: dense GEMM and attention FLOPs at
the profile's rates (with the LM head's, the attention kernel's and the waves' corrections), the
memory-bound kernels' bytes, LoRA's skinny adapter GEMMs and, on a GPU with a measured host time per
op, the host floor (planner/host_floor.py)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from specs.capabilities import tf32_gemms
from specs.engine_traits import traits
from specs.core import (
                        DTYPE_BYTES,
                        HardwareSpec,
                        Layout,
                        )
from planner import host_floor, megatron2021
from planner.memory import (
    activation_blocks,
    layer_activation_bytes,
    logits_fp32_bytes,
    loss_runs_chunked,
)
from profiler.gemm_shapes import linear_gemms
from profiler.model_trace import ModelTrace


# Memory-bound kernels (norms, activations, softmax, dropout, residual adds) read and write about
# as many bytes as the activations they save; each saved byte is written in forward and read in
# backward, and their gradients are written and read once more.
ELEMENTWISE_PASSES = 4.0


# The loss's memory-bound passes over the fp32 logits (tokens x vocab) of one micro-batch: the
# log-softmax reads them for the maximum, again for the sum of exponentials, and once more to write
# the log-probabilities (4); backward fills and scatters the NLL's gradient, then reads it with the
# log-probabilities to write the logits' gradient (4). The chunked loss runs the forward's again in
# backward. At a 32k-64k vocabulary these passes outweigh a small model's layers on a CPU.
LOSS_FORWARD_PASSES = 4.0


LOSS_BACKWARD_PASSES = 4.0


@dataclass(frozen=True)
class Rates:
    """What one device achieves on this layout: dense and adapter GEMM FLOP/s, memory bytes/s, and
    the slow-down of its compute when the node's other devices compute too."""

    flop: float
    adapter: float
    byte: float
    slowdown: float
    time_shared: float  # of it, the cores' time-sharing alone (Python per micro-batch and collectives suffer it too)


# Tokens per micro-batch at which `Efficiency.gemm` holds as fitted; `gemm_tokens_slope` scales the
# GEMM time per doubling of them from here, up to the most tokens a calibration step measures (mbs 8
# at a quick profile's seq 256).
GEMM_REFERENCE_TOKENS = 256


GEMM_SLOPE_MAX_TOKENS = 8 * GEMM_REFERENCE_TOKENS


def gemm_tokens_factor(layout: Layout, hardware: HardwareSpec) -> float:
    """GEMM time at this layout's tokens per micro-batch (mbs x seq) over that at
    `GEMM_REFERENCE_TOKENS`: 1 + slope log2(tokens / reference) within the tokens the slope was
    measured over, flat outside them, floored at a quarter. The slope is measured
    (planner/calibration.py fits it to calibration steps at mbs 1 to 8); carried on in a straight
    line to 4096-8192 tokens, a fitted -8% per doubling priced those micro-batches' GEMMs 32-40%
    fast (bench/accuracy.py)."""
    slope = hardware.efficiency.gemm_tokens_slope
    if not slope:
        return 1.0
    tokens = min(max(layout.mbs * layout.seq, GEMM_REFERENCE_TOKENS), GEMM_SLOPE_MAX_TOKENS)
    return max(0.25, 1 + slope * math.log2(tokens / GEMM_REFERENCE_TOKENS))


def rates_for(layout: Layout, hardware: HardwareSpec) -> Rates:
    eff = hardware.efficiency
    # Compute slows down when the other devices of the node compute too (CPU cores share caches
    # and memory bandwidth; GPUs do not, contention 0), and more so when the node's ranks ask for
    # more threads than it has cores (the kernel time-shares them).
    busy = min(layout.devices, hardware.devices_per_node)
    time_shared = hardware.oversubscription(busy)
    return Rates(
        flop=hardware.peak_flops(layout.dtype) * eff.gemm / gemm_tokens_factor(layout, hardware),
        adapter=hardware.peak_flops(layout.dtype) * (eff.adapter_gemm or eff.gemm),
        byte=hardware.memory_bandwidth_gbs * 1e9 * eff.memory_bandwidth,
        slowdown=(1 + eff.node_contention * (busy - 1) / max(hardware.devices_per_node - 1, 1)) * time_shared,
        time_shared=time_shared,
    )


def loss_recompute_flops(trace: ModelTrace, layout: Layout, engine: str) -> float:
    """FLOPs per sequence that the loss recomputes in backward: the head's whole forward (LM head
    GEMM and cross-entropy) once more where the loss runs chunked (trainer/chunked_loss.py), each
    chunk's logits recomputed rather than kept; none under HF's loss."""
    return trace.head.fwd_flops if loss_runs_chunked(trace, layout, engine) else 0.0


def micro_batch_compute(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, engine: str, rates: Rates,
                         layers: int, recomputed: int, last: bool, vocab: int) -> tuple[float, float, float]:
    """(compute, useful compute, backward) seconds of one micro-batch on one stage; useful leaves
    out the recomputed forward (of layers, and of the head under the chunked loss). The head's FLOPs
    split `vocab` ways (`vocab_shards`), the rest tp. On a GPU with a host floor, `_floored_compute`."""
    if host_floor.has_floor(hardware, eager=traits(engine).eager):
        return _floored_compute(trace, layout, hardware, engine, rates, layers, recomputed, last, vocab)
    overhead_s = hardware.efficiency.micro_batch_overhead_s
    head_recompute_flops = loss_recompute_flops(trace, layout, engine)
    tp, mbs = layout.tp, layout.mbs
    layer = trace.layer
    head_share = tp / vocab if last else 0.0  # the head's FLOPs, in units divided by tp below
    fwd = layers * layer.fwd_flops + (trace.head.fwd_flops + head_recompute_flops) * head_share
    bwd = layers * layer.bwd_flops + trace.head.bwd_flops * head_share
    if layout.recompute == "full":
        fwd += recomputed * layer.fwd_flops
    slowdown, flop_rate, adapter_rate, byte_rate = rates.slowdown, rates.flop, rates.adapter, rates.byte
    overhead_s *= rates.time_shared
    # LoRA adapters run skinny GEMMs (rank r on one side) far below the dense rate: 2 FLOPs per
    # adapter parameter per token forward, 4 backward (input and weight gradients). They are part
    # of the traced FLOPs; here they move from the dense rate to the adapter rate.
    adapter = 2 * layer.trainable_params * trace.seq if layout.method in ("lora", "qlora") else 0.0
    adapter_fwd = adapter * (layers + (recomputed if layout.recompute == "full" else 0))
    adapter_bwd = 2 * adapter * layers
    traffic, useful_traffic = elementwise_bytes(trace, layout, engine, layers, recomputed)
    if last:
        loss_traffic, loss_useful = loss_elementwise_bytes(trace, layout, engine)
        traffic, useful_traffic = traffic + loss_traffic, useful_traffic + loss_useful
    fwd_s = slowdown * mbs * ((fwd - adapter_fwd) / flop_rate + adapter_fwd / adapter_rate) / tp
    bwd_s = slowdown * mbs * ((bwd - adapter_bwd) / flop_rate + adapter_bwd / adapter_rate) / tp
    compute = fwd_s + bwd_s + slowdown * traffic / byte_rate + overhead_s
    compute += slowdown * mbs * _score_matmul_extra_s(trace, layout, rates, layers, recomputed)
    compute += slowdown * mbs * _attention_extra_s(trace, layout, hardware, flop_rate, layers, recomputed)
    compute += slowdown * _gemm_wave_extra_s(trace, layout, hardware, flop_rate, layers, recomputed, last, vocab)
    if last:
        compute += slowdown * _head_gemm_extra_s(trace, layout, hardware, flop_rate, head_recompute_flops, vocab)
    model_flops = (layers * (layer.fwd_flops + layer.bwd_flops)
                   + (trace.head.fwd_flops + trace.head.bwd_flops) * head_share)
    adapter_all = 3 * adapter * layers
    useful = slowdown * mbs * ((model_flops - adapter_all) / flop_rate + adapter_all / adapter_rate) / tp
    useful += slowdown * useful_traffic / byte_rate + overhead_s
    useful += slowdown * mbs * _attention_extra_s(trace, layout, hardware, flop_rate, layers, 0)
    useful += slowdown * _gemm_wave_extra_s(trace, layout, hardware, flop_rate, layers, 0, last, vocab)
    if last:
        useful += slowdown * _head_gemm_extra_s(trace, layout, hardware, flop_rate, 0.0, vocab)
    return compute, useful, bwd_s


def _dense_flops(trace: ModelTrace, layout: Layout, layers: int, recomputed: int, last: bool, vocab: int,
                 head_recompute: float) -> tuple[float, float, float]:
    """(all, fp32, adapter) GEMM and attention FLOPs of one sequence on one device of a stage, with
    the forward of `recomputed` layers (full recomputation) and `head_recompute` (the chunked loss)
    again: fp32 are those the trace saw computed in fp32 (`fp32_dense_flops`), adapter those of
    LoRA's adapters (2 per adapter parameter and token forward, 4 backward)."""
    layer, head = trace.layer, trace.head
    again = recomputed if layout.recompute == "full" else 0
    fwd_share = layer.fwd_flops / max(layer.fwd_flops + layer.bwd_flops, 1.0)
    head_share = layout.tp / vocab if last else 0.0
    passes = layers + again * fwd_share  # in units of a layer's forward and backward
    flops = passes * (layer.fwd_flops + layer.bwd_flops) + (head.fwd_flops + head_recompute + head.bwd_flops) * head_share
    fp32 = passes * layer.fp32_dense_flops + head.fp32_dense_flops * head_share
    adapter = 2 * layer.trainable_params * trace.seq if layout.method in ("lora", "qlora") else 0.0
    return flops, fp32, adapter * (3 * layers + again)


def _floored_compute(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, engine: str, rates: Rates,
                     layers: int, recomputed: int, last: bool, vocab: int) -> tuple[float, float, float]:
    """`micro_batch_compute` under the host floor (planner/host_floor.py): the dense kernels (GEMMs,
    attention) priced by their FLOPs, fp32 ones at the fp32 rate (TF32 where the engine allows it)
    and LoRA's skinny adapters by the bytes they move where that is slower; the memory-bound kernels
    by the bytes the trace counted; each kind at least its kernels' launches."""
    layer, head = activation_blocks(trace, layout, engine)
    chunked = loss_runs_chunked(trace, layout, engine)
    fp32_rate = hardware.efficiency.gemm * hardware.peak_flops(
        "tf32" if tf32_gemms(engine) and hardware.supports("tf32") else "fp32")
    per_seq = layout.mbs / layout.tp

    def seconds(again: int, useful: bool) -> tuple[float, float]:
        head_recompute = 0.0 if useful else loss_recompute_flops(trace, layout, engine)
        flops, fp32, adapter = _dense_flops(trace, layout, layers, again, last, vocab, head_recompute)
        adapter_fp32 = min(adapter, fp32)  # peft's adapters are fp32 beside a 16-bit base
        dense = per_seq * ((flops - fp32 - (adapter - adapter_fp32)) / rates.flop + (fp32 - adapter_fp32) / fp32_rate)
        skinny = per_seq * (layers + again) * layer.skinny_gemm_bytes / rates.byte
        dense += max(per_seq * adapter_fp32 / fp32_rate, skinny) + per_seq * (adapter - adapter_fp32) / rates.adapter
        dense += layout.mbs * _attention_extra_s(trace, layout, hardware, rates.flop, layers, again)
        dense += _gemm_wave_extra_s(trace, layout, hardware, rates.flop, layers, again, last, vocab)
        if last:
            dense += _head_gemm_extra_s(trace, layout, hardware, rates.flop, head_recompute, vocab)
        launches = host_floor.micro_batch_launches(layer, head, layout, layers, again, last, chunked, useful)
        traffic = launches.traffic_bytes
        if last and chunked and not useful:
            every, kept = loss_elementwise_bytes(trace, layout, engine)
            traffic += every - kept  # the chunks' recomputed forward
        dense_s = host_floor.floored(rates.slowdown * dense, launches.dense_ops, hardware)
        return dense_s + host_floor.floored(rates.slowdown * traffic / rates.byte, launches.small_ops, hardware), dense_s

    compute, _ = seconds(recomputed, useful=False)
    useful, _ = seconds(0, useful=True)
    backward = layer.bwd_flops / max(layer.fwd_flops + layer.bwd_flops, 1.0) * useful
    return compute, useful, backward


def _head_gemm_extra_s(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, rate: float,
                       recompute_flops: float, vocab: int) -> float:
    """Seconds one micro-batch's LM-head GEMMs (forward, and again where the loss recomputes it;
    input and weight gradients) take beyond their FLOPs at the dense rate: the profile measured the
    head's own rate at the vocabulary one device holds (`HardwareSpec.head_gemm`; a CPU runs a
    64k-wide head at ~70% of its decoder GEMMs' rate). 0 where nothing was measured."""
    if hardware.head_gemm is None:
        return 0.0
    relative = hardware.head_gemm.at(trace.vocab_size / vocab)
    flops = layout.mbs * (trace.head.fwd_flops + recompute_flops + trace.head.bwd_flops) / vocab
    return flops * (1 / relative - 1) / rate


def loss_elementwise_bytes(trace: ModelTrace, layout: Layout, engine: str) -> tuple[float, float]:
    """(all, without recomputation) bytes the loss's memory-bound kernels move for one micro-batch
    on the last stage (`LOSS_FORWARD_PASSES`, `LOSS_BACKWARD_PASSES` over its fp32 logits)."""
    logits = logits_fp32_bytes(trace, layout, engine)
    useful = (LOSS_FORWARD_PASSES + LOSS_BACKWARD_PASSES) * logits
    again = LOSS_FORWARD_PASSES * logits if loss_runs_chunked(trace, layout, engine) else 0.0
    return useful + again, useful


def elementwise_bytes(trace: ModelTrace, layout: Layout, engine: str, layers: int,
                       recomputed: int) -> tuple[float, float]:
    """(all, without recomputation) bytes one micro-batch's memory-bound kernels move on one stage.
    Megatron-LM's 2021 layer is counted kernel by kernel (planner/megatron2021.py); for the engines
    we run, about `ELEMENTWISE_PASSES` x the activations a layer saves."""
    if not traits(engine).eager:  # Megatron-LM 2021's fused layer
        fwd, bwd = megatron2021.layer_elementwise_bytes(trace, layout)
        again = recomputed * fwd if layout.recompute == "full" else 0.0
        return layers * (fwd + bwd) + again, layers * (fwd + bwd)
    kept = layer_activation_bytes(trace, layout, recompute="none", engine=engine)
    traffic = ELEMENTWISE_PASSES * layers * kept
    if layout.recompute == "full":  # the forward's writes happen twice
        traffic += ELEMENTWISE_PASSES / 4 * recomputed * kept
    elif layout.recompute == "selective":  # no GEMM runs again: the element-wise ops write what was not kept
        kept_selective = layer_activation_bytes(trace, layout, engine=engine)
        traffic += ELEMENTWISE_PASSES / 4 * recomputed * max(kept - kept_selective, 0.0)
    return traffic, ELEMENTWISE_PASSES * layers * kept


def wave_efficiency(rows: int, cols: int, hardware: HardwareSpec) -> float:
    """Share of the SM time a GEMM with a rows x cols output spends on its output: the kernel
    covers the output with `gemm_tile` tiles (either orientation, whichever wastes less; the edge
    tiles are padded) and runs them `sm_count` at a time, so its time is its number of full
    waves (tile and wave quantization: NVIDIA's "Matrix Multiplication Background User's Guide").
    cuBLAS may pick a smaller, slower tile or split K for a GEMM of few waves: there this is the
    high end of the loss. 1 where the hardware declares no SM count (CPUs, measured profiles, whose
    GEMM rate is measured at the model's own shapes)."""
    if hardware.sm_count is None or hardware.gemm_tile is None:
        return 1.0
    return _tiled_share(rows, cols, hardware.sm_count, tuple(hardware.gemm_tile))


@functools.lru_cache(maxsize=65536)
def _tiled_share(rows: int, cols: int, sm_count: int, tile: tuple[int, int]) -> float:
    best = 0.0
    for tile_rows, tile_cols in {tile, tile[::-1]}:
        tiles = math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols)
        slots = math.ceil(tiles / sm_count) * sm_count
        best = max(best, rows * cols / (tile_rows * tile_cols) / slots)
    return best


def layer_linears(trace: ModelTrace, tp: int) -> tuple[tuple[int, int], ...]:
    """(fan in, fan out) on one device of each linear layer of a decoder layer, under Megatron's
    tensor-parallel split: a column-parallel linear divides its outputs by tp, a row-parallel one
    its inputs (each runs over mbs x seq tokens; sequence parallelism gathers them back before each
    GEMM). The attention's q, k and v projections count as one fused GEMM (Megatron, GPT-2; HF Llama
    runs three); the MLP has two or three matrices, as the layer's parameters say."""
    h = trace.hidden_size
    q, kv = trace.num_heads * trace.head_dim, trace.num_kv_heads * trace.head_dim
    mlp = round((trace.layer.params - 2 * h * q - 2 * h * kv) / (h * trace.intermediate_size))
    columns = [q + 2 * kv] + [trace.intermediate_size] * max(min(mlp, 3) - 1, 1)
    return tuple([(h, out // tp) for out in columns] + [(q // tp, h), (trace.intermediate_size // tp, h)])


def _gemm_wave_extra_s(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, rate: float, layers: int,
                       recomputed: int, last: bool, vocab: int) -> float:
    """Seconds one micro-batch's linear GEMMs on one stage lose to tile and wave quantization
    (`wave_efficiency`) beyond their FLOPs at the dense rate: forward once per layer and once more
    per recomputed layer, input and weight gradients once (no weight gradient for frozen weights
    under LoRA/QLoRA); the LM head's (vocabulary split `vocab` ways) once, on the last stage."""
    if hardware.sm_count is None:
        return 0.0
    trains = layout.method == "full"
    tokens, tile = layout.mbs * trace.seq, tuple(hardware.gemm_tile)
    fwd, dgrad, wgrad = _lost_flops_per_pass(layer_linears(trace, layout.tp), tokens, hardware.sm_count, tile)
    lost = fwd * (layers + (recomputed if layout.recompute == "full" else 0)) + dgrad * layers
    lost += wgrad * layers if trains else 0.0
    if last:
        head = ((trace.hidden_size, trace.vocab_size // vocab),)
        fwd, dgrad, wgrad = _lost_flops_per_pass(head, tokens, hardware.sm_count, tile)
        lost += fwd + dgrad + (wgrad if trains else 0.0)
    return lost / rate


@functools.lru_cache(maxsize=16384)
def _lost_flops_per_pass(linears: tuple[tuple[int, int], ...], tokens: int, sm_count: int,
                         tile: tuple[int, int]) -> tuple[float, float, float]:
    """FLOPs the GEMMs of these linears over `tokens` tokens lose to quantization, summed per pass
    (forward, input gradient, weight gradient). The planner asks this for the same few shapes tens
    of thousands of times per plan, so it is cached on plain numbers."""
    lost = {"fwd": 0.0, "dgrad": 0.0, "wgrad": 0.0}
    for fan_in, fan_out in linears:
        for g in linear_gemms(tokens, fan_in, fan_out):
            lost[g.name] += g.flops * (1 / _tiled_share(g.m, g.n, sm_count, tile) - 1)
    return lost["fwd"], lost["dgrad"], lost["wgrad"]


def _attention_extra_s(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, rate: float, layers: int,
                       recomputed: int) -> float:
    """Seconds the fused attention kernel of one sequence takes beyond its counted FLOPs at the dense
    rate: the profile measured the kernel's own rate at the sequence length (`HardwareSpec.attention`;
    a CPU runs its counted FLOPs at 65% of its GEMMs' rate at seq 256, 93% at 1024). Forward once
    per layer and again under full recomputation (the selective policy keeps its output), backward
    twice the forward's FLOPs.
    Eager attention is priced by `_score_matmul_extra_s`; 0 where nothing was measured."""
    if hardware.attention is None or trace.attention == "eager":
        return 0.0
    per_layer_fwd = 4 * trace.seq * trace.seq * trace.num_heads * trace.head_dim  # QK^T and scores x V
    passes = 3 * layers + (recomputed if layout.recompute == "full" else 0)
    return passes * per_layer_fwd / layout.tp * (1 / hardware.attention.at(trace.seq) - 1) / rate


def _score_matmul_extra_s(trace: ModelTrace, layout: Layout, rates: Rates, layers: int, recomputed: int) -> float:
    """Seconds that explicit (eager) attention's two score matmuls, QK^T and scores x V, lose to
    memory bandwidth on one sequence, beyond their FLOPs at the dense GEMM rate.

    Each s x s score element costs 2 * head_dim FLOPs and is written (or read) once in the
    activation dtype: an arithmetic intensity of 2 * head_dim / bytes FLOP/byte, below a GPU's
    ridge point for head_dim <= ~128 in 16 bits (roofline: Williams et al. 2009). Fused
    (flash/sdpa) kernels never write the scores, so this applies to eager attention only.
    """
    if trace.attention != "eager":
        return 0.0
    intensity = 2 * trace.head_dim / DTYPE_BYTES[layout.dtype]
    rate = min(rates.flop, rates.byte * intensity)
    if rate >= rates.flop:
        return 0.0
    per_layer_fwd = 4 * trace.seq * trace.seq * trace.num_heads * trace.head_dim  # QK^T and scores x V
    passes = 3 * layers + (recomputed if layout.recompute == "full" else 0)  # forward 1, backward 2
    return passes * per_layer_fwd / layout.tp * (1 / rate - 1 / rates.flop)
