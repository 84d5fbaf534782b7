"""The cost model: memory and step time of one layout, on one kind of hardware.

`estimate()` is the single entry point the CLI, the ILP and the reports use. It reads the model
trace (parameters, FLOPs and saved activations measured from the real HF model under fake
tensors) and applies the parallel layout analytically, pipeline stage by pipeline stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from advisor.errors import UsageError
from advisor.specs import (
    DTYPE_BYTES,
    Estimate,
    HardwareSpec,
    Layout,
    MemoryEstimate,
    ModelSize,
    ModelSpec,
    ThroughputEstimate,
    TimeEstimate,
)
from planner import collectives
from planner.memory import (
    ADAPTER_BYTES,
    ZERO3_PREFETCH_LAYERS,
    ZERO_REDUCE_BUCKET_ELEMS,
    head_activation_bytes,
    layer_activation_bytes,
    logits_transient_bytes,
    micro_batches_in_flight,
    model_state_bytes,
    stage_layers,
)
from profiler.model_trace import ModelTrace, trace_model

# Bytes an Adam update moves per parameter with a fused kernel: read weight, grad, m, v (and the
# fp32 master), write them back (PyTorch's fused AdamW and DeepSpeed's FusedAdam stream each once).
ADAM_BYTES_PER_PARAM_FUSED = 28
# PyTorch's single-tensor AdamW on CPU runs ~10 separate element-wise kernels per parameter.
ADAM_BYTES_PER_PARAM_CPU = 112
# Memory-bound kernels (norms, activations, softmax, dropout, residual adds) read and write about
# as many bytes as the activations they save; each saved byte is written in forward and read in
# backward, and their gradients are written and read once more.
ELEMENTWISE_PASSES = 4.0


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
            tp_spans_nodes=layout.tp > devices_per_node,
            dp_spans_nodes=layout.tp * layout.dp > devices_per_node,
            pp_spans_nodes=layout.tp * layout.dp * layout.pp > devices_per_node,
        )


def check_layout(trace: ModelTrace, layout: Layout, hardware: HardwareSpec) -> list[str]:
    """Reject splits the back-ends cannot run; return warnings for legal but doubtful ones."""
    notes = []
    if trace.num_heads % layout.tp:
        raise UsageError(f"tp={layout.tp} does not divide the {trace.num_heads} attention heads")
    kv = trace.num_kv_heads
    if kv % layout.tp and layout.tp % kv:
        raise UsageError(f"tp={layout.tp} and the {kv} key/value heads do not divide one another")
    if layout.tp > 1 and trace.intermediate_size % layout.tp:
        raise UsageError(f"tp={layout.tp} does not divide the MLP width {trace.intermediate_size}")
    if layout.pp > trace.num_layers:
        raise UsageError(f"pp={layout.pp} exceeds the {trace.num_layers} decoder layers")
    if layout.vpp > 1 and trace.num_layers % (layout.pp * layout.vpp):
        raise UsageError(
            f"interleaving needs layers divisible by pp*vpp: {trace.num_layers} % {layout.pp * layout.vpp} != 0"
        )
    if layout.vpp > 1 and layout.gas % layout.pp:
        raise UsageError(f"interleaved 1F1B needs gas divisible by pp (gas={layout.gas}, pp={layout.pp})")
    if layout.stage_layers and sum(layout.stage_layers) != trace.num_layers:
        raise UsageError(f"stage_layers sum to {sum(layout.stage_layers)}, the model has {trace.num_layers} layers")
    if layout.tp > hardware.devices_per_node:
        notes.append(f"tp={layout.tp} crosses nodes ({hardware.devices_per_node} devices per node): slow")
    if layout.method == "qlora" and hardware.device_type == "cpu":
        notes.append("QLoRA needs bitsandbytes with CUDA to be fast; on CPU it runs a slow fallback")
    return notes


def _stage_params(trace: ModelTrace, layers: int, first: bool, last: bool, pp: int) -> tuple[float, float, float]:
    """(params, trainable, quantizable) on one device of a stage, before ZeRO, after TP."""
    params = layers * trace.layer.params
    trainable = layers * trace.layer.trainable_params
    # QLoRA quantises the decoder's linear weights; norms (2 vectors per layer) stay in 16 bits.
    quantizable = layers * max(trace.layer.params - trace.layer.trainable_params - 2 * trace.hidden_size, 0)
    if first:
        params += trace.embedding.params
        trainable += trace.embedding.trainable_params
    if last:
        params += trace.head.params
        trainable += trace.head.trainable_params
        tied = trace.head.params < trace.vocab_size * trace.hidden_size
        if tied and pp > 1:  # Megatron keeps a copy of a tied embedding on the last stage
            params += trace.embedding.params
            trainable += trace.embedding.trainable_params
    return params, trainable, quantizable


def _stage_memory(
    trace: ModelTrace, layout: Layout, hardware: HardwareSpec, stage: int, layers: int, recomputed: int
) -> MemoryEstimate:
    """Peak memory of a device of pipeline stage `stage` holding `layers` decoder layers, of which
    `recomputed` use the layout's recomputation mode and the rest keep all activations."""
    tp, pp = layout.tp, layout.pp
    first, last = stage == 0, stage == pp - 1
    params, trainable, quantizable = _stage_params(trace, layers, first, last, pp)
    states = model_state_bytes(params / tp, trainable / tp, layout, quantizable / tp)

    in_flight = micro_batches_in_flight(stage, layout)
    kept = layer_activation_bytes(trace, layout, recompute="none")
    reduced = layer_activation_bytes(trace, layout)
    activations = in_flight * ((layers - recomputed) * kept + recomputed * reduced)
    if last:
        activations += head_activation_bytes(trace, layout)

    w = DTYPE_BYTES[layout.dtype]
    transient = 0.0
    if last:
        transient += logits_transient_bytes(trace, layout)
    if recomputed and layout.recompute != "none":  # the layer being recomputed regrows what it dropped
        transient += kept - (reduced if layout.recompute == "selective" else 0.0)
    if layout.zero == 3:
        transient += ZERO3_PREFETCH_LAYERS * trace.layer.params / tp * w
    grad_bytes = w if layout.method == "full" else ADAPTER_BYTES
    buckets = 0.0
    if layout.zero in (1, 2) and layout.dp > 1:
        buckets = min(ZERO_REDUCE_BUCKET_ELEMS, trainable / tp) * grad_bytes
    optimizer_temp = _optimizer_temporaries(trace, layout, hardware, trainable / tp)
    other = max(transient, optimizer_temp) + buckets

    peak = states.total + activations + other
    capacity = hardware.usable_bytes
    return MemoryEstimate(
        weights=round(states.weights), gradients=round(states.gradients), optimizer=round(states.optimizer),
        activations=round(activations), other=round(other), peak=round(peak), capacity=capacity,
        fits=peak <= capacity, stage=stage,
    )


