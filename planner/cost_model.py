"""The cost model: memory and step time of one layout, on one kind of hardware.

`estimate()` is the single entry point the CLI, the ILP and the reports use. It reads the model
trace (parameters, FLOPs and saved activations measured from the real HF model under fake
tensors) and applies the parallel layout analytically, pipeline stage by pipeline stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from advisor.capabilities import COLUMN_PARALLEL, ENGINE_CHOICES, ROW_PARALLEL, engine_for, tf32_gemms
from advisor.engine_traits import traits
from advisor.errors import UsageError
from advisor.layout_rules import ModelShape, layout_problem, tp_crosses_nodes
from advisor.specs import (
    DTYPE_BYTES,
    SELECTIVE_POLICY,
    GiB,
    Estimate,
    HardwareSpec,
    Layout,
    MemoryEstimate,
    ModelSize,
    ModelSpec,
    ThroughputEstimate,
    TimeEstimate,
    layers_per_stage,
)
from planner import collectives, host_floor, megatron2021
from planner.memory import (
    ADAPTER_BYTES,
    HOST_MEMORY_USABLE,
    ZERO_REDUCE_BUCKET_ELEMS,
    activation_blocks,
    ModelStates,
    autocast_kept_bytes,
    autocast_weight_copy_bytes,
    fsdp_shards,
    gathered_parameter_bytes,
    head_activation_bytes,
    head_gradient_bytes,
    vocab_shards,
    layer_activation_bytes,
    logits_fp32_bytes,
    logits_transient_bytes,
    loss_runs_chunked,
    micro_batches_in_flight,
    tied_embedding_gradient_bytes,
    tied_embedding_gradient_copies,
    model_state_bytes,
    stored_dtype_bytes,
)
from profiler.gemm_shapes import GemmShape, linear_gemms
from profiler.model_trace import ModelTrace, trace_model

# Bytes an Adam update moves per parameter with a fused kernel: read weight, grad, m, v (and the
# fp32 master), write them back (PyTorch's fused AdamW and DeepSpeed's FusedAdam stream each once).
ADAM_BYTES_PER_PARAM_FUSED = 28
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
class Placement:
    """Which process groups cross node boundaries (Megatron order: tp innermost, then dp, then pp)."""

    nodes: int
    tp_spans_nodes: bool
    dp_spans_nodes: bool
    pp_spans_nodes: bool

    @classmethod
    def of(cls, layout: Layout, devices_per_node: int) -> "Placement":
        return cls(
            nodes=math.ceil(layout.devices / devices_per_node),
            tp_spans_nodes=tp_crosses_nodes(layout.tp, devices_per_node),
            dp_spans_nodes=layout.tp * layout.dp > devices_per_node,
            pp_spans_nodes=layout.tp * layout.dp * layout.pp > devices_per_node,
        )


def model_shape(trace: ModelTrace) -> ModelShape:
    return ModelShape(num_heads=trace.num_heads, num_kv_heads=trace.num_kv_heads,
                      intermediate_size=trace.intermediate_size, num_layers=trace.num_layers,
                      tied_embeddings=trace.head.params < trace.vocab_size * trace.hidden_size)


def check_layout(trace: ModelTrace, layout: Layout, hardware: HardwareSpec) -> list[str]:
    """Reject splits the back-ends cannot run; return warnings for legal but doubtful ones."""
    notes = []
    problem = layout_problem(layout, model_shape(trace))
    if problem:
        raise UsageError(problem)
    if tp_crosses_nodes(layout.tp, hardware.devices_per_node):
        notes.append(f"tp={layout.tp} crosses nodes ({hardware.devices_per_node} devices per node): slow")
    if layout.method == "qlora" and hardware.device_type == "cpu":
        notes.append("QLoRA on CPU runs bitsandbytes' torch fallback (de-quantise, then matmul), whose speed "
                     "is not measured: expect steps slower than predicted")
    return notes


def _stage_params(trace: ModelTrace, layers: int, first: bool, last: bool, pp: int, tp: int = 1,
                  vocab: int = 1) -> tuple[float, float, float]:
    """(params, trainable, quantizable) on one device of a stage, before ZeRO: the decoder layers
    divided by `tp`, the embedding and head by `vocab` (`vocab_shards`)."""
    params = layers * trace.layer.params / tp
    trainable = layers * trace.layer.trainable_params / tp
    # QLoRA quantises the decoder's linear weights; norms (2 vectors per layer) stay in 16 bits.
    quantizable = layers * max(trace.layer.params - trace.layer.trainable_params - 2 * trace.hidden_size, 0) / tp
    if first:
        params += trace.embedding.params / vocab
        trainable += trace.embedding.trainable_params / vocab
    if last:
        params += trace.head.params / vocab
        trainable += trace.head.trainable_params / vocab
        tied = trace.head.params < trace.vocab_size * trace.hidden_size
        if tied and pp > 1:  # Megatron keeps a copy of a tied embedding on the last stage
            params += trace.embedding.params / vocab
            trainable += trace.embedding.trainable_params / vocab
    return params, trainable, quantizable


def adapted_linears_per_layer(trace: ModelTrace) -> int:
    """Linear layers of one decoder layer that LoRA adapts (and QLoRA quantises), from the trace:
    a rank-r adapter on an (in, out) linear adds r(in + out) parameters. The attention's q, k, v
    and o projections are four of them (Llama, Mistral, Qwen2); the rest are MLP matrices of
    hidden x intermediate (two, or three when gated). GPT-2's fused q/k/v reads as 6 instead of 4:
    two tensors' constants, a few KiB."""
    hidden, heads = trace.hidden_size, trace.head_dim * trace.num_heads
    kv = trace.head_dim * trace.num_kv_heads
    attention = (hidden + heads) + 2 * (hidden + kv) + (heads + hidden)
    mlp = trace.layer.trainable_params / max(trace.lora_rank, 1) - attention
    return 4 + max(round(mlp / (hidden + trace.intermediate_size)), 0)


