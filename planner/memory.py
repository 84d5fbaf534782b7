"""Per-device memory of one layout: model states, activations in flight, and transients.

The single home of every memory formula; the ILP, the reports and the run summary read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from advisor.specs import DTYPE_BYTES, Layout
from profiler.model_trace import ModelTrace

# Bytes per parameter of a 4-bit NF4 weight with double quantisation (Dettmers et al. 2023,
# QLoRA section 3): 4 bits + an 8-bit absmax per 64-weight block + an fp32 constant per 256 blocks.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
# What bitsandbytes keeps once per quantised tensor besides its blocks, all fp32: the 16-value NF4
# code book, the offset of the double-quantised absmax and the 256-value code of its 8-bit quantiser.
NF4_TENSOR_BYTES = 4 * (16 + 1 + 256)
# peft's `prepare_model_for_kbit_training` (the QLoRA recipe the trainer runs) up-casts every frozen
# tensor it does not quantise (embeddings, norms, the LM head) to fp32.
QLORA_UNQUANTIZED_BYTES = 4
# peft keeps LoRA adapters in fp32 by default (`autocast_adapter_dtype=True`), whatever the base.
ADAPTER_BYTES = 4
# Gradient bucket sizes that our exported DeepSpeed/DDP configs set (trainer and planner share them).
DDP_BUCKET_BYTES = 25 * 2**20
ZERO_REDUCE_BUCKET_ELEMS = 50_000_000
ZERO3_PREFETCH_LAYERS = 2  # the layer being computed plus the one being all-gathered ahead


# Share of a node's RAM that offloaded states may use: the OS, the data loader and pinned
# staging buffers need the rest (assumed).
HOST_MEMORY_USABLE = 0.8


@dataclass(frozen=True)
class ModelStates:
    weights: float
    gradients: float
    optimizer: float
    host: float = 0.0  # bytes of this device's states kept in host RAM by offload

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


def optimizer_bytes_per_param(layout: Layout) -> int:
    """Adam: fp32 momentum and variance, plus an fp32 master copy unless training is pure fp32.

    DeepSpeed ZeRO keeps its own fp32 partition even when the model is fp32 (it clones the
    partition into the optimizer), so K = 12 whenever ZeRO >= 1 (ZeRO paper, section 3.1: K = 12).
    """
    if layout.dtype != "fp32" or layout.zero >= 1:
        return 12
    return 8


def model_state_bytes(
    params: float, trainable: float, layout: Layout, quantizable: float | None = None, nf4_tensors: float = 0.0
) -> ModelStates:
    """Weights, gradients and optimizer states on one device, for `params` held by its shard.

    `params` and `trainable` are counted after tensor/pipeline splitting but before ZeRO;
    `quantizable` is the frozen part that QLoRA stores in NF4 (decoder linear layers), in
    `nf4_tensors` tensors; the rest of its frozen part is fp32.
    ZeRO stage 1 divides the optimizer states by dp, stage 2 also the gradients, stage 3 also
    the weights (Rajbhandari et al. 2020, section 5).
    """
    w = DTYPE_BYTES[layout.dtype]
    dp = layout.dp
    if layout.method == "full":
        weights = params * w
        grads = trainable * w
        optim = trainable * optimizer_bytes_per_param(layout)
    else:
        frozen = params - trainable
        if layout.method == "qlora":
            nf4 = quantizable if quantizable is not None else frozen
            weights = ((frozen - nf4) * QLORA_UNQUANTIZED_BYTES + nf4 * NF4_BYTES_PER_PARAM
                       + nf4_tensors * NF4_TENSOR_BYTES)
        else:
            weights = frozen * w
        weights += trainable * ADAPTER_BYTES
        grads = trainable * ADAPTER_BYTES
        optim = trainable * 8  # fp32 adapters need no separate master copy
    if layout.zero >= 1:
        optim /= dp
    if layout.zero >= 2:
        grads /= dp
    if layout.zero >= 3:
        weights /= dp
    host = 0.0
    if layout.offload != "none":
        # ZeRO-Offload (Ren et al. 2021): the fp32 master weights, Adam moments and, from ZeRO-2 on,
        # the fp32 gradient partition live in host RAM; the device keeps 16-bit weights and buckets.
        trainable_share = trainable / (dp if layout.zero >= 1 else 1)
        host = optim + (4 * trainable_share if layout.zero >= 2 else 0.0)
        optim = 0.0
        if layout.zero >= 2:
            grads = 0.0
    if layout.offload == "optimizer+params":
        host += weights
        weights = 0.0
    return ModelStates(weights, grads, optim, host)


def micro_batches_in_flight(stage: int, layout: Layout) -> float:
    """Micro-batches whose activations a stage holds at its peak, in whole-stage units, under the
    schedule the pipeline engine runs (torch.distributed.pipelining).

    1F1B (gas >= pp): stage r keeps pp - r micro-batches. GPipe (gas < pp, which 1F1B cannot
    fill): every forward runs before the first backward, so every stage keeps all gas.
    Interleaved 1F1B (vpp > 1, gas a multiple of pp): rank r runs 2(pp - r - 1) + (vpp - 1)pp
    warm-up chunks plus one, each chunk 1/vpp of the stage (Korthikanti et al. 2022, section 4.2.3:
    the first stage holds L(1 + (p-1)/(pm)) layers; torch's `_get_warmup_ops` with rounds of pp).
    """
    pp, vpp, gas = layout.pp, layout.vpp, layout.gas
    if pp == 1:
        return 1.0
    if vpp == 1:
        return float(pp - stage if gas >= pp else gas)
    chunks = min(2 * (pp - stage - 1) + (vpp - 1) * pp, gas * vpp - 1) + 1
    return chunks / vpp


def layer_activation_bytes(trace: ModelTrace, layout: Layout, recompute: str | None = None) -> float:
    """Bytes one decoder layer keeps for backward, per micro-batch, on one device.

    Replicated tensors (LayerNorm inputs, dropout masks after row-parallel linears) are divided by
    tp only with sequence parallelism; tensors inside TP regions always are (Korthikanti et al.
    2022, Table 2). Full recomputation keeps the layer's input only (sequence-sharded under sp).
    Selective recomputation (`advisor.specs.SELECTIVE_POLICY`) keeps that input plus the outputs
    of the GEMMs and the attention kernel, as the trace measured them under the same op list.
    """
    recompute = recompute or layout.recompute
    layer = trace.layer
    tp = layout.tp
    seq_split = tp if layout.sp else 1
    if recompute == "full":
        return layer.input_bytes / seq_split * layout.mbs
    if recompute == "selective":
        kept = (layer.input_bytes + layer.selective_replicated_bytes) / seq_split + layer.selective_sharded_bytes / tp
        return kept * layout.mbs
    replicated = layer.act_replicated_bytes / seq_split
    return (replicated + layer.act_sharded_bytes / tp) * layout.mbs


def head_activation_bytes(trace: ModelTrace, layout: Layout) -> float:
    """Final norm and lm_head input plus the fp32 log-softmax that the loss keeps (vocab-parallel)."""
    head = trace.head
    replicated = head.act_replicated_bytes / (layout.tp if layout.sp else 1)
    return (replicated + head.act_sharded_bytes / layout.tp) * layout.mbs


def logits_transient_bytes(trace: ModelTrace, layout: Layout) -> float:
    """Loss buffers alive at the start of backward beyond the saved fp32 log-softmax, per device.

    The fp32 gradient of the log-softmax (the size of the logits), plus its down-cast copy when
    the model computes in 16 bits. Measured on this CPU in fp32: one logits-sized buffer.
    """
    tokens_vocab = layout.mbs * trace.seq * trace.vocab_size / layout.tp
    w = DTYPE_BYTES[layout.dtype]
    return tokens_vocab * (4 + (w if w != 4 else 0))