def _optimizer_temporaries(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, trainable: float) -> float:
    """fp32 scratch of the optimizer step: none for fused GPU kernels; on CPU, PyTorch's
    single-tensor AdamW allocates `denom` and the update, each the size of the tensor it updates
    (DeepSpeed hands it one flat partition, so the whole partition)."""
    if hardware.device_type == "cuda" or layout.offload != "none":
        return 0.0
    if layout.zero >= 1:
        return 2 * 4 * trainable / layout.dp
    if layout.method != "full":
        return 2 * 4 * trace.hidden_size * layout.lora_rank
    largest = max(trace.vocab_size * trace.hidden_size, trace.intermediate_size * trace.hidden_size) / layout.tp
    return 2 * 4 * largest


@dataclass(frozen=True)
class _StageTime:
    compute_mb: float  # one micro-batch, forward + backward (+ recomputation)
    backward_mb: float
    tp_comm_mb: float
    pp_comm_mb: float
    trainable: float   # before ZeRO, after TP
    params: float


def _stage_time(
    trace: ModelTrace, layout: Layout, hardware: HardwareSpec, placement: Placement, stage: int, layers: int,
    recomputed: int,
) -> _StageTime:
    tp, mbs, pp = layout.tp, layout.mbs, layout.pp
    first, last = stage == 0, stage == pp - 1
    layer = trace.layer
    fwd = layers * layer.fwd_flops + (trace.head.fwd_flops if last else 0.0)
    bwd = layers * layer.bwd_flops + (trace.head.bwd_flops if last else 0.0)
    if layout.recompute == "full":
        fwd += recomputed * layer.fwd_flops
    elif layout.recompute == "selective":  # QK^T and attention-over-V forward again
        fwd += recomputed * 4 * trace.seq * trace.seq * trace.num_heads * trace.head_dim
    flop_rate = hardware.peak_flops(layout.dtype) * hardware.efficiency.gemm
    byte_rate = hardware.memory_bandwidth_gbs * 1e9 * hardware.efficiency.memory_bandwidth
    kept = layer_activation_bytes(trace, layout, recompute="none")
    traffic = ELEMENTWISE_PASSES * layers * kept
    if layout.recompute == "full":  # the forward's writes happen twice
        traffic += ELEMENTWISE_PASSES / 4 * recomputed * kept
    fwd_s = mbs * fwd / tp / flop_rate
    bwd_s = mbs * bwd / tp / flop_rate
    compute = fwd_s + bwd_s + traffic / byte_rate

    w = DTYPE_BYTES[layout.dtype]
    hidden_bytes = mbs * trace.seq * trace.hidden_size * w
    all_reduces = 4 * layers + (2 * recomputed if layout.recompute == "full" else 0) + first + last
    tp_comm = all_reduces * collectives.all_reduce_s(hidden_bytes, tp, hardware, placement.tp_spans_nodes)
    pp_comm = 0.0
    if pp > 1:
        # Megatron's scatter/gather optimisation (Narayanan et al. 2021, section 4.1): each TP rank
        # sends 1/tp of the boundary activation across nodes, then the TP group all-gathers it.
        boundaries = (0 if first else 1) + (0 if last else 1)
        send = collectives.send_recv_s(hidden_bytes / tp, hardware, placement.pp_spans_nodes)
        gather = 0.0 if layout.sp else collectives.all_gather_s(hidden_bytes, tp, hardware, placement.tp_spans_nodes)
        pp_comm = layout.vpp * boundaries * (send + gather)
    params, trainable, _ = _stage_params(trace, layers, first, last, pp)
    return _StageTime(compute, bwd_s, tp_comm, pp_comm, trainable / tp, params / tp)


