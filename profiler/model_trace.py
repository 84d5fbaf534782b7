"""Trace a Hugging Face model under fake tensors: parameters, FLOPs and saved activations per block.

Nothing is allocated and nothing is downloaded: the model is built from its config inside
`FakeTensorMode`, one training micro-step (forward, loss, backward) is run at the real width, and
we record

* FLOPs with `torch.utils.flop_counter.FlopCounterMode` (forward and backward separately);
* every tensor autograd saves for backward (`saved_tensors_hooks`), de-duplicated by storage and
  excluding parameters, classified as *replicated* (outside Megatron tensor-parallel regions, e.g.
  LayerNorm inputs, residual dropout masks) or *sharded* (between a column-parallel and the
  following row-parallel linear), and as *attention scores* when it is an s x s tensor.

Only one and two decoder layers are traced; the difference is one layer and the rest is the
embedding plus the head. Deep models then scale exactly, so `llama3-405b` traces in about a second.

CPU-vs-GPU corrections (target `cuda`), applied by running the GPU's kernels' autograd contracts:
* attention `flash` runs `aten._scaled_dot_product_flash_attention_for_cpu`, which saves what
  FlashAttention-2 saves on a GPU (q, k, v, output, fp32 log-sum-exp) and no s x s matrix;
* dropout runs `aten.native_dropout`, which saves a 1-byte boolean mask as CUDA's fused kernel
  does (the CPU kernel keeps a mask in the activation dtype).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Literal

from pydantic import BaseModel, Field

from specs.errors import UsageError
from specs.capabilities import precision
from specs.layout_rules import CONFIG_KEYS, config_value
from specs.model_depth import layer_kinds, per_layer_keys, with_layers
from specs.remote_code import code_digest
from specs.core import DTYPE_BYTES, SELECTIVE_SAVED_OPS, Layout, ModelSpec
from presets import cache_dir
from profiler.attention_support import runnable_attention
from profiler.op_watch import op_watch

Attention = Literal["flash", "sdpa", "eager"]


# Linear modules that Megatron-style TP splits by output (column) or by input (row). The names
# cover Llama/Mistral/Qwen (q_proj...), GPT-2 (c_attn/c_fc/c_proj), GPT-NeoX and Falcon.
_COLUMN_NAMES = {
    "q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj",
    "c_attn", "c_fc", "query_key_value", "dense_h_to_4h", "w1", "w3", "fc1", "Wqkv", "lm_head",
}
_ROW_NAMES = {"o_proj", "down_proj", "c_proj", "dense_4h_to_h", "w2", "fc2", "out_proj", "dense"}


class BlockTrace(BaseModel):
    """One kind of block (embedding, decoder layer, head) for ONE sequence of the traced length."""

    # a float only where it must be: the mean layer of a model whose layers differ may hold a
    # fraction of a parameter (the traces of uniform models keep whole counts, as shipped)
    params: int | float = 0
    trainable_params: int | float = 0
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    act_replicated_bytes: float = 0.0  # saved outside TP regions (LN inputs, masks)
    act_sharded_bytes: float = 0.0  # saved inside TP regions, divided by tp
    act_scores_bytes: float = 0.0  # the s x s part of the sharded bytes
    input_bytes: float = 0.0  # the block's input hidden states (kept by full recompute)
    selective_replicated_bytes: float = 0.0  # outputs of SELECTIVE_SAVED_OPS outside TP regions (row-parallel GEMMs)
    selective_sharded_bytes: float = 0.0  # outputs of SELECTIVE_SAVED_OPS inside TP regions (column GEMMs, attention)
    # 16-bit copies of the fp32 weights that autocast casts (bf16-mixed), alive from their forward to their backward
    # whatever the micro-batch size; not in the activations
    cast_weight_bytes: float = 0.0
    # What the host launches and what the memory-bound kernels move (`kernel_log`), per sequence:
    # a GPU runs ahead of its host only while a kernel outlasts a launch (planner/cost_model.py, host floor)
    fwd_ops: float = 0.0  # kernels launched in forward (views and metadata ops excluded)
    bwd_ops: float = 0.0  # kernels launched in backward
    fwd_dense_ops: float = 0.0  # of the forward's, GEMMs and attention kernels (priced by FLOPs)
    bwd_dense_ops: float = 0.0  # of the backward's, GEMMs and attention kernels
    fwd_traffic_bytes: float = 0.0  # bytes read and written by the forward's memory-bound kernels (all but dense ones)
    bwd_traffic_bytes: float = 0.0  # the same in backward
    # bytes read and written by GEMMs with a side of at most SKINNY_GEMM_SIDE (LoRA's adapters): memory-bound,
    # priced by bytes where that is slower than by FLOPs
    skinny_gemm_bytes: float = 0.0
    # of the FLOPs (forward and backward), those of GEMMs and attention computed in fp32 (LoRA's adapters; QLoRA's
    # up-cast LM head, and its attention on the fp32 residual)
    fp32_dense_flops: float = 0.0

    @property
    def act_bytes(self) -> float:
        return self.act_replicated_bytes + self.act_sharded_bytes

    def minus(self, other: "BlockTrace") -> "BlockTrace":
        return BlockTrace(**{k: getattr(self, k) - getattr(other, k) for k in BlockTrace.model_fields})

    @staticmethod
    def mean(parts: list[tuple[int, "BlockTrace"]]) -> "BlockTrace":
        """The mean block of `count` blocks of each kind: the model's layer count times the mean is
        the sum of its layers."""
        if len(parts) == 1:
            return parts[0][1]
        total = sum(count for count, _ in parts)
        return BlockTrace(**{k: sum(count * getattr(block, k) for count, block in parts) / total
                             for k in BlockTrace.model_fields})


class AutocastBlocks(BaseModel):
    """A decoder layer and the head as bf16-mixed computes them on the engines that autocast (fp32
    parameters, forward and loss under torch.autocast: specs.capabilities `precision`): the residual
    stream and the norms' inputs stay fp32, the GEMMs' outputs are 16-bit, and autocast keeps a 16-bit
    copy of every weight it casts (`BlockTrace.cast_weight_bytes`)."""

    layer: BlockTrace
    head: BlockTrace


class ModelTrace(BaseModel):
    """What the cost model needs to know about a model, per sequence of `seq` tokens."""

    model: str
    model_type: str
    seq: int
    dtype: str
    method: str
    lora_rank: int
    attention: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    params: int
    trainable_params: int
    embedding: BlockTrace
    layer: BlockTrace
    head: BlockTrace
    # the blocks as autocast runs them (16-bit full fine-tuning); `layer` and `head` are the 16-bit
    # module's (DeepSpeed, FSDP2's gathered 16-bit weights), FLOPs and parameters alike in both
    autocast: AutocastBlocks | None = None
    notes: list[str] = Field(default_factory=list)

    @property
    def flops_per_sequence(self) -> float:
        """Model FLOPs (forward + backward, no recomputation) for one sequence."""
        blocks = (self.embedding, self.head)
        per_layer = self.layer.fwd_flops + self.layer.bwd_flops
        return self.num_layers * per_layer + sum(b.fwd_flops + b.bwd_flops for b in blocks)


# --------------------------------------------------------------------------------------------
# architecture facts read from any HF config


def _cfg_get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def architecture_dims(cfg: dict[str, Any]) -> dict[str, int]:
    """The model's sizes, read as the layout rules read them (`specs.layout_rules.CONFIG_KEYS`)."""
    def size(name: str, default: Any = None) -> int:
        value = config_value(cfg, name, default)
        if value is None:
            raise UsageError(f"the model's config gives no {name} (any of {', '.join(CONFIG_KEYS[name])})")
        return int(value)

    hidden, heads = size("hidden_size"), size("num_heads")
    return {
        "hidden_size": hidden,
        "num_layers": size("num_layers"),
        "num_heads": heads,
        "num_kv_heads": size("num_kv_heads", heads),
        "head_dim": int(_cfg_get(cfg, "head_dim", default=hidden // heads)),
        "intermediate_size": size("intermediate_size", 4 * hidden),
        "vocab_size": int(_cfg_get(cfg, "vocab_size")),
    }


# --------------------------------------------------------------------------------------------
# GPU kernel contracts, run on CPU under fake tensors


def _flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """FlashAttention's autograd contract (saves q, k, v, out, fp32 logsumexp; no s x s tensor)."""
    import torch

    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # flash kernels broadcast GQA heads without a copy; expand is a view
        key = key[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2)
        value = value[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p=0.0, is_causal=True, scale=scaling
    )[0]
    return out.transpose(1, 2).contiguous(), None


def _native_dropout(input, p=0.5, training=True, inplace=False):
    import torch

    if not training or p == 0.0:
        return input
    return torch.native_dropout(input, p, True)[0]


@contextlib.contextmanager
def _gpu_kernel_contracts(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    import torch

    original = torch.nn.functional.dropout
    torch.nn.functional.dropout = _native_dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = original


@contextlib.contextmanager
def _one_unpacked_sequence() -> Iterator[None]:
    """Let HF's mask code see what a run of unpacked rows sees: one sequence per row.

    transformers decides whether a batch packs several sequences by reading the position ids, which
    fake tensors cannot do, so under FakeTensorMode it assumes packing: it materialises an s x s
    causal mask, which SDPA then saves, and a mask turns off SDPA's native GQA, so the key/value
    heads get expanded and saved expanded. A real run of the same model finds no packing, passes no
    mask and saves neither (measured: an s x s fp32 tensor and the expanded k/v per layer too many).
    A run whose rows pack several documents (`trace_model(packed=True)`) does both, as traced then.
    """
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def attention_model_flops(query_shape: Any, key_shape: Any, value_shape: Any) -> int:
    """Model FLOPs of one attention forward from its shapes, (batch, heads, seq, head_dim) each:
    the scores' and the output's matmuls, 2 b h_q s_q s_k (d_qk + d_v). Counted over the query
    heads: with grouped-query attention (fewer key/value heads) every query head still multiplies
    its own scores, the kernel only broadcasts the shared key/value heads. We count it ourselves
    because torch's `sdpa_flop_count` asserted equal head counts up to torch 2.11, which stopped every
    trace of a GQA model (Llama 3, Qwen2, Mistral) on the torch our floor admits."""
    batch, query_heads, query_len, qk_dim = (int(d) for d in query_shape)
    key_batch, kv_heads, key_len, key_dim = (int(d) for d in key_shape)
    value_dim = int(value_shape[-1])
    if key_batch != batch or key_dim != qk_dim or kv_heads < 1 or query_heads % kv_heads:
        raise UsageError(f"attention shapes do not fit: query {tuple(query_shape)}, key {tuple(key_shape)}")
    return 2 * batch * query_heads * query_len * key_len * (qk_dim + value_dim)


def _count_cpu_attention_flops() -> None:
    """Teach `FlopCounterMode` the CPU fused attention kernel, which it does not count.

    torch registers FLOP formulas for the CUDA attention kernels only, so both our FlashAttention
    contract and SDPA on CPU (`_scaled_dot_product_flash_attention_for_cpu`) used to count zero
    attention FLOPs. We count model FLOPs as Narayanan et al. (2021) and the eager path do: the two
    s x s matmuls forward (full, not causal-halved) and twice that backward (the kernel's recomputed
    scores are overhead, not model FLOPs; the fitted GEMM efficiency absorbs them). Set in the
    registry directly, so that a torch release which registers its own formula for these kernels
    cannot change what the trace counts.
    """
    import torch
    from torch.utils.flop_counter import flop_registry, shape_wrapper

    def forward_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
        return attention_model_flops(query_shape, key_shape, value_shape)

    def backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
        return 2 * attention_model_flops(query_shape, key_shape, value_shape)

    kernels = ((torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, forward_flops),
               (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward, backward_flops))
    for packet, formula in kernels:
        flop_registry[packet] = shape_wrapper(formula)  # the formulas read shapes, as torch's do


def _register_flash() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register("advisor_fa_contract", _flash_attention)
    return "advisor_fa_contract"


# --------------------------------------------------------------------------------------------
# one traced step


class _SavedTensorLog:
    """Records tensors saved for backward, classified by TP region and by s x s shape."""

    def __init__(self, param_storages: set, seq: int, num_heads: int):
        self.param_storages = param_storages
        self.seq = seq
        self.num_heads = num_heads
        self.in_tp_region = False
        self.seen: set = set()
        self.replicated = 0.0
        self.sharded = 0.0
        self.scores = 0.0

    def pack(self, tensor: "torch.Tensor") -> "torch.Tensor":
        from torch.multiprocessing.reductions import StorageWeakRef

        storage = StorageWeakRef(tensor.untyped_storage())
        if storage in self.param_storages or storage in self.seen:
            return tensor
        self.seen.add(storage)
        nbytes = tensor.untyped_storage().nbytes()
        if self.in_tp_region:
            self.sharded += nbytes
            # attention scores are (batch, heads, s, s) or (batch*heads, s, s)
            if tensor.dim() >= 3 and list(tensor.shape[-3:]) == [self.num_heads, self.seq, self.seq]:
                self.scores += nbytes
        else:
            self.replicated += nbytes
        return tensor

    def hooks_for(self, model: "torch.nn.Module", column: set[str], row: set[str]) -> list[Any]:
        handles = []

        def enter_replicated(*_):
            self.in_tp_region = False

        def enter_sharded(*_):
            self.in_tp_region = True

        for name, module in model.named_modules():
            last = name.rsplit(".", 1)[-1]
            if last in column:
                # the input (saved during forward) is replicated; what follows the output is sharded
                handles.append(module.register_forward_pre_hook(enter_replicated))
                handles.append(module.register_forward_hook(enter_sharded))
            elif last in row:
                handles.append(module.register_forward_hook(enter_replicated))
        return handles


def _selective_log(row: set[str], model: "torch.nn.Module") -> Any:
    """A dispatch mode that adds up what op-level selective recomputation keeps: the outputs of
    `SELECTIVE_SAVED_OPS` (the trainer's policy reads the same list) in forward, replicated
    when a row-parallel linear makes them (its output is whole on every TP rank) and sharded
    otherwise (column-parallel GEMMs, the attention kernel)."""
    import torch
    from torch.utils._pytree import tree_leaves

    saved = {getattr(torch.ops.aten, name) for name in SELECTIVE_SAVED_OPS if hasattr(torch.ops.aten, name)}

    class SelectiveLog(op_watch()):
        def __init__(self) -> None:
            super().__init__()
            self.in_row = False
            self.replicated = 0.0
            self.sharded = 0.0
            self.handles = []
            for name, module in model.named_modules():
                if name.rsplit(".", 1)[-1] in row:
                    self.handles.append(module.register_forward_pre_hook(lambda *_: setattr(self, "in_row", True)))
                    self.handles.append(module.register_forward_hook(lambda *_: setattr(self, "in_row", False)))

        def see(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
            if func.overloadpacket in saved:
                for tensor in tree_leaves(out):  # each a fresh allocation: no storage is counted twice
                    if isinstance(tensor, torch.Tensor):
                        nbytes = tensor.untyped_storage().nbytes()
                        if self.in_row:
                            self.replicated += nbytes
                        else:
                            self.sharded += nbytes

    return SelectiveLog()


def _cast_log(log: _SavedTensorLog) -> Any:
    """A dispatch mode that finds the 16-bit copies autocast makes of the parameters (one per weight
    and forward: autocast caches them): it adds their storages to what `log` leaves out of the
    activations, and their bytes up."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    class CastLog(op_watch()):
        def __init__(self) -> None:
            super().__init__()
            self.bytes = 0.0

        def see(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
            if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
                if StorageWeakRef(args[0].untyped_storage()) in log.param_storages:
                    copy = StorageWeakRef(out.untyped_storage())
                    if copy not in log.param_storages:
                        log.param_storages.add(copy)
                        self.bytes += out.untyped_storage().nbytes()

    return CastLog()


# Bytes per parameter of a 4-bit NF4 weight with double quantisation (Dettmers et al. 2023,
# QLoRA section 3): 4 bits + an 8-bit absmax per 64-weight block + an fp32 constant per 256 blocks.
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
NF4_DEQUANTIZE = "nf4_dequantize"


@lru_cache(maxsize=1)
def _nf4_linear() -> Any:
    """bitsandbytes' 4-bit matmul as its autograd runs it (`bnb.matmul_4bit`, `MatMul4Bit`), for
    the trace: the weight is dequantised to the compute dtype in forward, used and dropped, and
    dequantised again in backward for the input's gradient; nothing of the input is saved (the
    frozen weight needs no gradient). The dequantisation is one op (`advisor::nf4_dequantize`)
    that `kernel_log` prices as bitsandbytes' kernel moves it; the trace holds the weight in 16 bits."""
    import torch

    @torch.library.custom_op(f"advisor::{NF4_DEQUANTIZE}", mutates_args=(), schema="(Tensor weight) -> Tensor")
    def dequantize(weight):  # type: ignore[no-untyped-def]
        return weight.clone()

    @dequantize.register_fake
    def _(weight):  # type: ignore[no-untyped-def]
        return torch.empty_like(weight)

    class Nf4Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(weight)
            return x @ dequantize(weight).t()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            (weight,) = ctx.saved_tensors
            return grad @ dequantize(weight), None

    return Nf4Linear


def _as_qlora_runs(model: "torch.nn.Module", compute_dtype: "torch.dtype") -> None:
    """Make a 16-bit model compute as the trainer's QLoRA recipe runs it (trainer/adapters.py):
    every decoder linear a bitsandbytes `Linear4bit` (input cast to the compute dtype, the 4-bit
    matmul, output cast back to the input's dtype), then peft's `prepare_model_for_kbit_training`,
    which up-casts every other 16-bit parameter (embedding, norms, LM head) to fp32: the residual
    stream, the norms, the attention on their outputs and the head then run in fp32."""
    import torch

    nf4 = _nf4_linear()
    head = model.get_output_embeddings()

    def quantized_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out = nf4.apply(x.to(compute_dtype), module.weight)
        if module.bias is not None:
            out = out + module.bias.to(compute_dtype)
        return out.to(x.dtype)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.forward = functools.partial(quantized_forward, module)
    for name, param in model.named_parameters():
        quantized = name.endswith(".weight") and isinstance(model.get_submodule(name[:-7]), torch.nn.Linear) \
            and model.get_submodule(name[:-7]) is not head
        if not quantized and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(torch.float32)


# Ops that launch no kernel: they only make a new view of existing storage (torch marks most with
# `is_view`; these return fresh tensor objects over the same storage without the mark).
_METADATA_OPS = frozenset({"_unsafe_view", "detach", "alias", "lift_fresh", "_reshape_alias", "set_",
                           "_local_scalar_dense", "is_same_size", "resolve_conj", "resolve_neg"})
_DENSE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "convolution", "convolution_backward"})
# A GEMM with a side this narrow (LoRA's rank, a head's few columns) does a few FLOPs per byte it
# moves: on every GPU it is bound by memory, not by its FLOPs.
SKINNY_GEMM_SIDE = 64


def _tensor_bytes(value: Any) -> float:
    import torch
    from torch.utils._pytree import tree_leaves

    return float(sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor)))


