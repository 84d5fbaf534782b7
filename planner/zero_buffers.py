"""DeepSpeed ZeRO-1/2's device buffers beside the model states, sized from the `zero_optimization`
settings our exported config gives DeepSpeed (`zero_settings`: planner/export.py writes the config
from them, the cost model prices from them) and from the model's tensors.

What DeepSpeed 0.19.8's `DeepSpeedZeroOptimizer` (runtime/zero/stage_1_and_2.py) allocates on the
device, read off its source, and what our settings turn on:

- reduce buckets (`setup_buckets`, from the first gradient hook of each backward, freed in
  `independent_gradient_partition_epilogue`): `reduce_bucket_size` elements in the gradients' dtype
  when gradients are contiguous (`contiguous_gradients`, which optimizer offload forces on), a
  second one under `overlap_comm`; at every dp, since the hooks exist whenever gradients are
  contiguous. Ours: contiguous always, overlapped on a GPU.
- the offload staging buffer (`temp_grad_buffer_for_gpu_offload`, made in `__init__` when the
  optimizer is offloaded): the largest trainable tensor, in the gradients' dtype, kept for the run.
- the offloaded gradient's norm and copy (`copy_grads_in_partition` -> `set_norm_for_param_grad_in_gpu`,
  then `async_inplace_copy_grad_to_fp32_buffer_from_gpu`): each reduced gradient's slice of this
  rank's partition converted to `get_norm_dtype()` (fp64 where the device has it, as CUDA and the CPU
  do) for its norm, then to fp32 for the copy to the host; one tensor at a time, so the largest slice
  in fp64 is the transient.
- a gradient larger than the bucket skips it (`reduce_independent_p_g_buckets_and_remove_grads`):
  it stays a tensor of its own until reduced; with offload it is cloned there first (two copies for
  a moment, below the fp64 copy that follows).

Not priced here: the contiguous gradient partition (`grads_in_partition`, without offload) is the
model states' gradients; the all-gather after the step writes into the 16-bit flat weights in place
(`all_gather_dp_groups`), so `allgather_bucket_size` allocates nothing on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specs.core import Layout
from profiler.model_trace import ModelTrace

ZERO_REDUCE_BUCKET_ELEMS = 50_000_000  # DeepSpeed's default reduce/all-gather bucket, in elements
NORM_COPY_BYTES = 8  # DeepSpeed's `get_norm_dtype()`: float64 on devices with fp64 (CUDA, CPU)


@dataclass(frozen=True)
class ZeroSettings:
    """The `zero_optimization` settings of our exported DeepSpeed config that size device buffers."""

    stage: int
    bucket_elems: int  # reduce_bucket_size and allgather_bucket_size (and ZeRO-3's prefetch bucket)
    contiguous_gradients: bool
    overlap_comm: bool
    offload_optimizer: bool
    offload_params: bool


def zero_bucket_elems(trace: ModelTrace, layout: Layout) -> int:
    """DeepSpeed reduce/all-gather bucket that our exported configs set: the default 5e7 elements,
    shrunk to the trainable parameters of one model shard for small models (DeepSpeed allocates the
    whole bucket up front)."""
    shard = trace.trainable_params / (layout.tp * layout.pp)
    return int(min(ZERO_REDUCE_BUCKET_ELEMS, math.ceil(shard)))


def zero_settings(trace: ModelTrace, layout: Layout, device_type: str) -> ZeroSettings:
    """Our settings for `layout` on `device_type`: gradients always contiguous; communication
    overlapped with backward on a GPU only (on the CPU there is no second stream to overlap on)."""
    return ZeroSettings(stage=layout.zero, bucket_elems=zero_bucket_elems(trace, layout), contiguous_gradients=True,
                        overlap_comm=device_type == "cuda", offload_optimizer=layout.offload != "none",
                        offload_params=layout.offload == "optimizer+params")


def reduce_bucket_buffers(settings: ZeroSettings) -> int:
    """Reduce buckets ZeRO-1/2 allocate in `setup_buckets`: one where gradients are contiguous
    (DeepSpeed forces them so under optimizer offload), a second under `overlap_comm`."""
    if not (settings.contiguous_gradients or settings.offload_optimizer):
        return 0
    return 2 if settings.overlap_comm else 1


def largest_layer_tensor_elems(trace: ModelTrace, layout: Layout) -> float:
    """Elements of a decoder layer's largest trainable tensor: an MLP or attention projection, or
    for LoRA the largest adapter matrix (rank x the projection's widest side)."""
    widest = max(trace.intermediate_size, trace.num_heads * trace.head_dim, trace.hidden_size)
    if layout.method != "full":
        return float(layout.lora_rank * widest)
    return float(trace.hidden_size * max(trace.intermediate_size, trace.num_heads * trace.head_dim))


def largest_trainable_elems(trace: ModelTrace, layout: Layout) -> float:
    """Elements of the model's largest trainable tensor (DeepSpeed's `largest_param_numel`): the
    embedding or LM head (vocabulary x hidden) under full training, else a decoder layer's."""
    layer = largest_layer_tensor_elems(trace, layout)
    if layout.method != "full":
        return layer
    return max(layer, float(trace.vocab_size * trace.hidden_size))


def head_reduced_first(trace: ModelTrace, layout: Layout) -> bool:
    """Whether the first gradient backward hands DeepSpeed is the LM head's: a trainable untied head.
    A tied head's waits in autograd's buffer for the embedding's (the last gradient), and LoRA
    freezes it: then the first is a last decoder layer's tensor."""
    tied = trace.head.params < trace.vocab_size * trace.hidden_size
    return layout.method == "full" and not tied


def offload_staging_bytes(trace: ModelTrace, layout: Layout, settings: ZeroSettings, grad_bytes: float) -> float:
    """`temp_grad_buffer_for_gpu_offload`: the largest trainable tensor in the gradients' dtype, on
    the device from the optimizer's construction on (0 without optimizer offload)."""
    if not settings.offload_optimizer:
        return 0.0
    return largest_trainable_elems(trace, layout) * grad_bytes


def reduced_during_backward(trainable: float, settings: ZeroSettings) -> bool:
    """Whether a bucket is reduced before backward ends: the gradient hooks reduce (`process_gradients`:
    ZeRO-2, or `overlap_comm`; ZeRO-1 without it reduces after backward) and the gradients outgrow one
    bucket (else everything is reduced in the epilogue, once the activations are freed)."""
    return (settings.stage == 2 or settings.overlap_comm) and trainable > settings.bucket_elems


@dataclass(frozen=True)
class ZeroBuffers:
    """DeepSpeed ZeRO-1/2's device buffers of one rank, in bytes, at the moments they meet."""

    buckets: float  # the reduce buckets, from the first gradient hook to the epilogue
    staging: float  # the offload staging buffer, for the whole run
    # beside every activation, once backward hands over its first gradient: the buckets with that
    # gradient as autograd made it, or, where a bucket is reduced during backward under offload,
    # with its fp64 norm copy (and the gradient itself, where it is too large for the bucket)
    first_gradient: float
    # once the activations are freed: the buckets, and under offload the largest gradient's fp64
    # norm copy with that gradient where it is too large for a bucket (the rest of the gradients are
    # in the buckets or already on the host)
    reduce: float


def zero_buffers(trace: ModelTrace, layout: Layout, settings: ZeroSettings, trainable: float, grad_bytes: float,
                 head_gradient: float) -> ZeroBuffers:
    """The buffers DeepSpeed ZeRO-1/2 allocates on a device of `layout` under `settings` (ours:
    `zero_settings`) beside the model states (`trainable`: the device's trainable parameters before
    ZeRO; `grad_bytes`: a gradient's bytes per element, the 16-bit module's dtype or fp32;
    `head_gradient`: the LM head's weight gradient, alive from the head's backward on, 0 where the
    head is frozen)."""
    buckets = reduce_bucket_buffers(settings) * settings.bucket_elems * grad_bytes
    first_gradient, reduce = buckets + head_gradient, buckets
    if settings.offload_optimizer:
        partition = trainable / layout.dp  # the most of any one tensor this rank norms and offloads
        if reduced_during_backward(trainable, settings):
            first_gradient = max(first_gradient, buckets + _first_reduce_bytes(trace, layout, settings, partition,
                                                                                   head_gradient))
        largest = largest_trainable_elems(trace, layout)
        kept_apart = largest * grad_bytes if largest > settings.bucket_elems else 0.0
        reduce += kept_apart + NORM_COPY_BYTES * min(largest, partition)
    return ZeroBuffers(buckets=buckets, staging=offload_staging_bytes(trace, layout, settings, grad_bytes),
                       first_gradient=first_gradient, reduce=reduce)


def _first_reduce_bytes(trace: ModelTrace, layout: Layout, settings: ZeroSettings, partition: float,
                        head_gradient: float) -> float:
    """Beside the buckets while the first gradient reduced during backward is normed for the host:
    its fp64 copy, and the head's gradient where it is not in a bucket (larger than one, so kept
    apart; or tied, waiting in autograd's buffer)."""
    if head_reduced_first(trace, layout):
        first = float(trace.vocab_size * trace.hidden_size)
        kept_apart = head_gradient if first > settings.bucket_elems else 0.0
    else:
        first, kept_apart = largest_layer_tensor_elems(trace, layout), head_gradient
    return kept_apart + NORM_COPY_BYTES * min(first, partition)