def _dp_comm(layout: Layout, hardware: HardwareSpec, placement: Placement, stage: _StageTime) -> tuple[float, float]:
    """(total, exposed) seconds of data-parallel gradient / ZeRO traffic per optimizer step."""
    dp, gas = layout.dp, layout.gas
    if dp == 1:
        return 0.0, 0.0
    w = DTYPE_BYTES[layout.dtype]
    grad_bytes = stage.trainable * (w if layout.method == "full" else ADAPTER_BYTES)
    weight_bytes = stage.params * w
    spans = placement.dp_spans_nodes
    overlap = hardware.efficiency.comm_overlap
    if layout.zero <= 1:  # one all-reduce after the last micro-batch, overlapped with its backward
        total = collectives.all_reduce_s(grad_bytes, dp, hardware, spans)
        window = stage.backward_mb
    elif layout.zero == 2:  # DeepSpeed reduce-scatters every micro-batch, gathers weights once
        total = gas * collectives.reduce_scatter_s(grad_bytes, dp, hardware, spans)
        total += collectives.all_gather_s(weight_bytes, dp, hardware, spans)
        window = gas * stage.backward_mb
    else:  # ZeRO-3 gathers weights for forward and backward of every micro-batch
        per_mb = 2 * collectives.all_gather_s(weight_bytes, dp, hardware, spans)
        per_mb += collectives.reduce_scatter_s(grad_bytes, dp, hardware, spans)
        total = gas * per_mb
        window = gas * stage.compute_mb
    exposed = max(total * (1 - overlap), total - window)
    return total, exposed


