"""The optimizer step of one device: the gradients' norm and clipping, AdamW over the parameters it
updates (fused on a GPU, the profile's measured host rate on a CPU or under offload, per tensor size
where measured), and the offload's host<->device copies with the part of them a step waits for."""

from __future__ import annotations


from specs.engine_traits import traits
from specs.core import (
                        DTYPE_BYTES,
                        HardwareSpec,
                        Layout,
                        )
from planner import megatron2021
from planner.memory import (
    fsdp_shards,
    vocab_shards,
)
from profiler.model_trace import ModelTrace
from planner.comm_time import gradient_comm_bytes
from planner.compute_time import Rates
from planner.stage_params import adapted_linears_per_layer, device_params


# Bytes an Adam update moves per parameter with a fused kernel: read weight, grad, m, v (and the
# fp32 master), write them back (PyTorch's fused AdamW and DeepSpeed's FusedAdam stream each once).
ADAM_BYTES_PER_PARAM_FUSED = 28


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


def cpu_adam_s(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, engine: str, layers: int,
                stage: int, updated: float) -> float:
    """The host's AdamW step over `updated` parameters at the profile's measured rate, per tensor
    size where it measured that (`HardwareSpec.cpu_adam_by_tensor`: an embedding's states leave the
    caches that a decoder layer's fit in)."""
    base, curve = hardware.cpu_adam_params_per_s, hardware.cpu_adam_by_tensor
    if curve is None or not traits(engine).eager:  # Megatron-LM's fused Adam: no per-tensor curve
        return updated / base
    return sum(count / (base * curve.at(size)) for count, size in
               optimizer_tensors(trace, layout, engine, layers, stage) if count > 0)


def optimizer_time(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, rates: Rates, params: float,
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
            return clip + rates.slowdown * cpu_adam_s(trace, layout, hardware, engine, layers, stage, updated), 0.0
        per_param = ADAM_BYTES_PER_PARAM_FUSED if traits(engine).eager else megatron2021.ADAM_BYTES_PER_PARAM
        return clip + rates.slowdown * updated * per_param / rates.byte, 0.0
    optimizer = cpu_adam_s(trace, layout, hardware, engine, layers, stage, updated)
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
