"""Per-device memory of one layout: model states, activations in flight, and transients.

The single home of every memory formula; the ILP, the reports and the run summary read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from specs.capabilities import LOSS_CHUNK_TOKENS, autocast_kept_dtype, chunked_loss, engine_for, precision
from specs.capabilities import fsdp_shards  # declared beside `precision`; the cost model reads it here
from specs.engine_traits import traits  # how each engine keeps its state, declared once
from specs.core import DTYPE_BYTES, Layout
from profiler.model_trace import NF4_BYTES_PER_PARAM, BlockTrace, ModelTrace

# What bitsandbytes keeps once per quantised tensor besides its blocks, all fp32: the 16-value NF4
# code book, the offset of the double-quantised absmax and the 256-value code of its 8-bit quantiser.
NF4_TENSOR_BYTES = 4 * (16 + 1 + 256)
# peft's `prepare_model_for_kbit_training` (the QLoRA recipe the trainer runs) up-casts every frozen
# tensor it does not quantise (embeddings, norms, the LM head) to fp32.
QLORA_UNQUANTIZED_BYTES = 4
# peft keeps LoRA adapters in fp32 by default (`autocast_adapter_dtype=True`), whatever the base.
ADAPTER_BYTES = 4
ZERO3_PREFETCH_LAYERS = 2  # the layer being computed plus the one being all-gathered ahead
# DeepSpeed ZeRO-3 defaults our exported config keeps: a gathered parameter is released only when its
# next use is further than stage3_max_reuse_distance parameters away, and at most
# stage3_max_live_parameters stay gathered. With both at 1e9, a stage of fewer parameters stays
# gathered whole from its forward to its backward (measured on this CPU: exactly the whole model).
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000


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


def master_weights(layout: Layout, engine: str) -> bool:
    """Whether the optimizer keeps a separate fp32 copy of the weights it updates, as the engine runs
    the layout's dtype (specs.capabilities `precision`): DeepSpeed ZeRO does (its fp32 partitions;
    ZeRO paper, section 3.1: K = 12), and so does Megatron-LM. The other engines keep the weights
    they update in fp32 and compute in 16 bits through autocast or FSDP2's MixedPrecisionPolicy:
    the fp32 weights are the master, there is no separate copy."""
    return precision(layout, engine).master


def stored_dtype_bytes(layout: Layout, engine: str) -> int:
    """Bytes per element of the trainable weights an engine stores, and of their gradients: fp32
    wherever the weights are the optimizer's master (fp32 layouts, bf16-mixed through autocast or
    FSDP2), the layout's 16-bit dtype where DeepSpeed keeps a 16-bit module beside its fp32 master
    (specs.capabilities `precision`)."""
    return precision(layout, engine).weight_bytes


def autocasts(layout: Layout, engine: str) -> bool:
    """Whether `engine` runs `layout` under autocast (specs.capabilities `precision`); Megatron-LM,
    priced for published runs, casts its module instead."""
    return precision(layout, engine).autocast


def autocast_kept_bytes(layout: Layout, engine: str) -> int:
    """Bytes per element of what autocast keeps in fp32 (specs.capabilities `autocast_kept_dtype`):
    the hidden states between decoder layers (a pipeline's boundary activation) and a trainable
    weight's gradient as backward produces it; the layout's dtype where nothing autocasts."""
    return DTYPE_BYTES[autocast_kept_dtype(layout, engine)]


def gradient_dtype_bytes(layout: Layout, engine: str) -> int:
    """Bytes per element of the trainable weights' gradients as the engine keeps and reduces them:
    `stored_dtype_bytes`, but fp32 where Megatron-LM accumulates bf16 gradients (specs.capabilities
    `precision`)."""
    return precision(layout, engine).gradient_bytes


def optimizer_bytes_per_param(layout: Layout, engine: str = "deepspeed") -> int:
    """Adam's two moments in the dtype of the weights it updates (torch keeps them so), plus the fp32
    master copy where the engine keeps one (`master_weights`): K = 12 for DeepSpeed, 8 elsewhere
    (the weights it updates are fp32); 4 where a module cast to 16 bits is updated directly
    (`precision` cast16: the pre-issue-28 plain engine the GPU evidence was measured with); 4 more
    where it takes an fp32 copy of 16-bit gradients (Megatron-LM's fp16)."""
    kept = precision(layout, engine)
    copy = 4 if kept.fp32_grad_copy else 0
    return (12 if kept.master else 2 * kept.weight_bytes) + copy


def model_state_bytes(
    params: float, trainable: float, layout: Layout, quantizable: float | None = None, nf4_tensors: float = 0.0,
    engine: str | None = None,
) -> ModelStates:
    """Weights, gradients and optimizer states on one device, for `params` held by its shard, as
    `engine` (specs.capabilities.engine_for; None: the one that runs `layout` by default) keeps them.

    `params` and `trainable` are counted after tensor/pipeline splitting but before ZeRO;
    `quantizable` is the frozen part that QLoRA stores in NF4 (decoder linear layers), in
    `nf4_tensors` tensors; the rest of its frozen part is fp32.
    DeepSpeed: ZeRO stage 1 divides the optimizer states by dp, stage 2 also the gradients, stage 3
    also the weights (Rajbhandari et al. 2020, section 5). FSDP2 divides all three by dp at every
    stage, in the dtype it stores (`stored_dtype_bytes`).
    """
    engine = engine or engine_for(layout)
    w = stored_dtype_bytes(layout, engine)
    dp = layout.dp
    if layout.method == "full":
        weights = params * w
        grads = trainable * gradient_dtype_bytes(layout, engine)
        optim = trainable * optimizer_bytes_per_param(layout, engine)
    else:
        frozen = params - trainable
        if layout.method == "qlora":
            nf4 = quantizable if quantizable is not None else frozen
            weights = ((frozen - nf4) * QLORA_UNQUANTIZED_BYTES + nf4 * NF4_BYTES_PER_PARAM
                       + nf4_tensors * NF4_TENSOR_BYTES)
        else:
            weights = frozen * DTYPE_BYTES[layout.dtype]  # the frozen base stays in the layout's dtype
        weights += trainable * ADAPTER_BYTES
        grads = trainable * ADAPTER_BYTES
        optim = trainable * 8  # fp32 adapters need no separate master copy
    if fsdp_shards(layout, engine):
        # below ZeRO-2, FSDP2 skips the reduce-scatter while accumulating: whole gradients until the last micro-batch
        whole_grads = layout.zero <= 1 and layout.gas > 1
        return ModelStates(weights / dp, grads if whole_grads else grads / dp, optim / dp, 0.0)
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


def gathered_parameter_bytes(params: float, layer_params: float, root_params: float, layout: Layout,
                             engine: str) -> float:
    """Full (unsharded) weights alive at the start of backward beyond the device's shards, in the
    compute dtype. `params`: the stage's parameters after TP; `layer_params`: one decoder layer's;
    `root_params`: what sits outside the decoder layers (embedding, final norm, head).

    DeepSpeed ZeRO-3 keeps up to stage3_max_live_parameters gathered (`ZERO3_MAX_LIVE_PARAMETERS`),
    at least the layer being computed and the one prefetched. FSDP2 (dp > 1) does not
    reshard after forward below ZeRO-3 (nor ever under the pipeline engine: torchtitan's rule), so
    every unit stays gathered from its forward to its backward: the whole stage at the start of
    backward. With ZeRO-3 it reshards each layer after forward; the root unit (embedding, norm,
    head) stays gathered, since backward needs it first.
    """
    w = DTYPE_BYTES[layout.dtype]
    if traits(engine).flat_partition:
        if layout.zero < 3:
            return 0.0
        return max(min(params, ZERO3_MAX_LIVE_PARAMETERS), ZERO3_PREFETCH_LAYERS * layer_params) * w
    if not fsdp_shards(layout, engine):
        return 0.0
    if layout.zero == 3 and traits(engine).reshards_after_forward:
        return (root_params + ZERO3_PREFETCH_LAYERS * layer_params) * w
    return params * w


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


def activation_blocks(trace: ModelTrace, layout: Layout, engine: str | None = None) -> tuple[BlockTrace, BlockTrace]:
    """The traced decoder layer and head as `engine` computes `layout`: under autocast (fp32
    residual stream and norm inputs, 16-bit GEMM outputs: specs.capabilities `precision`) the
    trace's autocast blocks, else its 16-bit (or fp32) module's."""
    engine = engine or engine_for(layout)
    if trace.autocast is not None and autocasts(layout, engine):
        return trace.autocast.layer, trace.autocast.head
    return trace.layer, trace.head


def autocast_weight_copy_bytes(trace: ModelTrace, layout: Layout, engine: str, layers: int, last: bool) -> float:
    """The 16-bit copies autocast makes of a device's weights (every GEMM's: the decoder layers'
    projections, the LM head), as the trace measured them: alive from the weight's first use in
    forward (autocast caches them) to its backward, so all of them at the start of backward. Counted
    whatever the recomputation too: at the end of forward, the loss's buffers beside them, the cache
    still holds every copy. The pipeline engine autocasts a whole step, so its micro-batches share
    one copy of each weight."""
    if trace.autocast is None or not autocasts(layout, engine):
        return 0.0
    copies = layers * trace.autocast.layer.cast_weight_bytes / layout.tp
    if last:
        copies += trace.autocast.head.cast_weight_bytes / vocab_shards(layout, engine)
    return copies


def layer_activation_bytes(trace: ModelTrace, layout: Layout, recompute: str | None = None,
                           engine: str | None = None) -> float:
    """Bytes one decoder layer keeps for backward, per micro-batch, on one device.

    Replicated tensors (LayerNorm inputs, dropout masks after row-parallel linears) are divided by
    tp only with sequence parallelism; tensors inside TP regions always are (Korthikanti et al.
    2022, Table 2). Full recomputation keeps the layer's input only (sequence-sharded under sp).
    Selective recomputation (`specs.core.SELECTIVE_POLICY`) keeps that input plus the outputs
    of the GEMMs and the attention kernel, as the trace measured them under the same op list.
    """
    recompute = recompute or layout.recompute
    layer, _ = activation_blocks(trace, layout, engine)
    tp = layout.tp
    seq_split = tp if layout.sp else 1
    if recompute == "full":
        return layer_input_bytes(trace, layout, engine) / seq_split * layout.mbs
    if recompute == "selective":
        kept_input = layer_input_bytes(trace, layout, engine)
        kept = (kept_input + layer.selective_replicated_bytes) / seq_split + layer.selective_sharded_bytes / tp
        return kept * layout.mbs
    replicated = layer.act_replicated_bytes / seq_split
    return (replicated + layer.act_sharded_bytes / tp) * layout.mbs


def layer_input_bytes(trace: ModelTrace, layout: Layout, engine: str | None = None) -> float:
    """A decoder layer's input hidden states for one sequence, in the residual stream's dtype: what a
    checkpointed layer keeps (the trace's: fp32 under autocast and in QLoRA's up-cast model, whose
    embedding and norms peft's `prepare_model_for_kbit_training` makes fp32 and whose `Linear4bit`s
    return their input's dtype; measured with the CPU allocator counter, tests/test_hf_loss_memory.py)."""
    layer, _ = activation_blocks(trace, layout, engine)
    return layer.input_bytes


def vocab_shards(layout: Layout, engine: str | None = None) -> int:
    """How many ways tensor parallelism splits the embedding, the LM head and the logits: Megatron's
    vocab-parallel layers divide them by tp; the trainer's DTensor engines (fsdp2, pipeline) split
    the decoder layers only and keep these whole on every TP rank (trainer/parallelize.py
    apply_tensor_parallel), so every rank computes the full logits and loss."""
    engine = engine or engine_for(layout)
    return layout.tp if traits(engine).vocab_parallel else 1


def loss_runs_chunked(trace: ModelTrace, layout: Layout, engine: str | None = None) -> bool:
    """Whether the trainer computes this layout's loss chunk by chunk (specs.capabilities
    `chunked_loss`, trainer/chunked_loss.py) rather than through HF's loss over the whole logits."""
    engine = engine or engine_for(layout)
    return traits(engine).eager and chunked_loss(layout, engine,  # type: ignore[arg-type]
                                               trace.model_type, trace.hidden_size)


def loss_chunk_tokens(trace: ModelTrace, layout: Layout, engine: str | None = None) -> int:
    """Tokens whose logits the loss holds at once: one chunk (`LOSS_CHUNK_TOKENS`) where the loss
    runs chunked, else the whole micro-batch."""
    tokens = layout.mbs * trace.seq
    return min(LOSS_CHUNK_TOKENS, tokens) if loss_runs_chunked(trace, layout, engine) else tokens


def loss_chunks(trace: ModelTrace, layout: Layout, engine: str | None = None) -> int:
    """Chunks one micro-batch's loss runs in: several where the chunked loss splits it, else 1."""
    return -(-layout.mbs * trace.seq // loss_chunk_tokens(trace, layout, engine))


def head_activation_bytes(trace: ModelTrace, layout: Layout, engine: str | None = None) -> float:
    """Final norm and lm_head input plus the fp32 log-softmax that HF's loss keeps (vocab-parallel
    where the engine splits the vocabulary); the chunked loss keeps no log-softmax (each chunk's is
    recomputed in backward), only the head's input. The pipeline engine's schedule also keeps the last
    stage's output, the logits in the layout's dtype, until it runs that micro-batch's backward
    (measured: one more logits-sized buffer on the last stage)."""
    engine = engine or engine_for(layout)
    _, head = activation_blocks(trace, layout, engine)
    replicated = head.act_replicated_bytes / (layout.tp if layout.sp else 1)
    kept = (replicated + head.act_sharded_bytes / vocab_shards(layout, engine)) * layout.mbs
    if loss_runs_chunked(trace, layout, engine):
        kept -= logits_fp32_bytes(trace, layout, engine)  # the trace ran HF's loss: its saved log-softmax
    if traits(engine).pipeline_schedule:
        kept += logits_fp32_bytes(trace, layout, engine) * DTYPE_BYTES[layout.dtype] / 4
    return kept


def logits_transient_bytes(trace: ModelTrace, layout: Layout, engine: str | None = None) -> float:
    """Loss buffers alive at the start of backward beyond the activations kept, per device.

    HF's loss up-casts the logits to fp32 and `cross_entropy` saves its fp32 log-softmax (in the
    traced head activations). Its backward then holds two more fp32 buffers of the logits' size at
    once: the gradient of the loss with respect to the log-softmax and the one it returns for the
    logits (the down-cast copy for 16-bit logits comes after the first is freed). Measured with the
    CPU allocator counter for vocabularies of 4k-32k, fp32 and bf16: 3.0-3.3 logits-sized fp32
    buffers at the backward peak, the saved one included.

    The chunked loss holds the same three buffers for one chunk at a time (its recomputed
    log-softmax among them). A trainable head's weight gradient then adds up chunk by chunk: from the
    second chunk on, the chunks' running sum waits in autograd's buffer beside them, and each chunk's
    accumulation holds three head gradients at once (the sum so far, the chunk's, and their sum:
    autograd does not add a linear layer's weight gradient in place). Measured with the CPU
    allocator counter: vocabularies 16k-128k, hidden 32-512, fp32 and bf16, within 2%.
    """
    per_token = logits_fp32_bytes(trace, layout, engine) / (layout.mbs * trace.seq)
    chunk = per_token * loss_chunk_tokens(trace, layout, engine)
    if not loss_runs_chunked(trace, layout, engine):
        return 2 * chunk
    head = head_gradient_bytes(trace, layout, engine) if loss_chunks(trace, layout, engine) > 1 else 0.0
    return max(3 * chunk + head, 3 * head)


def head_gradient_bytes(trace: ModelTrace, layout: Layout, engine: str | None = None) -> float:
    """One LM head weight gradient on this device (0 for a frozen head: LoRA, QLoRA)."""
    if layout.method != "full":
        return 0.0
    engine = engine or engine_for(layout)
    return trace.vocab_size * trace.hidden_size * autocast_kept_bytes(layout, engine) / vocab_shards(layout, engine)


# A tied embedding's gradient arrives twice in one backward: the LM head's contribution waits in
# autograd's input buffer until the embedding's own arrives, last. Autograd adds the second into the
# first in place only when it may reuse the waiting tensor, and it may not reuse a linear layer's
# weight gradient as the head's GEMM returns it: then their sum is a third tensor, all three alive
# at once. Where the chunked loss ran two or more chunks, the waiting tensor is already their sum,
# a tensor of its own, and the embedding's gradient is added into it: two copies. Measured with the
# CPU allocator counter at the end of backward (plain and DeepSpeed ZeRO-1; vocabularies 32k and 64k,
# hidden 384 and 512): +2 embedding gradients above the waiting one under HF's loss or one chunk,
# +1 under two or more chunks.
TIED_GRADIENT_COPIES = 3
TIED_GRADIENT_COPIES_CHUNKED = 2


def tied_embedding_gradient_copies(trace: ModelTrace, layout: Layout, engine: str | None = None) -> int:
    """How many copies of a tied embedding's gradient are alive at once at the end of backward
    (`TIED_GRADIENT_COPIES`), on an engine that keeps whole `.grad` tensors (plain, DDP, DeepSpeed
    ZeRO-1/2) with the head and the embedding on one stage; 0 where the embedding is untied, frozen
    (LoRA) or sharded."""
    engine = engine or engine_for(layout)
    tied = trace.head.params < trace.vocab_size * trace.hidden_size
    whole_grads = traits(engine).whole_gradients and layout.zero < 3
    if not tied or layout.pp > 1 or layout.method != "full" or not whole_grads:
        return 0
    return TIED_GRADIENT_COPIES_CHUNKED if loss_chunks(trace, layout, engine) > 1 else TIED_GRADIENT_COPIES


def tied_embedding_gradient_bytes(trace: ModelTrace, layout: Layout, engine: str | None = None) -> float:
    """Bytes of one copy of a tied embedding's gradient on this device."""
    engine = engine or engine_for(layout)
    return (trace.embedding.trainable_params * autocast_kept_bytes(layout, engine)
            / vocab_shards(layout, engine))


def logits_fp32_bytes(trace: ModelTrace, layout: Layout, engine: str | None = None) -> float:
    """One micro-batch's logits in fp32 on one device (`vocab_shards`): the unit of the loss's
    buffers."""
    return layout.mbs * trace.seq * trace.vocab_size * 4 / vocab_shards(layout, engine)