def _optimizer_and_offload(layout: Layout, hardware: HardwareSpec, stage: _StageTime) -> tuple[float, float]:
    params = stage.trainable / (layout.dp if layout.zero >= 1 else 1)
    if layout.offload != "none":
        w = DTYPE_BYTES[layout.dtype]
        host_adam = params / hardware.cpu_adam_params_per_s
        pcie = 2 * params * w / (hardware.host_to_device_gbs * 1e9)  # grads down, weights up
        offload = pcie
        if layout.offload == "optimizer+params":  # weights stream in for forward and backward
            offload += 2 * layout.gas * stage.params / layout.dp * w / (hardware.host_to_device_gbs * 1e9)
        return host_adam, offload
    per_param = ADAM_BYTES_PER_PARAM_CPU if hardware.device_type == "cpu" else ADAM_BYTES_PER_PARAM_FUSED
    rate = hardware.memory_bandwidth_gbs * 1e9 * hardware.efficiency.memory_bandwidth
    return params * per_param / rate, 0.0


def estimate_from_trace(trace: ModelTrace, layout: Layout, hardware: HardwareSpec) -> Estimate:
    notes = check_layout(trace, layout, hardware) + list(trace.notes)
    placement = Placement.of(layout, hardware.devices_per_node)
    split = layout.stage_layers or stage_layers(trace.num_layers, layout.pp)
    recomputed = layout.recompute_layers or (split if layout.recompute != "none" else [0] * layout.pp)
    recomputed = [min(r, n) for r, n in zip(recomputed, split)]

    memories = [_stage_memory(trace, layout, hardware, i, n, r) for i, (n, r) in enumerate(zip(split, recomputed))]
    memory = max(memories, key=lambda m: m.peak)

    stages = [_stage_time(trace, layout, hardware, placement, i, n, r)
              for i, (n, r) in enumerate(zip(split, recomputed))]
    per_mb = [s.compute_mb + s.tp_comm_mb + s.pp_comm_mb for s in stages]
    slowest = stages[max(range(len(stages)), key=lambda i: per_mb[i])]
    t_mb = max(per_mb)
    gas = layout.gas
    bubble = (layout.pp - 1) / layout.vpp * t_mb
    dp_total, dp_exposed = max((_dp_comm(layout, hardware, placement, s) for s in stages), key=lambda x: x[1])
    optimizer_s, offload_s = max(_optimizer_and_offload(layout, hardware, s) for s in stages)
    compute = gas * slowest.compute_mb
    comm_exposed = gas * (slowest.tp_comm_mb + slowest.pp_comm_mb) + dp_exposed
    step = compute + comm_exposed + bubble + optimizer_s + offload_s

    model_flops = layout.global_batch * trace.flops_per_sequence
    tflops = model_flops / step / layout.devices / 1e12
    return Estimate(
        model=ModelSize(params=trace.params, trainable_params=trace.trainable_params),
        memory=memory,
        time=TimeEstimate(
            step_s=step, compute_s=compute, comm_exposed_s=comm_exposed, bubble_s=bubble,
            optimizer_s=optimizer_s, offload_s=offload_s, tp_comm_s=gas * slowest.tp_comm_mb,
            pp_comm_s=gas * slowest.pp_comm_mb, dp_comm_s=dp_total,
        ),
        throughput=ThroughputEstimate(
            tokens_per_s=layout.tokens_per_step / step,
            model_tflops_per_device=tflops,
            mfu=tflops * 1e12 / hardware.peak_flops(layout.dtype),
        ),
        # Amdahl rule of the source article: every device computes >= 80% of the step, so the
        # least busy pipeline stage sets the fraction.
        compute_fraction=min(gas * st.compute_mb for st in stages) / step,
        layout=layout, hardware=hardware.name, devices=layout.devices, nodes=placement.nodes,
        notes=notes,
    )


def estimate(
    model: ModelSpec, hardware: HardwareSpec, layout: Layout, attention: str | None = None
) -> Estimate:
    """Predict memory and step time of `layout` for `model` on `hardware`."""
    trace = trace_model(
        model, layout.seq, dtype=layout.dtype, method=layout.method, lora_rank=layout.lora_rank,
        attention=attention, device_type=hardware.device_type,  # type: ignore[arg-type]
    )
    return estimate_from_trace(trace, layout, hardware)