def device_params(trace: ModelTrace, layout: Layout, engine: str, layers: int,
                  stage: int) -> tuple[float, float, float]:
    """(params, trainable, quantizable) one device of pipeline stage `stage` holds, after tensor
    parallelism and before ZeRO, as `engine` splits them."""
    return _stage_params(trace, layers, stage == 0, stage == layout.pp - 1, layout.pp, layout.tp,
                         vocab_shards(layout, engine))


def engine_of(layout: Layout, engine: str = "auto") -> str:
    """The engine that runs `layout`: `engine` is the plan's choice (auto, deepspeed, fsdp2; see
    advisor.capabilities.engine_for) or already an engine's name."""
    return engine_for(layout, engine) if engine in ENGINE_CHOICES else engine


def stage_model_states(trace: ModelTrace, layout: Layout, engine: str = "auto", stage: int = 0) -> ModelStates:
    """Parameter, gradient and optimizer-state bytes one device of pipeline stage `stage` holds
    between steps, as the engine that runs `layout` keeps them (the quantities `Engine.state_bytes`
    reports, and the ZeRO paper's Table 1 counts)."""
    split, _ = default_split(trace, layout)
    engine = engine_of(layout, engine)
    params, trainable, quantizable = device_params(trace, layout, engine, split[stage], stage)
    nf4_tensors = split[stage] * adapted_linears_per_layer(trace) if layout.method == "qlora" else 0
    return model_state_bytes(params, trainable, layout, quantizable, nf4_tensors, engine=engine)


def _resident_gradients(layout: Layout, engine: str, gradients: float, params: float) -> float:
    """Gradient bytes already allocated when the forward pass runs (at the activation peak).

    Gradients are created during backward and freed by `zero_grad(set_to_none=True)`, so at the
    start of backward none exist, unless something keeps them: accumulation across micro-batches
    (gas > 1), DDP's bucket buffers (dp > 1, as large as the gradients), or ZeRO-3's persistent
    gradient partition. Measured on this CPU with PyTorch DDP and DeepSpeed ZeRO-1/2/3
    (bench/memory_accuracy.py, bench/accuracy.py). FSDP2 accumulating without reducing (gas > 1
    below ZeRO-2) keeps the whole stage's unsharded gradients, in fp32 when it reduces in fp32."""
    if fsdp_shards(layout, engine):
        if layout.gas == 1:
            return 0.0
        return gradients if layout.zero >= 2 else params * stored_dtype_bytes(layout, engine)
    if traits(engine).ddp_buckets and layout.dp > 1:
        # DDP's buckets persist; gradients accumulated under no_sync after a zero_grad(set_to_none)
        # are fresh tensors beside them, not views into them (measured: twice the gradients, gas 2)
        return gradients * (2 if layout.gas > 1 else 1)
    if layout.gas > 1 or layout.zero == 3 or (traits(engine).persistent_gradients and layout.dp > 1):
        return gradients  # Megatron-LM's DDP keeps persistent gradient buffers
    return 0.0


def regrown_gradient_bytes(trace: ModelTrace, layout: Layout, engine: str, stage: int, gradients: float,
                           trainable: float, resident: float) -> float:
    """Gradient bytes held when the stage's first decoder layer regrows its activations in backward
    (recomputation runs from the stage's first layers, `trainer.recompute`): every layer after it
    and the head have produced theirs, as the engine keeps them (`states.gradients` per trainable
    parameter: whole `.grad`, or ZeRO/FSDP2 partitions; a tied head's share of the embedding's
    gradient waits in autograd's buffer). Counted on top of the activations kept at the
    start of backward, most of which are freed by then (measured: the plain engine, full
    recomputation, 4 layers: within 2%). None where the gradients are resident from the start
    (`_resident_gradients` counts them) or offloaded."""
    if not trainable or resident:
        return 0.0
    before = trace.layer.trainable_params / layout.tp  # the layer itself
    if stage == 0 and not model_shape(trace).tied_embeddings:
        before += trace.embedding.trainable_params / vocab_shards(layout, engine)  # the embedding's comes last
    return gradients * max(trainable - before, 0.0) / trainable


def zero_bucket_elems(trace: ModelTrace, layout: Layout) -> int:
    """DeepSpeed reduce/all-gather bucket that our exported configs set: the default 5e7 elements,
    shrunk to the trainable parameters of one model shard for small models (DeepSpeed allocates the
    whole bucket up front)."""
    shard = trace.trainable_params / (layout.tp * layout.pp)
    return int(min(ZERO_REDUCE_BUCKET_ELEMS, math.ceil(shard)))


def _optimizer_temporaries(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, engine: str,
                           trainable: float) -> float:
    """Scratch of the optimizer step: none for fused GPU kernels; on CPU, PyTorch's single-tensor
    AdamW allocates `denom` and the update, each the size of the tensor it updates, in its dtype
    (DeepSpeed hands it one flat fp32 partition, so the whole partition)."""
    if hardware.device_type == "cuda" or layout.offload != "none":
        return 0.0
    if traits(engine).flat_partition:
        return 2 * 4 * trainable / layout.dp
    if layout.method != "full":
        return 2 * 4 * trace.hidden_size * layout.lora_rank
    largest = max(trace.vocab_size * trace.hidden_size / vocab_shards(layout, engine),
                  trace.intermediate_size * trace.hidden_size / layout.tp)
    shards = layout.dp if fsdp_shards(layout, engine) else 1
    return 2 * stored_dtype_bytes(layout, engine) * largest / shards


