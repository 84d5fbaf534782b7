"""Attention over packed rows with no s x s mask: each packed document attends only to itself.

The trainer packs several documents into a row (trainer/stream.py) and restarts the position ids
at every document. Given them, transformers builds a 4-D document mask; SDPA then cannot use its
flash kernel, expands GQA's key/value heads, and every row costs an s x s mask. This kernel reads
the documents' bounds from the position ids instead (a document starts wherever the position
does not continue by one, as transformers' own packed-sequence test reads them):

* on CUDA, torch's variable-length FlashAttention (`torch.nn.attention.varlen.varlen_attn`) over
  all documents of the micro-batch as one ragged batch: no mask, masked blocks never computed;
* elsewhere, SDPA's fused causal kernel document by document: exact, no mask, and sum(s_i^2)
  work instead of s^2. Written here because neither FlexAttention (no CPU backward in torch 2.13)
  nor varlen FlashAttention (CUDA only) trains on a CPU.

Anything else (a padding mask, a KV cache's decode step) runs transformers' own SDPA path. Which
models run this kernel is declared once, in `specs.capabilities.attention_implementation`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from specs.capabilities import DOCUMENT_ATTENTION


def document_bounds(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative document offsets (int32, `cu_seqlens`) over the flattened (rows, seq) tokens: a
    document starts at every row start and wherever a position does not follow its neighbour."""
    rows, seq = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    offsets = starts.flatten().nonzero().flatten()
    return torch.cat([offsets, offsets.new_tensor([rows * seq])]).to(torch.int32)


def _varlen_attn() -> Any:
    """torch's varlen FlashAttention, where this torch has it (2.10 and later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _runs_varlen(query: torch.Tensor, dropout: float) -> bool:
    """Whether varlen FlashAttention runs these rows: on CUDA, where torch has it (no dropout)."""
    return query.device.type == "cuda" and dropout == 0.0 and _varlen_attn() is not None


def _varlen_on_cuda(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
                    scaling: float | None) -> torch.Tensor:
    """(b, h, s, d) inputs -> (b, s, h, d): one varlen FlashAttention call, causal per document."""
    varlen_attn = _varlen_attn()
    batch, heads, seq, _ = query.shape
    flat = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[3]) for t in (query, key, value)]
    q, k, v = flat
    gqa: dict[str, bool] = {}
    if k.shape[1] != heads:
        if "enable_gqa" in inspect.signature(varlen_attn).parameters:
            gqa = {"enable_gqa": True}
        else:  # torch 2.11's varlen kernel wants one key/value head per query head
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    longest = int((bounds[1:] - bounds[:-1]).max())
    out = varlen_attn(q, k, v, bounds, bounds, longest, longest, scale=scaling, window_size=(-1, 0), **gqa)
    return out.reshape(batch, seq, heads, -1)


def _document_by_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: torch.Tensor,
                          scaling: float | None, dropout: float) -> torch.Tensor:
    """(b, h, s, d) inputs -> (b, s, h, d): causal SDPA over each document's own tokens."""
    batch, heads, seq, _ = query.shape
    gqa = key.shape[1] != heads
    rows = []
    for row in range(batch):
        row_bounds = bounds[(bounds >= row * seq) & (bounds <= (row + 1) * seq)].tolist()
        parts = [F.scaled_dot_product_attention(
            query[row:row + 1, :, start - row * seq:end - row * seq], key[row:row + 1, :, start - row * seq:end - row * seq],
            value[row:row + 1, :, start - row * seq:end - row * seq], dropout_p=dropout, is_causal=True,
            scale=scaling, enable_gqa=gqa) for start, end in zip(row_bounds[:-1], row_bounds[1:])]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).transpose(1, 2)


def document_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: (b, h, s, d) in, ((b, s, h, d), no weights) out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    dropout = dropout if module.training else 0.0
    bounds = document_bounds(position_ids.expand(query.shape[0], -1))
    if bounds.numel() == query.shape[0] + 1:  # one document per row: SDPA's causal (flash) kernel
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2).contiguous(), None
    if _runs_varlen(query, dropout):
        return _varlen_on_cuda(query, key, value, bounds, scaling), None
    return _document_by_document(query, key, value, bounds, scaling, dropout), None


def _mask_only_for_padding(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """The mask transformers builds for this kernel: none for training rows (the kernel reads the
    documents from the position ids), SDPA's where a padding mask is given (batched generation)."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None or bool(attention_mask.all()):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register_document_attention() -> str:
    """Make the kernel known to transformers under `DOCUMENT_ATTENTION`; returns that name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)
    AttentionMaskInterface.register(DOCUMENT_ATTENTION, _mask_only_for_padding)
    return DOCUMENT_ATTENTION
