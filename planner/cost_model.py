"""The cost model: memory and step time of one layout, on one kind of hardware.

`estimate()` is the single entry point the CLI, the ILP and the reports use. It reads the model
trace (parameters, FLOPs and saved activations measured from the real HF model under fake
tensors) and applies the parallel layout analytically, pipeline stage by pipeline stage: each
stage's memory (planner/stage_memory.py over planner/memory.py's model states and activations), its
micro-batch's compute (planner/compute_time.py), what it communicates (planner/comm_time.py) and its
optimizer step (planner/optimizer_step.py), every engine as its traits declare it
(specs/engine_traits.py). This module composes them into the step and the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from specs.engine_traits import traits
from specs.errors import UsageError
from specs.layout_rules import layout_problem, tp_crosses_nodes
from specs.core import (
                        DTYPE_BYTES,
                        SELECTIVE_POLICY,
                        Estimate,
                        HardwareSpec,
                        Layout,
                        ModelSize,
                        ModelSpec,
                        ThroughputEstimate,
                        TimeEstimate,
                        layers_per_stage,
                        )
from planner import megatron2021
from planner.memory import vocab_shards
from profiler.model_trace import ModelTrace, trace_model
from planner.comm_time import Placement, activation_comm, dp_overlap, gradient_comm, gradient_comm_bytes
from planner.compute_time import micro_batch_compute, rates_for
from planner.optimizer_step import optimizer_time, offload_exposed_s, optimizer_shards
from planner.stage_memory import stage_memory
from planner.stage_params import device_params, engine_of, model_shape


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


def stage_time(
    trace: ModelTrace, layout: Layout, hardware: HardwareSpec, placement: Placement, stage: int, layers: int,
    recomputed: int, engine: str = "auto",
) -> StageTime:
    engine = engine_of(layout, engine)
    first, last = stage == 0, stage == layout.pp - 1
    rates = rates_for(layout, hardware)
    compute, useful, bwd_s = micro_batch_compute(trace, layout, hardware, engine, rates, layers, recomputed, last,
                                                  vocab_shards(layout, engine))
    tp_comm, pp_comm = activation_comm(trace, layout, hardware, placement, engine, layers, recomputed, first, last)
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
    dp_comm, window = gradient_comm(layout, engine, hardware, placement, grad_bytes, params * w, bwd_s, compute)
    dp_comm *= rates.time_shared
    optimizer, offload = optimizer_time(trace, layout, hardware, rates, params, trainable, engine, layers, stage)
    offload = offload_exposed_s(layout, hardware, offload, trainable / optimizer_shards(layout, engine) * w, bwd_s)
    return StageTime(
        compute_mb=compute, useful_compute_mb=useful, backward_mb=bwd_s, tp_comm_mb=tp_comm, pp_comm_mb=pp_comm,
        dp_comm=dp_comm, dp_hidden_max=window, optimizer=optimizer, offload=offload,
        dp_overlap=dp_overlap(hardware, engine, trace.num_layers), time_shared=rates.time_shared,
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
