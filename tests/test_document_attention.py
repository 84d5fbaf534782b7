"""Packed rows on a kernel with no s x s mask (trainer/attention.py): the document kernel's loss and
gradients equal SDPA's under transformers' document mask, its peak holds no s x s tensor, and its
CUDA branch (varlen FlashAttention) is driven here on CPU with a stand-in for the CUDA kernel."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from profiler.op_watch import op_watch
from specs.capabilities import DOCUMENT_ATTENTION, attention_implementation
from trainer import attention
from trainer.attention import document_bounds, register_document_attention

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 272, "max_position_embeddings": 4096,
          "use_cache": False}  # as the trainer builds its models: with a cache transformers ignores packing
# two rows of 64 tokens: 2, 3 and 4 documents, one row starting inside a document (positions from 5)
ROWS = {2: [[40, 24], [30, 34]], 3: [[20, 30, 14], [10, 10, 44]], 4: [[16, 16, 16, 16], [5, 30, 20, 9]]}


def _positions(lengths: list[list[int]], first: int = 0) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) + (first if i == 0 and r == 1 else 0)
                                   for i, n in enumerate(row)]) for r, row in enumerate(lengths)])


def _model(impl: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG), attn_implementation=impl,
                                            dtype=torch.float32).train()


def _loss_and_grads(impl: str, ids: torch.Tensor, positions: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model = _model(impl)
    loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
    loss.backward()
    return loss.item(), [p.grad for p in model.parameters()]


def test_the_trainer_runs_the_document_kernel_on_cuda_only() -> None:
    assert attention_implementation("cuda") == DOCUMENT_ATTENTION
    assert attention_implementation("cpu") == "sdpa"  # as the CPU traces of packed rows price it


def test_document_bounds_restart_where_positions_do_not_continue() -> None:
    positions = _positions(ROWS[3], first=5)
    assert document_bounds(positions).tolist() == [0, 20, 50, 64, 74, 84, 128]


@pytest.mark.parametrize("documents", sorted(ROWS))
def test_document_kernel_equals_sdpa_under_the_document_mask(documents: int) -> None:
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(documents))
    positions = _positions(ROWS[documents], first=5)
    masked_loss, masked = _loss_and_grads("sdpa", ids, positions)
    loss, grads = _loss_and_grads(register_document_attention(), ids, positions)
    assert loss == pytest.approx(masked_loss, abs=1e-5)
    for grad, reference in zip(grads, masked):
        torch.testing.assert_close(grad, reference, rtol=0, atol=1e-5)


class _LargestTensor(op_watch()):
    """The most elements of any tensor an op makes (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def see(self, func, args, kwargs, out) -> None:
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())


def _peak_and_largest(impl: str, ids: torch.Tensor, positions: torch.Tensor) -> tuple[float, int]:
    from torch.distributed._tools.mem_tracker import MemTracker

    model = _model(impl)
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, _LargestTensor() as largest:
        model(input_ids=ids, labels=ids, position_ids=positions).loss.backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], largest.largest


def test_document_kernel_peak_holds_no_seq_by_seq_tensor() -> None:
    seq = 2048
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    positions = _positions([[700, 500, 600, 248]])
    masked_peak, masked_largest = _peak_and_largest("sdpa", ids, positions)
    peak, largest = _peak_and_largest(register_document_attention(), ids, positions)
    assert masked_largest >= seq * seq  # transformers' document mask: the s x s the kernel avoids
    assert largest < seq * seq / 4  # nothing near s x s; the logits (s x vocab) are the largest
    assert peak <= masked_peak - seq * seq  # at least the boolean mask's bytes less


def _fake_varlen(with_gqa: bool):
    """A stand-in for CUDA's varlen FlashAttention with its contract checked: (T, H, D) inputs,
    one document per `cu_seqlens` interval, causal by window (-1, 0); computed by causal SDPA."""
    calls = []

    def varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False):
        calls.append({"gqa": enable_gqa, "kv_heads": k.shape[1]})
        assert cu_seq_q is cu_seq_k and cu_seq_q.dtype == torch.int32 and window_size == (-1, 0)
        assert max_q == max_k == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
        bounds = cu_seq_q.tolist()
        parts = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True,
                                                scale=scale, enable_gqa=enable_gqa)[0].transpose(0, 1)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(parts)

    if not with_gqa:  # torch 2.11's signature: no enable_gqa
        def older(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            return varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)
        return older, calls
    return varlen_attn, calls


@pytest.mark.parametrize("with_gqa", [True, False])
def test_cuda_branch_runs_varlen_flash_attention_as_its_contract_says(with_gqa: bool, monkeypatch) -> None:
    fake, calls = _fake_varlen(with_gqa)
    assert ("enable_gqa" in inspect.signature(fake).parameters) == with_gqa
    monkeypatch.setattr(attention, "_varlen_attn", lambda: fake)
    monkeypatch.setattr(attention, "_runs_varlen", lambda query, dropout: dropout == 0.0)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(1))
    positions = _positions(ROWS[4], first=5)
    masked_loss, masked = _loss_and_grads("sdpa", ids, positions)
    loss, grads = _loss_and_grads(register_document_attention(), ids, positions)
    assert len(calls) == CONFIG["num_hidden_layers"]  # one varlen call per layer for the whole micro-batch
    expected_kv = CONFIG["num_key_value_heads"] if with_gqa else CONFIG["num_attention_heads"]
    assert all(c["kv_heads"] == expected_kv and c["gqa"] == with_gqa for c in calls)
    assert loss == pytest.approx(masked_loss, abs=1e-5)
    for grad, reference in zip(grads, masked):
        torch.testing.assert_close(grad, reference, rtol=0, atol=1e-5)


def test_generation_with_a_padding_mask_runs_transformers_sdpa() -> None:
    from transformers import GenerationConfig

    prompts = torch.randint(1, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0  # left padding
    outputs = {}
    for impl in ("sdpa", register_document_attention()):
        model = _model(impl).eval()
        config = GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0)
        outputs[impl] = model.generate(input_ids=prompts, attention_mask=mask, generation_config=config)
    assert torch.equal(outputs["sdpa"], outputs[DOCUMENT_ATTENTION])
