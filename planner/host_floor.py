"""The host floor of an eager step on a GPU: a kernel cannot start before the host has launched it.

Our engines run HF's modules eagerly: for every kernel the host pays Python, autograd, the
dispatcher and the launch (`Efficiency.host_op_s`, measured by `advisor profile`). The GPU runs
ahead of the host only while a kernel outlasts a launch. A decoder layer of a 1-2B model launches
about 120 kernels forward and backward (the trace counts them, `profiler.model_trace.kernel_log`),
of which some 20 are GEMMs or attention: those outlast a launch and the host runs ahead during them;
the others are element-wise kernels of a few microseconds, after each of which the GPU waits for the
next launch. So the two kinds are priced apart, each as the larger of its device time and its host
time: the dense kernels by their FLOPs, the memory-bound ones by the bytes they move, which the
trace counts op by op (the engines' element-wise rule of thumb, `compute_time.ELEMENTWISE_PASSES`, is
what a CPU profile is calibrated on, so a CPU keeps it).

A CPU has no floor: its host is its device, and the calibrated `micro_batch_overhead_s` holds what
the host adds there. Megatron-LM's fused kernels are priced without one (planner/megatron2021.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from specs.capabilities import LOSS_CHUNK_TOKENS
from specs.core import HardwareSpec, Layout
from profiler.model_trace import BlockTrace

# Kernels the chunked loss (trainer/chunked_loss.py) launches per chunk of LOSS_CHUNK_TOKENS beyond
# HF's loss: its head GEMM and cross-entropy forward, their recomputation and backward (counted with
# a dispatch mode on a one-layer Llama: 145 kernels with HF's loss, 154/166/190/238 at 1/2/4/8 chunks).
LOSS_CHUNK_OPS = 12


@dataclass(frozen=True)
class Launches:
    """What one micro-batch launches on one device of a stage: kernels (which do not grow with the
    micro-batch size) and the bytes the memory-bound ones move (which do)."""

    dense_ops: float
    small_ops: float
    traffic_bytes: float


def has_floor(hardware: HardwareSpec, eager: bool) -> bool:
    """Whether the host floor prices this hardware: a GPU whose host time per kernel is known,
    running an engine that launches HF's modules eagerly."""
    return eager and hardware.device_type == "cuda" and hardware.efficiency.host_op_s > 0


def micro_batch_launches(layer: BlockTrace, head: BlockTrace, layout: Layout, layers: int, recomputed: int,
                         last: bool, chunked_loss: bool, useful: bool = False) -> Launches:
    """Kernels and memory-bound bytes of one micro-batch: the stage's layers forward and backward,
    the forward again of the layers it recomputes (full: every kernel; selective: the memory-bound
    ones, the GEMMs' and attention's outputs being kept), and on the last stage the head and loss
    (the traced HF loss, plus `LOSS_CHUNK_OPS` per chunk where the loss runs chunked). `useful`
    leaves the recomputation out (the Amdahl rule's compute)."""
    again = 0 if useful or layout.recompute == "none" else recomputed
    dense_again = again if layout.recompute == "full" else 0
    dense = layers * (layer.fwd_dense_ops + layer.bwd_dense_ops) + dense_again * layer.fwd_dense_ops
    small = layers * _small(layer) + again * (layer.fwd_ops - layer.fwd_dense_ops)
    traffic = layers * (layer.fwd_traffic_bytes + layer.bwd_traffic_bytes) + again * layer.fwd_traffic_bytes
    if last:
        dense += head.fwd_dense_ops + head.bwd_dense_ops
        small += _small(head)
        traffic += head.fwd_traffic_bytes + head.bwd_traffic_bytes
        if chunked_loss:
            small += LOSS_CHUNK_OPS * max(1.0, layout.mbs * layout.seq / LOSS_CHUNK_TOKENS)
    return Launches(dense_ops=dense, small_ops=small, traffic_bytes=layout.mbs * traffic / layout.tp)


def _small(block: BlockTrace) -> float:
    return block.fwd_ops - block.fwd_dense_ops + block.bwd_ops - block.bwd_dense_ops


def floored(device_s: float, ops: float, hardware: HardwareSpec) -> float:
    """The larger of a kind of kernels' device time and the host's time to launch them."""
    return max(device_s, ops * hardware.efficiency.host_op_s)
