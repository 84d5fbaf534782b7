"""What a step communicates and how much of it hides: tensor-parallel collectives per micro-batch
(as the trainer's DTensor plan runs them, or Megatron-LM's four), pipeline sends between stages, and
the data-parallel reduction of gradients and gathering of weights, per engine trait
(specs/engine_traits.py), priced with planner/collectives.py on the ranks' placement."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specs.capabilities import COLUMN_PARALLEL, ROW_PARALLEL
from specs.engine_traits import traits
from specs.layout_rules import tp_crosses_nodes
from specs.core import (
                        DTYPE_BYTES,
                        HardwareSpec,
                        Layout,
                        )
from planner import collectives
from planner.memory import (
    ADAPTER_BYTES,
    autocast_kept_bytes,
    fsdp_shards,
    gradient_dtype_bytes,
)
from profiler.model_trace import ModelTrace


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


def tp_collectives(layout: Layout, engine: str, layers: int, recomputed: int, first: bool,
                   last: bool) -> dict[str, int]:
    """The activation collectives (all-reduces, all-gathers, reduce-scatters of one micro-batch's
    hidden states) that one micro-batch runs on one stage of a tensor-parallel layout, as its engine
    runs them.

    Megatron (Shoeybi et al. 2019) fuses q/k/v and gate/up: each block all-reduces once forward and
    once backward, 4 per layer, its vocab-parallel embedding and head one each, and recomputation
    re-runs the 2 forward ones. The trainer's DTensor plan (`specs.capabilities`) splits every HF
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


def activation_comm(trace: ModelTrace, layout: Layout, hardware: HardwareSpec, placement: Placement, engine: str,
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


def gradient_comm(layout: Layout, engine: str, hardware: HardwareSpec, placement: Placement, grad_bytes: float,
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


def dp_overlap(hardware: HardwareSpec, engine: str, layers: int) -> float:
    """The share of a step's data-parallel collectives that can hide behind its compute (the rest of
    them hides too while the compute lasts: `StageTime.dp_exposed`). An engine that prefetches its
    units (`EngineTraits.prefetches_units`) leaves one unit of its `layers` + 1 (the decoder layers and
    the root, which holds the embedding and the head) exposed per micro-batch; the others take the
    hardware's figure. A host whose collectives compete with its compute (comm_overlap 0: gloo on the
    CPU cores) hides none, prefetch or not."""
    shared = hardware.efficiency.comm_overlap
    if not traits(engine).prefetches_units or shared <= 0:
        return shared
    return max(shared, layers / (layers + 1))


def gradient_comm_bytes(layout: Layout, engine: str, trainable: float) -> float:
    """Bytes of the gradients one device reduces across data-parallel replicas per reduction:
    FSDP2 reduces in fp32 (its MixedPrecisionPolicy's reduce_dtype), whatever it computes in; DDP
    and DeepSpeed reduce in the gradients' own dtype (fp32 under autocast, 16-bit beside DeepSpeed's
    master, fp32 in Megatron-LM's bf16 buffers: `gradient_dtype_bytes`); LoRA's adapters are fp32."""
    if layout.method != "full":
        return trainable * ADAPTER_BYTES
    reduce_dtype = traits(engine).reduce_dtype  # published FSDP runs reduce in bf16
    if reduce_dtype:
        return trainable * DTYPE_BYTES[reduce_dtype]
    return trainable * gradient_dtype_bytes(layout, engine)