def kernel_log() -> Any:
    """A dispatch mode that counts what the host launches: every op but views and metadata ops is
    one kernel launch (an eager step pays Python, autograd and dispatch for each); of them, GEMMs and
    attention kernels are `dense` (priced by their FLOPs); every other kernel is memory-bound and
    moves its inputs and outputs once (`traffic`). Forward and backward are told apart by `phase`."""
    import torch

    class KernelLog(op_watch()):
        def __init__(self) -> None:
            super().__init__()
            self.phase = "fwd"
            self.ops = {"fwd": 0.0, "bwd": 0.0}
            self.dense = {"fwd": 0.0, "bwd": 0.0}
            self.traffic = {"fwd": 0.0, "bwd": 0.0}
            self.skinny = 0.0
            self.fp32_flops = 0.0

        def see(self, func: Any, args: tuple, kwargs: dict[str, Any], out: Any) -> None:
            name = func.overloadpacket.__name__
            if func.is_view or name in _METADATA_OPS or func.namespace == "prim" or name.startswith("sym_"):
                return
            self.ops[self.phase] += 1
            moved = _tensor_bytes(args) + _tensor_bytes(kwargs) + _tensor_bytes(out)
            if name == NF4_DEQUANTIZE:  # reads the 4-bit blocks, writes the 16-bit weight (traced in 16 bits)
                moved = _tensor_bytes(out) * (1 + NF4_BYTES_PER_PARAM / 2)
            if name in _DENSE_OPS or "attention" in name:
                self.dense[self.phase] += 1
                self._dense(name, args, moved)
            else:
                self.traffic[self.phase] += moved

        def _dense(self, name: str, args: tuple, moved: float) -> None:
            tensors = [t for t in args if isinstance(t, torch.Tensor)]
            if "attention" in name:
                qkv = tensors[1:4] if "backward" in name else tensors[:3]
                if qkv[0].dtype == torch.float32:
                    scale = 2 if "backward" in name else 1
                    self.fp32_flops += scale * attention_model_flops(*(t.shape for t in qkv))
                return
            if name not in ("mm", "addmm", "bmm", "baddbmm"):
                return
            a, b = tensors[-2:]  # addmm/baddbmm: (bias, a, b)
            if min(a.shape[-2:]) <= SKINNY_GEMM_SIDE or min(b.shape[-2:]) <= SKINNY_GEMM_SIDE:
                self.skinny += moved
            if a.dtype == torch.float32:
                self.fp32_flops += 2 * a.numel() * b.shape[-1]

        def fields(self) -> dict[str, float]:
            return {"fwd_ops": self.ops["fwd"], "bwd_ops": self.ops["bwd"], "fwd_dense_ops": self.dense["fwd"],
                    "bwd_dense_ops": self.dense["bwd"], "fwd_traffic_bytes": self.traffic["fwd"],
                    "bwd_traffic_bytes": self.traffic["bwd"], "skinny_gemm_bytes": self.skinny,
                    "fp32_dense_flops": self.fp32_flops}

    return KernelLog()


