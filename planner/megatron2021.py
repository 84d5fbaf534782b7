"""What Megatron-LM's 2021 GPT layer moves through memory outside its GEMMs (the `megatron` engine).

The engine prices published Megatron-LM runs (bench/megatron_table1.py: Narayanan et al. 2021,
run at commit 6985e589 in the NGC PyTorch 20.12 container). Its memory-bound kernels are counted
here one by one from that commit's megatron/model/transformer.py, instead of the generic
`ELEMENTWISE_PASSES` x saved-activation estimate the cost model uses for the engines we run.

Units: bytes per element of one of three tensor sizes of one micro-batch on one device,
* `hidden`: b s h, the replicated hidden states (LayerNorm, residual, dropout);
* `sharded`: b s h / tp, a tensor-parallel slice of the hidden size;
* `scores`: b (a / tp) s^2, the attention scores, written only by explicit attention: a flash kernel
  (FlashAttention, Dao et al. 2022; Transformer Engine's fused attention in today's Megatron-LM)
  keeps the softmax and its dropout on chip and writes no score, so under it these kernels move
  nothing.
Activations are fp16 (2 bytes), dropout masks 1 byte. The score matmuls' own reads and writes are
priced by the cost model's roofline term, the GEMMs' by their FLOPs, the TP all-reduces as
communication: none of them appears here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal

from specs.core import DTYPE_BYTES, Layout
from profiler.model_trace import ModelTrace


Size = Literal["hidden", "sharded", "scores"]


@dataclass(frozen=True)
class Kernel:
    """One memory-bound op of the layer and its gradient: bytes per element of `size` each pass moves."""

    name: str
    size: Size
    forward: float
    backward: float


# In forward order; backward runs them in reverse (the sums keep each pass's order).
KERNELS = (
    Kernel("input LayerNorm (apex fused): x in, y out", "hidden", forward=4, backward=10),
    # PyTorch 1.8's F.linear on a 3-D input runs matmul, then `output += bias`: 3 h/tp wide. Backward:
    # q, k, v gradients concatenated (split's backward), QKV bias grad sums them
    Kernel("QKV bias add after the GEMM: read and write the output", "sharded", forward=3 * 4,
           backward=3 * 4 + 3 * 2),
    Kernel("scaled upper-triangular masked softmax (fused): scores in, probs out; backward: grad, probs in, "
           "grad out", "scores", forward=4, backward=6),
    Kernel("attention dropout: probs in, probs and a 1-byte mask out; backward: grad, mask in, grad out",
           "scores", forward=5, backward=5),
    Kernel("context permute to [s, b, h/tp] (.contiguous()); backward: a copy back to the bmm's layout",
           "sharded", forward=4, backward=4),
    Kernel("bias-dropout-add after attention (jit): x, residual in; out, mask out", "hidden", forward=7, backward=7),
    # forward's residual adds are inside the bias-dropout-adds
    Kernel("residual gradient sums, two per layer: two grads in, one out", "hidden", forward=0, backward=2 * 6),
    # apex's LayerNorm backward reads grad and input twice: input grad, then gamma/beta partial sums
    Kernel("post-attention LayerNorm", "hidden", forward=4, backward=10),
    Kernel("bias-GeLU (jit): 4h/tp in and out; backward: grad, input in, grad out; bias grad sums it", "sharded",
           forward=4 * 4, backward=4 * 8),
    Kernel("bias-dropout-add after the MLP; backward: grad, mask in, grad out; bias grad sums it", "hidden",
           forward=7, backward=7),
)

# Megatron's Float16OptimizerWithFloat16Params + apex FusedAdam, bytes per parameter per step:
# fp16 grad -> fp32 main grad (2 + 4), unscale and inf check (4 + 4), the grad-norm read for
# --clip-grad (4), Adam on the fp32 master, grad, m, v (4 x 4 read, 3 x 4 written), the master
# copied back to the fp16 weights (4 + 2).
ADAM_BYTES_PER_PARAM = 6 + 8 + 4 + 28 + 6


def _bytes(bytes_per_element: Iterable[tuple[float, Size]], elements: dict[Size, float]) -> float:
    return sum(per_element * elements[size] for per_element, size in bytes_per_element)


def layer_elementwise_bytes(trace: ModelTrace, layout: Layout) -> tuple[float, float]:
    """(forward, backward) bytes one decoder layer's memory-bound kernels move for one micro-batch
    on one device. Sequence parallelism (not in the 2021 code) would shard the replicated ones; the
    score kernels run only where the attention is explicit (`trace.attention` "eager")."""
    tokens = layout.mbs * trace.seq
    explicit = trace.attention == "eager"
    elements: dict[Size, float] = {"hidden": tokens * trace.hidden_size / (layout.tp if layout.sp else 1),
                                   "sharded": tokens * trace.hidden_size / layout.tp,
                                   "scores": layout.mbs * trace.num_heads / layout.tp * trace.seq**2 * explicit}
    return (_bytes(((k.forward, k.size) for k in KERNELS), elements),
            _bytes(((k.backward, k.size) for k in reversed(KERNELS)), elements))


def gradient_accumulation_bytes(layout: Layout, trainable: float) -> float:
    """Bytes per micro-batch, averaged over the step, that autograd's accumulation into `.grad`
    moves: every micro-batch after the first reads the new gradient and the sum, and writes the
    sum, in the layout's dtype (the SC21 runs kept no fp32 accumulation buffer)."""
    return (layout.gas - 1) / layout.gas * 3 * DTYPE_BYTES[layout.dtype] * trainable
