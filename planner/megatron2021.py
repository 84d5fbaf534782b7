"""What Megatron-LM's 2021 GPT layer moves through memory outside its GEMMs (the `megatron` engine).

The engine prices published Megatron-LM runs (bench/megatron_table1.py: Narayanan et al. 2021,
run at commit 6985e589 in the NGC PyTorch 20.12 container). Its memory-bound kernels are counted
here one by one from that commit's megatron/model/transformer.py, instead of the generic
`ELEMENTWISE_PASSES` x saved-activation estimate the cost model uses for the engines we run.

Units: bytes per element of one of three tensor sizes of one micro-batch on one device,
* `hidden`: b s h, the replicated hidden states (LayerNorm, residual, dropout);
* `sharded`: b s h / tp, a tensor-parallel slice of the hidden size;
* `scores`: b (a / tp) s^2, the attention scores.
Activations are fp16 (2 bytes), dropout masks 1 byte. The score matmuls' own reads and writes are
priced by the cost model's roofline term, the GEMMs' by their FLOPs, the TP all-reduces as
communication: none of them appears here.
"""

from __future__ import annotations

from dataclasses import dataclass

from specs.core import DTYPE_BYTES, Layout
from profiler.model_trace import ModelTrace


@dataclass(frozen=True)
class Kernel:
    name: str
    hidden: float = 0.0
    sharded: float = 0.0
    scores: float = 0.0


FORWARD = (
    Kernel("input LayerNorm (apex fused): x in, y out", hidden=4),
    # PyTorch 1.8's F.linear on a 3-D input runs matmul, then `output += bias`: 3 h/tp wide
    Kernel("QKV bias add after the GEMM: read and write the output", sharded=3 * 4),
    Kernel("scaled upper-triangular masked softmax (fused): scores in, probs out", scores=4),
    Kernel("attention dropout: probs in, probs and a 1-byte mask out", scores=5),
    Kernel("context permute to [s, b, h/tp] (.contiguous())", sharded=4),
    Kernel("bias-dropout-add after attention (jit): x, residual in; out, mask out", hidden=7),
    Kernel("post-attention LayerNorm", hidden=4),
    Kernel("bias-GeLU (jit): 4h/tp in and out", sharded=4 * 4),
    Kernel("bias-dropout-add after the MLP", hidden=7),
)

BACKWARD = (
    Kernel("bias-dropout-add (MLP) backward: grad, mask in, grad out; bias grad sums it", hidden=7),
    Kernel("bias-GeLU backward: grad, input in, grad out; bias grad sums it", sharded=4 * 8),
    # apex's backward reads grad and input twice: input grad, then gamma/beta partial sums
    Kernel("post-attention LayerNorm backward", hidden=10),
    Kernel("residual gradient sums, two per layer: two grads in, one out", hidden=2 * 6),
    Kernel("bias-dropout-add (attention) backward", hidden=7),
    Kernel("context permute backward: a copy back to the bmm's layout", sharded=4),
    Kernel("attention dropout backward: grad, mask in, grad out", scores=5),
    Kernel("softmax backward (fused): grad, probs in, grad out", scores=6),
    Kernel("q, k, v gradients concatenated (split's backward), QKV bias grad sums them", sharded=3 * 4 + 3 * 2),
    Kernel("input LayerNorm backward", hidden=10),
)

# Megatron's Float16OptimizerWithFloat16Params + apex FusedAdam, bytes per parameter per step:
# fp16 grad -> fp32 main grad (2 + 4), unscale and inf check (4 + 4), the grad-norm read for
# --clip-grad (4), Adam on the fp32 master, grad, m, v (4 x 4 read, 3 x 4 written), the master
# copied back to the fp16 weights (4 + 2).
ADAM_BYTES_PER_PARAM = 6 + 8 + 4 + 28 + 6


def _bytes(kernels: tuple[Kernel, ...], hidden: float, sharded: float, scores: float) -> float:
    return sum(k.hidden * hidden + k.sharded * sharded + k.scores * scores for k in kernels)


def layer_elementwise_bytes(trace: ModelTrace, layout: Layout) -> tuple[float, float]:
    """(forward, backward) bytes one decoder layer's memory-bound kernels move for one micro-batch
    on one device. Sequence parallelism (not in the 2021 code) would shard the replicated ones."""
    tokens = layout.mbs * trace.seq
    hidden = tokens * trace.hidden_size / (layout.tp if layout.sp else 1)
    sharded = tokens * trace.hidden_size / layout.tp
    scores = layout.mbs * trace.num_heads / layout.tp * trace.seq**2
    return _bytes(FORWARD, hidden, sharded, scores), _bytes(BACKWARD, hidden, sharded, scores)


def gradient_accumulation_bytes(layout: Layout, trainable: float) -> float:
    """Bytes per micro-batch, averaged over the step, that autograd's accumulation into `.grad`
    moves: every micro-batch after the first reads the new gradient and the sum, and writes the
    sum, in the layout's dtype (the SC21 runs kept no fp32 accumulation buffer)."""
    return (layout.gas - 1) / layout.gas * 3 * DTYPE_BYTES[layout.dtype] * trainable