def traced_under_autocast(dtype: str, method: str) -> bool:
    """Whether a trace of `dtype` and `method` also traces the step as the engines that autocast run
    it (specs.capabilities `precision`): fp32 parameters, forward and loss under torch.autocast
    (`AutocastBlocks`)."""
    return dtype != "fp32" and precision(Layout(dtype=dtype, method=method), "plain").autocast  # type: ignore[arg-type]


def _tp_names(cfg: dict[str, Any], hf_config: Any) -> tuple[set[str], set[str]]:
    plan = getattr(hf_config, "base_model_tp_plan", None) or {}
    column = set(_COLUMN_NAMES)
    row = set(_ROW_NAMES)
    for pattern, style in plan.items():
        last = pattern.rsplit(".", 1)[-1]
        if "colwise" in style:
            column.add(last)
        elif "rowwise" in style:
            row.add(last)
    return column, row


def _trace_once(
    cfg: dict[str, Any], layers: list[int], seq: int, dtype: str, method: str, lora_rank: int,
    attention: Attention, gpu_contracts: bool, packed: bool = False, autocast: bool = False,
) -> tuple[BlockTrace, int, int]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils.flop_counter import FlopCounterMode

    from profiler.hardware_bench import TORCH_DTYPES  # imports torch: deferred like the imports above
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = with_layers(cfg, layers)  # built like these layers of the model, per-layer lists cut to match
    cfg.pop("quantization_config", None)
    try:
        hf_config = AutoConfig.for_model(**cfg)
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"transformers cannot build a config of type '{cfg.get('model_type')}': {exc}") from None
    attn_impl = _register_flash() if attention == "flash" else attention
    _count_cpu_attention_flops()
    hf_config.use_cache = False
    torch_dtype = TORCH_DTYPES[dtype]
    # bf16-mixed keeps fp32 parameters and computes under autocast, as the trainer runs it
    compute = (torch.autocast("cpu", dtype=torch_dtype) if autocast  # type: ignore[attr-defined]
               else contextlib.nullcontext())
    previous_default = torch.get_default_dtype()
    # Build on the meta device (no init work, no memory), add adapters there, then give the
    # parameters fake storage: building directly under FakeTensorMode is slower and breaks peft.
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_default_dtype(torch.float32 if autocast else torch_dtype)
        try:
            attn_impl = runnable_attention(hf_config, attn_impl)  # eager where the family has no SDPA
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn_impl)
        finally:
            torch.set_default_dtype(previous_default)
        if method == "qlora":
            _as_qlora_runs(model, torch_dtype)
        if method in ("lora", "qlora"):
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(
                model,
                LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0,
                           target_modules="all-linear", task_type="CAUSAL_LM"),
            )
    rows = contextlib.nullcontext() if packed else _one_unpacked_sequence()
    with FakeTensorMode(allow_non_fake_inputs=True), _gpu_kernel_contracts(gpu_contracts), rows:
        model.to_empty(device="cpu")
        model.tie_weights()  # to_empty gives tied matrices separate storage
        model.train()
        params = list(model.parameters())
        total = sum(p.numel() for p in params)
        trainable = sum(p.numel() for p in params if p.requires_grad)
        log = _SavedTensorLog({StorageWeakRef(p.untyped_storage()) for p in params}, seq,
                              architecture_dims(cfg)["num_heads"])
        column, row = _tp_names(cfg, hf_config)
        handles = log.hooks_for(model, column, row)
        selective = _selective_log(row, model)
        casts = _cast_log(log)
        kernels = kernel_log()
        ids = torch.zeros((1, seq), dtype=torch.long)
        with FlopCounterMode(display=False) as counter, kernels:
            with torch.autograd.graph.saved_tensors_hooks(log.pack, lambda t: t), selective, casts, compute:
                loss = model(input_ids=ids, labels=ids).loss
            fwd = counter.get_total_flops()
            if method in ("lora", "qlora") and trainable == 0:
                raise UsageError("LoRA found no linear layer to adapt in this architecture")
            kernels.phase = "bwd"
            loss.backward()
            total_flops = counter.get_total_flops()
        for handle in handles + selective.handles:
            handle.remove()
    block = BlockTrace(
        params=total, trainable_params=trainable, fwd_flops=float(fwd), bwd_flops=float(total_flops - fwd),
        act_replicated_bytes=log.replicated, act_sharded_bytes=log.sharded, act_scores_bytes=log.scores,
        selective_replicated_bytes=selective.replicated, selective_sharded_bytes=selective.sharded,
        cast_weight_bytes=casts.bytes, **kernels.fields(),
    )
    return block, total, trainable


