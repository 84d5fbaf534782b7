"""The memory of one device of a pipeline stage (`StageMemory`, affine in the stage's layers and its
recomputed layers, so that the stage ILP reads its coefficients off it): model states as the engine
keeps them (planner/memory.py), the gradients alive at the activation peak, the buffers an engine
allocates (DeepSpeed's buckets, FSDP2's gathered units, autocast's 16-bit weight copies), the
optimizer's scratch and the activations of the micro-batches in flight."""

from __future__ import annotations

from dataclasses import dataclass

from specs.engine_traits import traits
from specs.core import (
                        GiB,
                        HardwareSpec,
                        Layout,
                        MemoryEstimate,
                        )
from planner.memory import (
    ADAPTER_BYTES,
    HOST_MEMORY_USABLE,
    autocast_weight_copy_bytes,
    fsdp_shards,
    gathered_parameter_bytes,
    head_activation_bytes,
    head_gradient_bytes,
    vocab_shards,
    layer_activation_bytes,
    logits_transient_bytes,
    micro_batches_in_flight,
    tied_embedding_gradient_bytes,
    tied_embedding_gradient_copies,
    model_state_bytes,
    gradient_dtype_bytes,
    stored_dtype_bytes,
)
from profiler.model_trace import ModelTrace
from planner.zero_buffers import ZeroBuffers, zero_bucket_elems, zero_buffers, zero_settings
from planner.stage_params import adapted_linears_per_layer, device_params, engine_of, model_shape


def resident_gradients(layout: Layout, engine: str, gradients: float, params: float) -> float:
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
        return gradients if layout.zero >= 2 else params * gradient_dtype_bytes(layout, engine)
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
    (`resident_gradients` counts them) or offloaded."""
    if not trainable or resident:
        return 0.0
    before = trace.layer.trainable_params / layout.tp  # the layer itself
    if stage == 0 and not model_shape(trace).tied_embeddings:
        before += trace.embedding.trainable_params / vocab_shards(layout, engine)  # the embedding's comes last
    return gradients * max(trainable - before, 0.0) / trainable


def optimizer_temporaries(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, engine: str,
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
    grad_bytes = gradient_dtype_bytes(layout, engine) if layout.method == "full" else ADAPTER_BYTES
    deepspeed = deepspeed_zero12_buffers(trace, layout, hardware, engine, grad_bytes, last)
    # ZeRO-3's one reduce bucket across replicas (its own partitioned path; stage3.py)
    zero3_bucket = traits(engine).flat_partition and layout.zero == 3 and layout.dp > 1
    buckets = zero_bucket_elems(trace, layout) * grad_bytes if zero3_bucket else 0.0
    if deepspeed:
        buckets = deepspeed.buckets
    # what the optimizer keeps on the device: its states, or under offload DeepSpeed's staging buffer
    optimizer = states.optimizer + (deepspeed.staging if deepspeed else 0.0)
    root = params - layers * trace.layer.params / tp
    gathered = gathered_parameter_bytes(params, trace.layer.params / tp, root, layout, engine)
    gathered += autocast_weight_copy_bytes(trace, layout, engine, layers, last)  # 16-bit weights, like a gather
    resident = resident_gradients(layout, engine, states.gradients, params)
    regrows = bool(recomputed) and layout.recompute != "none"
    tied_copies = tied_embedding_gradient_copies(trace, layout, engine)
    tied_backward = 0.0
    if tied_copies:
        tied_gradient = tied_embedding_gradient_bytes(trace, layout, engine)
        # every other gradient exists by then: in resident buffers, or in `.grad` beside the bucket
        others = 0.0 if resident else trainable * grad_bytes - tied_gradient
        tied_backward = (states.weights + optimizer + resident + buckets + others
                         + tied_copies * tied_gradient)
    if zero3_bucket:
        # ZeRO-3 reduces gradients during backward through its bucket, allocated as the first
        # gradients arrive: alive with the loss's buffers (measured on this CPU; ZeRO-2's is not)
        gathered += buckets
    return StageMemory(
        weights=states.weights, gradients=states.gradients, optimizer=optimizer,
        resident_gradients=resident,
        activations=activations,
        logits=logits_transient_bytes(trace, layout, engine) if last else 0.0,
        regrown=kept - reduced if regrows else 0.0,
        regrown_gradients=(regrown_gradient_bytes(trace, layout, engine, stage, states.gradients, trainable, resident)
                           if regrows else 0.0),
        zero3_live=gathered,
        first_gradient=deepspeed.first_gradient if deepspeed else 0.0,
        scratch=((deepspeed.reduce if deepspeed else buckets)
                 + optimizer_temporaries(trace, layout, hardware, engine, trainable)),
        tied_backward=tied_backward,
        host=states.host,
        host_capacity=host_share(layout, hardware),
    )


def deepspeed_zero12_buffers(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, engine: str,
                             grad_bytes: float, last: bool) -> ZeroBuffers | None:
    """DeepSpeed ZeRO-1/2's device buffers (planner/zero_buffers.py), None for other engines and ZeRO-3.

    The buckets exist at every dp (the gradient hooks that set them up run whenever gradients are
    contiguous, as ours are) and are set up as the first gradient arrives (`setup_buckets`): the LM
    head's, or a tied head's held in autograd's buffer, once the loss's buffers are freed, beside
    every activation. Where the loss's buffers are small (vocabularies of 2k-4k) this is the peak
    (measured on this CPU: 4-12% above the start of backward; tests/test_deepspeed_bucket_memory.py).
    Under optimizer offload, a bucket reduced during backward is normed in fp64 and copied to the
    host there and then (the H200's ZeRO-2 offload row: tests/test_h200_evidence.py)."""
    if not traits(engine).flat_partition or layout.zero == 3:
        return None
    head = head_gradient_bytes(trace, layout, engine) if last else 0.0
    # DeepSpeed runs the whole model on each rank (tp = pp = 1): its partition is the model's, whatever
    # layer count the planner's ILP samples the stage at (its coefficients take these as constants)
    trainable = trace.trainable_params / (layout.tp * layout.pp)
    return zero_buffers(trace, layout, zero_settings(trace, layout, hardware.device_type), trainable, grad_bytes, head)


def host_share(layout: Layout, hardware: HardwareSpec) -> float:
    """Host RAM one device may fill with offloaded states: its node's usable RAM over the devices
    that share the node."""
    sharing = min(layout.devices, hardware.devices_per_node)
    return hardware.host_memory_gib * GiB * HOST_MEMORY_USABLE / sharing