@dataclass(frozen=True)
class StageMemory:
    """Memory terms of one device of a pipeline stage. Every field is affine in the stage's layer
    count and recomputed-layer count, except `regrown`, which applies once any layer recomputes
    (the planner's ILP relies on this)."""

    weights: float
    gradients: float
    optimizer: float
    resident_gradients: float
    activations: float
    logits: float
    regrown: float
    # gradients that exist when the stage's first layer regrows in backward: the head's and those of
    # the stage's other layers (0 where no layer recomputes or gradients are resident anyway)
    regrown_gradients: float
    # live at the start of backward beyond the shards: gathered weights (ZeRO-3, FSDP2), ZeRO-3's bucket
    zero3_live: float
    # DeepSpeed ZeRO-1/2's gradient bucket and the first gradient, which arrives as the loss's buffers
    # are freed and every activation is still alive (0 for the other engines)
    first_gradient: float
    scratch: float
    # the end of backward with a tied embedding: its gradient copies beside every other gradient
    # (`tied_embedding_gradient_copies`); 0 where none applies
    tied_backward: float
    host: float  # offloaded bytes of this device in host RAM
    host_capacity: float  # this device's share of its node's usable RAM

    @property
    def transient(self) -> float:
        # the loss's buffers are gone before the first recomputed layer regrows its activations;
        # the gradients of everything after that layer exist by then
        return max(self.logits, self.first_gradient, self.regrown + self.regrown_gradients) + self.zero3_live

    @property
    def backward_start(self) -> float:
        return self.weights + self.optimizer + self.resident_gradients + self.activations + self.transient

    @property
    def optimizer_step(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.scratch

    @property
    def peak(self) -> float:
        return max(self.backward_start, self.optimizer_step, self.tied_backward)

    @property
    def host_fits(self) -> bool:
        return self.host <= self.host_capacity

    def estimate(self, stage: int, capacity: int) -> MemoryEstimate:
        """The breakdown at the winning moment, so that the parts add up to the peak."""
        if self.tied_backward >= max(self.backward_start, self.optimizer_step):
            gradients, activations = self.tied_backward - self.weights - self.optimizer, 0.0
            other = 0.0
        elif self.backward_start >= self.optimizer_step:
            gradients, activations, other = self.resident_gradients, self.activations, self.transient
        else:
            gradients, activations, other = self.gradients, 0.0, self.scratch
        return MemoryEstimate(
            weights=round(self.weights), gradients=round(gradients), optimizer=round(self.optimizer),
            activations=round(activations), other=round(other), peak=round(self.peak), capacity=capacity,
            fits=self.peak <= capacity and self.host_fits, stage=stage, host_offload=round(self.host),
            host_fits=self.host_fits,
        )


def stage_memory(
    trace: ModelTrace, layout: Layout, hardware: HardwareSpec, stage: int, layers: int, recomputed: int,
    engine: str = "auto",
) -> StageMemory:
    """Memory of a device of pipeline stage `stage` holding `layers` decoder layers, of which
    `recomputed` use the layout's recomputation mode and the rest keep all activations, as the
    engine that runs the layout (`engine_of`) keeps its states.

    Two moments compete for the peak: the start of backward (all in-flight activations, the loss
    buffers or the layer being recomputed, gradients that are resident, weights gathered by
    ZeRO-3/FSDP2) and the optimizer step (all gradients, communication buckets, the optimizer's
    scratch; activations freed).
    """
    engine = engine_of(layout, engine)
    tp, last = layout.tp, stage == layout.pp - 1
    params, trainable, quantizable = device_params(trace, layout, engine, layers, stage)
    nf4_tensors = layers * adapted_linears_per_layer(trace) if layout.method == "qlora" else 0
    states = model_state_bytes(params, trainable, layout, quantizable, nf4_tensors, engine=engine)

    in_flight = micro_batches_in_flight(stage, layout)
    kept = layer_activation_bytes(trace, layout, recompute="none", engine=engine)
    reduced = layer_activation_bytes(trace, layout, engine=engine)
    activations = in_flight * ((layers - recomputed) * kept + recomputed * reduced)
    if last:
        activations += head_activation_bytes(trace, layout, engine)

    # a gradient as the engine keeps it: fp32 where the weights are (autocast, FSDP2), 16-bit beside DeepSpeed's master
    grad_bytes = stored_dtype_bytes(layout, engine) if layout.method == "full" else ADAPTER_BYTES
    # DeepSpeed's gradient bucket (`setup_buckets`): across replicas; on a GPU, where our exported config
    # sets `overlap_comm`, also ZeRO-2's at one replica (its gradient hooks partition whatever dp is), and
    # ZeRO-1/2's doubled there, so that one bucket fills while the other is reduced or copied to the host
    overlapped = hardware.device_type == "cuda"
    deepspeed_buckets = traits(engine).flat_partition and (layout.dp > 1 or (overlapped and layout.zero == 2))
    doubled = overlapped and layout.zero < 3  # stage_1_and_2.py's double buffer; ZeRO-3 keeps one
    buckets = zero_bucket_elems(trace, layout) * grad_bytes * (2 if doubled else 1) if deepspeed_buckets else 0.0
    root = params - layers * trace.layer.params / tp
    gathered = gathered_parameter_bytes(params, trace.layer.params / tp, root, layout, engine)
    gathered += autocast_weight_copy_bytes(trace, layout, engine, layers, last)  # 16-bit weights, like a gather
    resident = _resident_gradients(layout, engine, states.gradients, params)
    regrows = bool(recomputed) and layout.recompute != "none"
    tied_copies = tied_embedding_gradient_copies(trace, layout, engine)
    tied_backward = 0.0
    if tied_copies:
        tied_gradient = tied_embedding_gradient_bytes(trace, layout, engine)
        # every other gradient exists by then: in resident buffers, or in `.grad` beside the bucket
        others = 0.0 if resident else trainable * grad_bytes - tied_gradient
        tied_backward = (states.weights + states.optimizer + resident + buckets + others
                         + tied_copies * tied_gradient)
    first_gradient = 0.0
    if deepspeed_buckets and layout.zero == 3:
        # ZeRO-3 reduces gradients during backward through its bucket, allocated as the first
        # gradients arrive: alive with the loss's buffers (measured on this CPU; ZeRO-2's is not)
        gathered += buckets
    elif deepspeed_buckets:
        # ZeRO-1/2 set their bucket up as the first gradient arrives (DeepSpeed's `setup_buckets`,
        # from its gradient hook): the LM head's, or a tied head's held in autograd's buffer, once
        # the loss's buffers are freed, beside every activation. Where the loss's buffers are small
        # (vocabularies of 2k-4k) this is the peak (measured on this CPU: 4-12% above the start of
        # backward; tests/test_deepspeed_bucket_memory.py)
        first_gradient = buckets + (head_gradient_bytes(trace, layout, engine) if last else 0.0)
    return StageMemory(
        weights=states.weights, gradients=states.gradients, optimizer=states.optimizer,
        resident_gradients=resident,
        activations=activations,
        logits=logits_transient_bytes(trace, layout, engine) if last else 0.0,
        regrown=kept - reduced if regrows else 0.0,
        regrown_gradients=(regrown_gradient_bytes(trace, layout, engine, stage, states.gradients, trainable, resident)
                           if regrows else 0.0),
        zero3_live=gathered,
        first_gradient=first_gradient,
        scratch=buckets + _optimizer_temporaries(trace, layout, hardware, engine, trainable),
        tied_backward=tied_backward,
        host=states.host,
        host_capacity=host_share(layout, hardware),
    )


def host_share(layout: Layout, hardware: HardwareSpec) -> float:
    """Host RAM one device may fill with offloaded states: its node's usable RAM over the devices
    that share the node."""
    sharing = min(layout.devices, hardware.devices_per_node)
    return hardware.host_memory_gib * GiB * HOST_MEMORY_USABLE / sharing


@dataclass(frozen=True)
class StageTime:
    """Time terms of one device of a pipeline stage, affine in its layer and recomputed counts."""

    compute_mb: float   # one micro-batch: forward + backward + recomputation + memory-bound kernels
    useful_compute_mb: float  # the same without recomputation: what the Amdahl rule counts
    backward_mb: float
    tp_comm_mb: float
    pp_comm_mb: float
    dp_comm: float      # data-parallel / ZeRO traffic per optimizer step, before overlap
    dp_hidden_max: float  # how much of it the overlapped compute window could hide
    optimizer: float
    offload: float
    dp_overlap: float  # the hardware's share of DP traffic hidden behind compute
    time_shared: float = 1.0  # how many times over the node's ranks ask for its cores (1: they fit)

    @property
    def per_micro_batch(self) -> float:
        return self.compute_mb + self.tp_comm_mb + self.pp_comm_mb

    @property
    def dp_exposed(self) -> float:
        return max(self.dp_comm * (1 - self.dp_overlap), self.dp_comm - self.dp_hidden_max)


@dataclass(frozen=True)
class _Rates:
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


def _rates(layout: Layout, hardware: HardwareSpec) -> _Rates:
    eff = hardware.efficiency
    # Compute slows down when the other devices of the node compute too (CPU cores share caches
    # and memory bandwidth; GPUs do not, contention 0), and more so when the node's ranks ask for
    # more threads than it has cores (the kernel time-shares them).
    busy = min(layout.devices, hardware.devices_per_node)
    time_shared = hardware.oversubscription(busy)
    return _Rates(
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


def _micro_batch_compute(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, engine: str, rates: _Rates,
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
    traffic, useful_traffic = _elementwise_bytes(trace, layout, engine, layers, recomputed)
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


def _floored_compute(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, engine: str, rates: _Rates,
                     layers: int, recomputed: int, last: bool, vocab: int) -> tuple[float, float, float]:
    """`_micro_batch_compute` under the host floor (planner/host_floor.py): the dense kernels (GEMMs,
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


def _elementwise_bytes(trace: ModelTrace, layout: Layout, engine: str, layers: int,
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
    best = 0.0
    for tile_rows, tile_cols in {hardware.gemm_tile, hardware.gemm_tile[::-1]}:
        tiles = math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols)
        slots = math.ceil(tiles / hardware.sm_count) * hardware.sm_count
        best = max(best, rows * cols / (tile_rows * tile_cols) / slots)
    return best


def layer_gemms(trace: ModelTrace, layout: Layout) -> list[GemmShape]:
    """The GEMMs of one decoder layer's linear layers for one micro-batch on one device, under
    Megatron's tensor-parallel split: a column-parallel linear divides its outputs by tp, a
    row-parallel one its inputs (mbs x seq tokens; sequence parallelism gathers them back before
    each GEMM). The attention's q, k and v projections count as one fused GEMM (Megatron, GPT-2; HF
    Llama runs three); the MLP has two or three matrices, as the layer's parameters say."""
    h, tp, tokens = trace.hidden_size, layout.tp, layout.mbs * trace.seq
    q, kv = trace.num_heads * trace.head_dim, trace.num_kv_heads * trace.head_dim
    mlp = round((trace.layer.params - 2 * h * q - 2 * h * kv) / (h * trace.intermediate_size))
    columns = [q + 2 * kv] + [trace.intermediate_size] * max(min(mlp, 3) - 1, 1)
    linears = [(h, out // tp) for out in columns] + [(q // tp, h), (trace.intermediate_size // tp, h)]
    return [gemm for fan_in, fan_out in linears for gemm in linear_gemms(tokens, fan_in, fan_out)]


def _gemm_wave_extra_s(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, rate: float, layers: int,
                       recomputed: int, last: bool, vocab: int) -> float:
    """Seconds one micro-batch's linear GEMMs on one stage lose to tile and wave quantization
    (`wave_efficiency`) beyond their FLOPs at the dense rate: forward once per layer and once more
    per recomputed layer, input and weight gradients once (no weight gradient for frozen weights
    under LoRA/QLoRA); the LM head's (vocabulary split `vocab` ways) once, on the last stage."""
    if hardware.sm_count is None:
        return 0.0

    def lost_flops(gemms: list[GemmShape], runs: dict[str, int]) -> float:
        return sum(runs[g.name] * g.flops * (1 / wave_efficiency(g.m, g.n, hardware) - 1) for g in gemms)

    trains = layout.method == "full"
    lost = lost_flops(layer_gemms(trace, layout), {
        "fwd": layers + (recomputed if layout.recompute == "full" else 0), "dgrad": layers,
        "wgrad": layers if trains else 0})
    if last:
        head = linear_gemms(layout.mbs * trace.seq, trace.hidden_size, trace.vocab_size // vocab)
        lost += lost_flops(head, {"fwd": 1, "dgrad": 1, "wgrad": 1 if trains else 0})
    return lost / rate


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


def _score_matmul_extra_s(trace: ModelTrace, layout: Layout, rates: _Rates, layers: int, recomputed: int) -> float:
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


def tp_collectives(layout: Layout, engine: str, layers: int, recomputed: int, first: bool,
                   last: bool) -> dict[str, int]:
    """The activation collectives (all-reduces, all-gathers, reduce-scatters of one micro-batch's
    hidden states) that one micro-batch runs on one stage of a tensor-parallel layout, as its engine
    runs them.

    Megatron (Shoeybi et al. 2019) fuses q/k/v and gate/up: each block all-reduces once forward and
    once backward, 4 per layer, its vocab-parallel embedding and head one each, and recomputation
    re-runs the 2 forward ones. The trainer's DTensor plan (`advisor.capabilities`) splits every HF
    projection on its own. Without sequence parallelism each row-parallel output is all-reduced
    forward, and each column-parallel module all-reduces its own input gradient backward: 7 per
    Llama layer. With it, each block gathers its input once and reduce-scatters its output, and
    backward mirrors that (4 gathers and 4 scatters per layer), and the sequence is gathered again
    before the head and for the embedding's gradient. Recomputation (torch's non-reentrant
    checkpoint, full or selective) stops as soon as backward has what it needs, so it skips each
    layer's last collective. Counted by tests/test_collectives_as_run.py on the engine itself."""
    again = recomputed if layout.recompute != "none" else 0
    if not traits(engine).eager:  # Megatron-LM's fused q/k/v and gate/up: 4 all-reduces per layer
        return {"all_reduce": 4 * layers + 2 * again + first + last}
    if layout.sp:
        return {"all_gather": 4 * layers + 2 * again + first + last, "reduce_scatter": 4 * layers + again}
    forward = len(ROW_PARALLEL)
    return {"all_reduce": (forward + len(COLUMN_PARALLEL)) * layers + (forward - 1) * again}


def _activation_comm(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, placement: Placement, engine: str,
                     layers: int, recomputed: int, first: bool, last: bool) -> tuple[float, float]:
    """(tensor-parallel, pipeline) communication seconds of one micro-batch on one stage."""
    tp = layout.tp
    hidden_bytes = layout.mbs * trace.seq * trace.hidden_size * DTYPE_BYTES[layout.dtype]
    priced = {"all_reduce": collectives.all_reduce_s, "all_gather": collectives.all_gather_s,
              "reduce_scatter": collectives.reduce_scatter_s}
    wait = hardware.efficiency.tp_collective_wait_s if tp > 1 else 0.0  # a blocking call's skew (fitted)
    tp_comm = sum(count * (priced[op](hidden_bytes, tp, hardware, placement.tp_spans_nodes) + wait)
                  for op, count in tp_collectives(layout, engine, layers, recomputed, first, last).items())
    pp_comm = 0.0
    if layout.pp > 1:
        # Megatron's scatter/gather optimisation (Narayanan et al. 2021, section 4.1): each TP rank
        # sends 1/tp of the boundary activation across nodes, then the TP group all-gathers it.
        # every chunk of a device has an input and an output boundary, but for the model's very first
        # chunk (on the first device) and very last (on the last): 2 vpp - 1 there, 2 vpp in between
        boundaries = 2 * layout.vpp - (1 if first else 0) - (1 if last else 0)
        boundary = hidden_bytes / DTYPE_BYTES[layout.dtype] * autocast_kept_bytes(layout, engine)
        send = collectives.send_recv_s(boundary / tp, hardware, placement.pp_spans_nodes)
        gather = 0.0 if layout.sp else collectives.all_gather_s(boundary, tp, hardware, placement.tp_spans_nodes)
        pp_comm = boundaries * (send + gather)
    return tp_comm, pp_comm


def _gradient_comm(layout: Layout, engine: str, hardware: HardwareSpec, placement: Placement, grad_bytes: float,
                   weight_bytes: float, bwd_s: float, compute: float) -> tuple[float, float]:
    """(data-parallel communication of one step, the compute it can hide under)."""
    dp, gas, spans = layout.dp, layout.gas, placement.dp_spans_nodes
    if dp <= 1:
        return 0.0, 0.0
    if fsdp_shards(layout, engine):
        # FSDP2 all-gathers each unit's weights for every micro-batch's forward (and again for its
        # backward when it reshards after forward: ZeRO-3 outside a pipeline), and reduce-scatters
        # the gradients every micro-batch from ZeRO-2 on, else once at the accumulation boundary.
        gathers = 2 if layout.zero == 3 and traits(engine).reshards_after_forward else 1
        per_mb = gathers * collectives.all_gather_s(weight_bytes, dp, hardware, spans)
        reduces = gas if layout.zero >= 2 else 1
        dp_comm = gas * per_mb + reduces * collectives.reduce_scatter_s(grad_bytes, dp, hardware, spans)
        return dp_comm, gas * compute
    if layout.zero <= 1:  # one all-reduce after the last micro-batch, overlapped with its backward
        dp_comm = collectives.all_reduce_s(grad_bytes, dp, hardware, spans)
        if layout.zero == 1 and traits(engine).gathers_after_step:  # and, as under ZeRO-2, DeepSpeed all-gathers
            # the weight partitions its ranks updated after the step (counted on gloo: the whole
            # weights, beside an all-reduce of the whole gradients; tests/test_collectives_as_run.py)
            dp_comm += collectives.all_gather_s(weight_bytes, dp, hardware, spans)
        return dp_comm, bwd_s
    if layout.zero == 2:  # DeepSpeed reduce-scatters every micro-batch, gathers weights once
        dp_comm = gas * collectives.reduce_scatter_s(grad_bytes, dp, hardware, spans)
        dp_comm += collectives.all_gather_s(weight_bytes, dp, hardware, spans)
        return dp_comm, gas * bwd_s
    # ZeRO-3 gathers weights for forward and backward of every micro-batch
    per_mb = 2 * collectives.all_gather_s(weight_bytes, dp, hardware, spans)
    per_mb += collectives.reduce_scatter_s(grad_bytes, dp, hardware, spans)
    return gas * per_mb, gas * compute


def gradient_comm_bytes(layout: Layout, engine: str, trainable: float) -> float:
    """Bytes of the gradients one device reduces across data-parallel replicas per reduction:
    FSDP2 reduces in fp32 (its MixedPrecisionPolicy's reduce_dtype), whatever it computes in; DDP
    and DeepSpeed reduce in the gradients' own dtype (fp32 under autocast, 16-bit beside DeepSpeed's
    master: `stored_dtype_bytes`); LoRA's adapters are fp32."""
    if layout.method != "full":
        return trainable * ADAPTER_BYTES
    reduce_dtype = traits(engine).reduce_dtype  # published FSDP runs reduce in bf16
    if reduce_dtype:
        return trainable * DTYPE_BYTES[reduce_dtype]
    return trainable * stored_dtype_bytes(layout, engine)


def optimizer_shards(layout: Layout, engine: str) -> int:
    """How many ways the data-parallel replicas split the optimizer's work: ZeRO 1-3, and FSDP2
    always (it shards the gradients and states whatever the stage, `fsdp_shards`)."""
    return layout.dp if layout.zero >= 1 or fsdp_shards(layout, engine) else 1


def optimizer_tensors(trace: ModelTrace, layout: Layout, engine: str, layers: int,
                      stage: int) -> list[tuple[float, float]]:
    """(parameters, parameters per tensor) of the tensors one device's optimizer step updates, by
    kind: DeepSpeed updates one flat fp32 partition; the other engines each parameter (its shard
    under FSDP2's ZeRO): the embedding's and the head's, and the decoder layers' adapted matrices
    (a LoRA adapter's two factors each)."""
    trainable = device_params(trace, layout, engine, layers, stage)[1]
    shards = optimizer_shards(layout, engine)
    if traits(engine).flat_partition:  # one stage: its partition is the whole model's share, whatever `layers` is
        # (the planner reads this term as affine in the stage's layers)
        whole = device_params(trace, layout, engine, trace.num_layers, stage)[1] / shards
        return [(trainable / shards, whole)]
    tables = device_params(trace, layout, engine, 0, stage)[1]  # the embedding and head this stage holds
    vocab_tensor = trace.vocab_size * trace.hidden_size / vocab_shards(layout, engine) / shards
    matrices = adapted_linears_per_layer(trace) * (2 if layout.method in ("lora", "qlora") else 1)
    layer_tensor = trace.layer.trainable_params / layout.tp / matrices / shards
    return [(tables / shards, vocab_tensor), ((trainable - tables) / shards, layer_tensor)]


def _cpu_adam_s(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, engine: str, layers: int,
                stage: int, updated: float) -> float:
    """The host's AdamW step over `updated` parameters at the profile's measured rate, per tensor
    size where it measured that (`HardwareSpec.cpu_adam_by_tensor`: an embedding's states leave the
    caches that a decoder layer's fit in)."""
    base, curve = hardware.cpu_adam_params_per_s, hardware.cpu_adam_by_tensor
    if curve is None or not traits(engine).eager:  # Megatron-LM's fused Adam: no per-tensor curve
        return updated / base
    return sum(count / (base * curve.at(size)) for count, size in
               optimizer_tensors(trace, layout, engine, layers, stage) if count > 0)


def _optimizer_time(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, rates: _Rates, params: float,
                    trainable: float, engine: str, layers: int, stage: int) -> tuple[float, float]:
    """(optimizer step, offload traffic) seconds of one step on one device."""
    w = DTYPE_BYTES[layout.dtype]
    updated = trainable / optimizer_shards(layout, engine)
    if layout.offload == "none":
        # the gradients' norm and clipping, before the update, over the gradients the rank holds: long
        # streams at the profile's copy rate (measured: the plain engine's clip over gqa-50k's 37M
        # gradients took 11 ms, 3 passes at 40 GB/s, where the fitted element-wise rate prices 55)
        bandwidth = hardware.memory_bandwidth_gbs * 1e9
        clip = rates.slowdown * traits(engine).clip_passes * gradient_comm_bytes(layout, engine, updated) / bandwidth
        if hardware.device_type == "cpu":
            # the device is the host: the profile's own measured AdamW rate (the single-tensor
            # AdamW that plain torch and DeepSpeed's torch_adam run on a CPU, at the device's threads),
            # not memory traffic at the fitted element-wise rate, which traded off against compute
            return clip + rates.slowdown * _cpu_adam_s(trace, layout, hardware, engine, layers, stage, updated), 0.0
        per_param = ADAM_BYTES_PER_PARAM_FUSED if traits(engine).eager else megatron2021.ADAM_BYTES_PER_PARAM
        return clip + rates.slowdown * updated * per_param / rates.byte, 0.0
    optimizer = _cpu_adam_s(trace, layout, hardware, engine, layers, stage, updated)
    h2d = hardware.host_to_device_gbs * 1e9
    offload = 2 * updated * w / h2d  # gradients down, updated weights up
    if layout.offload == "optimizer+params":  # weights stream in for forward and backward
        offload += 2 * layout.gas * params / layout.dp * w / h2d
    return optimizer, offload


def offload_exposed_s(layout: Layout, hardware: HardwareSpec, offload: float, updated_bytes: float,
                      backward_s: float) -> float:
    """The offload copies a step waits for. On a GPU, DeepSpeed copies each gradient bucket to the host
    as backward produces it (`overlap_comm`, set in our exported config there): the gradients' way down
    hides behind the last micro-batch's backward, as far as it lasts; the updated weights' way up follows
    the host's Adam step and is waited for. A CPU's copies are its own work: all of them count."""
    if hardware.device_type != "cuda" or layout.offload == "none":
        return offload
    down = updated_bytes / (hardware.host_to_device_gbs * 1e9)
    return offload - down + max(0.0, down - backward_s)


def stage_time(
    trace: ModelTrace, layout: Layout, hardware: HardwareSpec, placement: Placement, stage: int, layers: int,
    recomputed: int, engine: str = "auto",
) -> StageTime:
    engine = engine_of(layout, engine)
    first, last = stage == 0, stage == layout.pp - 1
    rates = _rates(layout, hardware)
    compute, useful, bwd_s = _micro_batch_compute(trace, layout, hardware, engine, rates, layers, recomputed, last,
                                                  vocab_shards(layout, engine))
    tp_comm, pp_comm = _activation_comm(trace, layout, hardware, placement, engine, layers, recomputed, first, last)
    # A CPU node's collectives are its ranks' own copies and reductions (gloo), so where the ranks
    # outnumber the cores they are time-shared like the compute (bench/time_shared_collectives.py:
    # two pairs of 4 ranks on 2 cores ran each collective 1.3-2.1x as long as one pair did)
    tp_comm, pp_comm = tp_comm * rates.time_shared, pp_comm * rates.time_shared
    params, trainable, _ = device_params(trace, layout, engine, layers, stage)
    if traits(engine).persistent_gradients:  # Megatron-LM sums each micro-batch's gradients into its buffers
        accumulate = rates.slowdown * megatron2021.gradient_accumulation_bytes(layout, trainable) / rates.byte
        compute, useful = compute + accumulate, useful + accumulate
    w = DTYPE_BYTES[layout.dtype]
    grad_bytes = gradient_comm_bytes(layout, engine, trainable)
    dp_comm, window = _gradient_comm(layout, engine, hardware, placement, grad_bytes, params * w, bwd_s, compute)
    dp_comm *= rates.time_shared
    optimizer, offload = _optimizer_time(trace, layout, hardware, rates, params, trainable, engine, layers, stage)
    offload = offload_exposed_s(layout, hardware, offload, trainable / optimizer_shards(layout, engine) * w, bwd_s)
    return StageTime(
        compute_mb=compute, useful_compute_mb=useful, backward_mb=bwd_s, tp_comm_mb=tp_comm, pp_comm_mb=pp_comm,
        dp_comm=dp_comm, dp_hidden_max=window, optimizer=optimizer, offload=offload,
        dp_overlap=hardware.efficiency.comm_overlap, time_shared=rates.time_shared,
    )


def default_split(trace: ModelTrace, layout: Layout) -> tuple[list[int], list[int]]:
    """The layout's (layers, recomputed layers) per stage, filling the defaults."""
    split = layers_per_stage(trace.num_layers, layout)
    recomputed = layout.recompute_layers or (split if layout.recompute != "none" else [0] * layout.pp)
    return split, [min(r, n) for r, n in zip(recomputed, split)]


def pipeline_bubble_s(layout: Layout, times: list[StageTime]) -> float:
    """The pipeline's fill and drain: one micro-batch through every stage but the slowest, over the
    vpp chunks each rank interleaves. The first micro-batch's forward reaches the slowest stage
    through the stages before it, and the last one's backward leaves through them, while the slowest
    stage runs its gas micro-batches back to back (the 1F1B critical path). With equal stages this
    is Narayanan et al. 2021's (p - 1)/v slots; with a last stage that carries a large vocabulary's
    head and loss, the bubble is the cheaper stages' time, not p - 1 slots of the dearest
    (bench/accuracy.py: the 2-rank pipeline of a 50k vocabulary was priced 29% slow). Exact when the
    slowest stage is the last (tests/test_megatron_schedule.py replays the schedule); when an
    earlier stage is slowest, the stages after it partly hide behind its warm-up forwards, which
    this leaves exposed: never optimistic."""
    per_mb = [t.per_micro_batch for t in times]
    return (sum(per_mb) - max(per_mb)) / layout.vpp


def micro_batches_seconds(layout: Layout, times: list[StageTime]) -> float:
    """The step's micro-batches: gas slots of the slowest stage and the pipeline's bubble
    (`pipeline_bubble_s`).

    On time-shared cores (a CPU node whose ranks outnumber its cores: every stage time is priced
    `time_shared` times its own) the stages that idle in the fill and drain leave their cores to the
    others, so that part runs unshared. The step is then bounded by the critical path run unshared
    and by the cores' total work, gas micro-batches of the mean stage at the shared price, and is
    the larger (exact where the stages overlap as 1F1B's do at gas 2 and pp 2: tests/
    test_pipeline_time_shared.py). A 2-stage pipeline of 4 ranks on 2 cores was priced 35% slow when
    its fill and drain were time-shared too."""
    slot = max(t.per_micro_batch for t in times)
    critical = layout.gas * slot + pipeline_bubble_s(layout, times)
    shared = times[0].time_shared
    if shared <= 1:
        return critical
    return max(critical / shared, layout.gas * sum(t.per_micro_batch for t in times) / len(times))


def step_seconds(layout: Layout, times: list[StageTime]) -> float:
    """The micro-batches (`micro_batches_seconds`), plus exposed DP traffic and the optimizer of the
    slowest stage."""
    return (micro_batches_seconds(layout, times) + max(t.dp_exposed for t in times)
            + max(t.optimizer + t.offload for t in times))


def estimate_from_trace(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, engine: str = "auto") -> Estimate:
    """Memory and step time of `layout` as the engine that runs it (`engine_of`: the plan's engine
    choice, or an engine's name) runs it."""
    engine = engine_of(layout, engine)
    notes = check_layout(trace, layout, hardware) + list(trace.notes)
    if layout.recompute == "selective":
        notes.append(SELECTIVE_POLICY)
    placement = Placement.of(layout, hardware.devices_per_node)
    split, recomputed = default_split(trace, layout)
    stages = list(enumerate(zip(split, recomputed)))

    memories = [stage_memory(trace, layout, hardware, i, n, r, engine) for i, (n, r) in stages]
    worst = max(range(layout.pp), key=lambda i: (not memories[i].host_fits, memories[i].peak))
    memory = memories[worst].estimate(worst, hardware.usable_bytes)

    times = [stage_time(trace, layout, hardware, placement, i, n, r, engine) for i, (n, r) in stages]
    slowest = max(times, key=lambda t: t.per_micro_batch)
    gas = layout.gas
    step = step_seconds(layout, times)
    bubble = max(0.0, micro_batches_seconds(layout, times) - gas * slowest.per_micro_batch)
    dp_exposed = max(t.dp_exposed for t in times)
    updater = max(times, key=lambda t: t.optimizer + t.offload)
    compute = gas * slowest.compute_mb
    comm_exposed = gas * (slowest.tp_comm_mb + slowest.pp_comm_mb) + dp_exposed

    model_flops = layout.global_batch * trace.flops_per_sequence
    tflops = model_flops / step / layout.devices / 1e12
    return Estimate(
        model=ModelSize(params=trace.params, trainable_params=trace.trainable_params),
        memory=memory,
        time=TimeEstimate(
            step_s=step, compute_s=compute, comm_exposed_s=comm_exposed, bubble_s=bubble,
            optimizer_s=updater.optimizer, offload_s=updater.offload, tp_comm_s=gas * slowest.tp_comm_mb,
            pp_comm_s=gas * slowest.pp_comm_mb, dp_comm_s=max(t.dp_comm for t in times),
        ),
        throughput=ThroughputEstimate(
            tokens_per_s=layout.tokens_per_step / step,
            model_tflops_per_device=tflops,
            mfu=tflops * 1e12 / hardware.peak_flops(layout.dtype),
        ),
        # Amdahl rule of the source article: every device computes >= 80% of the step, so the
        # least busy pipeline stage sets the fraction. Recomputation is overhead here, like
        # communication: it must not buy compliance with the rule.
        compute_fraction=min(gas * t.useful_compute_mb for t in times) / step,
        layout=layout, hardware=hardware.name, devices=layout.devices, nodes=placement.nodes,
        notes=notes, engine=engine,
    )


def estimate(
    model: ModelSpec, hardware: HardwareSpec, layout: Layout, attention: str | None = None, engine: str = "auto",
    packed: bool = False,
) -> Estimate:
    """Predict memory and step time of `layout` for `model` on `hardware`, run by `engine`, on rows
    that pack several documents where `packed` (`trace_model`)."""
    trace = trace_model(
        model, layout.seq, dtype=layout.dtype, method=layout.method, lora_rank=layout.lora_rank,
        attention=attention, device_type=hardware.device_type, packed=packed,  # type: ignore[arg-type]
    )
    return estimate_from_trace(trace, layout, hardware, engine)