def default_attention(device_type: str) -> Attention:
    """What the target runs: FlashAttention on GPUs, PyTorch SDPA on CPU."""
    return "flash" if device_type == "cuda" else "sdpa"


def _layer_and_rest(cfg: dict[str, Any], seq: int, dtype: str, method: str, lora_rank: int, attention: str,
                    gpu_contracts: bool, packed: bool, autocast: bool = False) -> tuple[BlockTrace, BlockTrace]:
    """The mean decoder layer and the rest of the model (embedding and head). A two-layer trace less a
    one-layer one is one layer; where the layers differ (`layer_types`: sliding or full attention,
    per-layer head counts), each kind is traced after the most common one and weighted by how many
    layers it has, so that the model's totals add up. The layer's `input_bytes` are its input hidden
    states, what a full-recompute checkpoint keeps per layer: fp32 where the residual stream stays
    fp32 (autocast, QLoRA's up-cast model), else the traced dtype."""
    def trace(layers: list[int]) -> BlockTrace:
        return _trace_once(cfg, layers, seq, dtype, method, lora_rank, attention,  # type: ignore[arg-type]
                           gpu_contracts, packed, autocast=autocast)[0]

    kinds = layer_kinds(cfg)
    common = kinds[0][0]
    one = trace([common])
    layers = [(count, trace([common, first]).minus(one)) for first, count in kinds]
    layer = BlockTrace.mean(layers)
    rest = one.minus(layers[0][1])  # the one-layer trace less its (most common) layer
    # the residual stream is fp32 under autocast and in QLoRA's up-cast model (`_as_qlora_runs`)
    stream_fp32 = autocast or method == "qlora"
    layer.input_bytes = seq * architecture_dims(cfg)["hidden_size"] * (4 if stream_fp32 else DTYPE_BYTES[dtype])
    return layer, rest


def _layer_lists_in_full(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the per-layer lists its config class derives when the file has none (Qwen2's
    `layer_types` from `max_window_layers`, Gemma's from its sliding-window pattern): cut to two
    layers, the class would derive them for two layers, not for the model."""
    from transformers import AutoConfig  # deferred: heavy, and only a cold trace needs it

    try:
        full = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"}).to_dict()
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"transformers cannot build a config of type '{cfg.get('model_type')}': {exc}") from None
    derived = {key: full[key] for key in per_layer_keys(full) if key not in cfg}
    return {**cfg, **derived}


def _kinds_note(cfg: dict[str, Any]) -> list[str]:
    kinds = layer_kinds(cfg)
    if len(kinds) == 1:
        return []
    described = ", ".join(f"{count} like layer {first}" for first, count in kinds)
    return [f"layers of {len(kinds)} kinds ({described}; per-layer lists {', '.join(per_layer_keys(cfg))}): "
            "each traced, the layer block is their mean"]


@lru_cache(maxsize=256)
def _trace_cached(
    name: str, cfg_key: str, seq: int, dtype: str, method: str, lora_rank: int, attention: str,
    gpu_contracts: bool, packed: bool = False,
) -> ModelTrace:
    cfg = _layer_lists_in_full(json.loads(cfg_key))
    dims = architecture_dims(cfg)
    traced = (cfg, seq, dtype, method, lora_rank, attention, gpu_contracts, packed)
    layer, outer = _layer_and_rest(*traced)
    # Split the outer part: the embedding keeps only token ids; everything else is the head
    # (final norm, lm_head, fp32 logits for the loss).
    embed_params = dims["vocab_size"] * dims["hidden_size"]
    embed_params += _position_params(cfg, dims)
    embedding = BlockTrace(params=embed_params, trainable_params=embed_params if method == "full" else 0)
    # Tied embeddings are counted once by parameters(), so the head keeps only its norm then.
    head = outer.minus(embedding)
    head.input_bytes = layer.input_bytes  # the final norm's input: the residual stream
    layers = dims["num_layers"]
    params = round(layers * layer.params + outer.params)
    trainable = round(layers * layer.trainable_params + outer.trainable_params)
    notes = _kinds_note(cfg)
    if gpu_contracts:
        notes.append("GPU kernels: FlashAttention saves no s x s matrix; dropout masks are 1 byte")
    if method == "qlora":
        notes.append("QLoRA traced as it runs: 4-bit linears dequantised in forward and backward, the rest up-cast to fp32")
    autocast = None
    if traced_under_autocast(dtype, method):
        mixed_layer, mixed_outer = _layer_and_rest(*traced, autocast=True)
        mixed_head = mixed_outer.minus(embedding)
        mixed_head.input_bytes = mixed_layer.input_bytes
        autocast = AutocastBlocks(layer=mixed_layer, head=mixed_head)
        notes.append(f"{dtype}-mixed also traced: fp32 parameters, forward and loss under autocast")
    return ModelTrace(
        model=name, model_type=str(cfg.get("model_type")), seq=seq, dtype=dtype, method=method,
        lora_rank=lora_rank, attention=attention, params=params, trainable_params=trainable,
        embedding=embedding, layer=layer, head=head, autocast=autocast, notes=notes, **dims,
    )


def _position_params(cfg: dict[str, Any], dims: dict[str, int]) -> int:
    if cfg.get("model_type") == "gpt2":
        return int(_cfg_get(cfg, "n_positions", "max_position_embeddings")) * dims["hidden_size"]
    return 0


TRACE_FORMAT = 4  # 2: attention FLOPs of the fused CPU kernel counted; 3: what selective recomputation keeps; 4: kernels launched, memory-bound bytes, QLoRA as it runs; bump when what a trace records changes, to invalidate disk caches
# SDPA traces (CPU) changed alone (4: one unpacked sequence, no mask, native GQA); the FlashAttention
# contract of GPU traces never saved the mask, so their (shipped) traces stay valid
SDPA_TRACE_FORMAT = 5  # 5: as TRACE_FORMAT 4


def _cache_dir() -> Path:
    return cache_dir() / "traces"


@functools.lru_cache(maxsize=1)
def _stack_versions() -> str:
    """Versions that change what a trace sees, read without importing the packages. Read once per
    process: each read parses three packages' metadata (~15 ms here), and every estimate keys its
    trace by them (the planner's tests price thousands)."""
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("torch", "transformers", "peft"):
        try:
            found.append(f"{package}={version(package)}")
        except PackageNotFoundError:
            found.append(f"{package}=none")
    return ",".join(found)


def _stack_family() -> str:
    """The release lines whose traces the shipped store may serve (same modelling code)."""
    found = []
    for part in _stack_versions().split(","):
        package, _, ver = part.partition("=")
        keep = 1 if package == "transformers" else 2
        found.append(f"{package}={'.'.join(ver.split('.')[:keep])}")
    return ",".join(found)


SHIPPED_DIR = Path(__file__).resolve().parent.parent / "presets" / "traces"


def _trace_key(versions: str, args: tuple) -> str:
    fmt = SDPA_TRACE_FORMAT if args[6] == "sdpa" else TRACE_FORMAT  # args[6]: the attention
    # 16-bit full fine-tuning traces carry the blocks as autocast runs them since issue 28 (bf16 is
    # bf16-mixed): keyed apart, so that a trace without them is never read again; the others keep their keys
    mixed = ["mixed"] if traced_under_autocast(args[3], args[4]) else []  # args[3:5]: dtype, method
    return hashlib.sha256(json.dumps([fmt, versions, *args, *mixed]).encode()).hexdigest()[:24]


def _read_trace(path: Path) -> ModelTrace | None:
    if not path.is_file():
        return None
    try:
        return ModelTrace.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None  # a damaged entry is traced again (and, in the user cache, overwritten)


def _trace_args(model: ModelSpec, seq: int, dtype: str, method: str, lora_rank: int, attention: str,
                device_type: str, packed: bool = False) -> tuple:
    trace_dtype = "bf16" if method == "qlora" and dtype == "fp32" else dtype
    cfg_key = json.dumps(copy.deepcopy(model.hf_config), sort_keys=True)
    args = (model.name, cfg_key, seq, trace_dtype, method, lora_rank, attention, device_type == "cuda")
    return args + (True,) if packed else args  # unpacked rows keep the keys (and shipped traces) they had


def ship_trace(model: ModelSpec, seq: int, dtype: str, method: str, lora_rank: int = 16,
               device_type: str = "cuda", packed: bool = False) -> Path:
    """Trace and store into the shipped store (`presets/traces`), keyed by release lines."""
    args = _trace_args(model, seq, dtype, method, lora_rank, default_attention(device_type), device_type, packed)
    path = SHIPPED_DIR / f"{_trace_key(_stack_family(), args)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_trace_cached(*args).model_dump_json())
    return path


def trace_model(
    model: ModelSpec, seq: int, dtype: str = "bf16", method: str = "full", lora_rank: int = 16,
    attention: Attention | None = None, device_type: str = "cuda", use_disk_cache: bool = True,
    packed: bool = False,
) -> ModelTrace:
    """Trace `model` for one sequence of `seq` tokens as it would train on `device_type`; `packed`:
    in rows that pack several documents, as the trainer packs its data (transformers then
    keeps the documents apart with a mask, which SDPA saves, and expands GQA's key/value heads).

    Activations and FLOPs are exactly linear in the micro-batch size, so the cost model scales
    this single-sequence trace. Results are cached in memory and on disk (`$ADVISOR_CACHE`,
    default ~/.cache/advisor) per config, arguments and torch/transformers/peft versions: a cold
    trace costs the transformers import (seconds on a small CPU), a cached one milliseconds.
    Preset models at common sequence lengths ship pre-traced (`python -m profiler.ship_traces`).
    """
    if method not in ("full", "lora", "qlora"):
        raise UsageError(f"method must be one of full, lora, qlora (got {method})")
    if seq < 1:
        raise UsageError(f"sequence length must be positive (got {seq})")
    attention = attention or default_attention(device_type)
    # the FlashAttention contract runs packed rows as variable-length sequences: no mask, native GQA
    packed = packed and attention != "flash"
    args = _trace_args(model, seq, dtype, method, lora_rank, attention, device_type, packed)
    # a folder's own model code is part of what was traced: another version of it is traced again
    path = _cache_dir() / f"{_trace_key(_stack_versions() + code_digest(model.hf_config, model.source), args)}.json"
    if use_disk_cache:
        # the user's cache (exact versions), then the traces shipped for the presets (same
        # release lines: a cold `estimate` of a preset needs no transformers import)
        for candidate in (path, SHIPPED_DIR / f"{_trace_key(_stack_family(), args)}.json"):
            cached = _read_trace(candidate)
            if cached is not None:
                return cached
    trace = _trace_cached(*args)
    if use_disk_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(trace.model_dump_json())
            tmp.replace(path)  # atomic: readers never see half a file
        except OSError:
            pass  # a read-only home only costs speed
    return trace
