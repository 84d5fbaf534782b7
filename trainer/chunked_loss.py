"""A causal LM's loss computed chunk by chunk, so that no step holds the whole logits.

HF's loss runs the LM head over every token, up-casts the logits to fp32 and keeps their fp32
log-softmax for backward; its backward then holds about three logits-sized fp32 buffers at once
(planner/memory.py `logits_transient_bytes`). At 128k-152k vocabularies and long sequences that is
the peak of a fine-tune. Here the decoder runs alone (no logits), then the head and the
cross-entropy run over `LOSS_CHUNK_TOKENS` tokens at a time, each chunk under non-reentrant
activation checkpointing: forward keeps only the chunk's input (a view of the hidden states the
head would keep anyway) and its summed loss, and backward recomputes the chunk's logits, so one
chunk's logits are alive at any time. The head's forward runs twice (priced by planner/cost_model.py).
The split is torchtune's chunked output loss taken one step further (its chunks still keep every
chunk's logits); Liger's fused linear cross-entropy avoids the recomputation with a hand-written
backward, which the checkpoint spares us here.

Reduction exactly as transformers' `ForCausalLMLoss`: labels shifted left by one (the last
position predicts nothing), -100 not trained, the sum over trained tokens divided by
`num_items_in_batch` when given (trainer/batch.py: the step's token weighting), else their mean.

`install_chunked_loss` puts it behind the model's own forward: whatever wraps the model (DDP,
DeepSpeed, FSDP2, peft) still calls that forward, so their hooks run as before; without labels
(generation) the model's own forward runs.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from specs.capabilities import LOSS_CHUNK_TOKENS
from trainer.batch import IGNORE


def chunked_causal_lm_loss(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor,
                           num_items_in_batch: float | torch.Tensor | None = None,
                           chunk_tokens: int = LOSS_CHUNK_TOKENS) -> torch.Tensor:
    """The causal LM loss of the final hidden states (rows, seq, hidden) through `head`, over chunks
    of `chunk_tokens` tokens; the value and gradients of HF's `ForCausalLMLoss` on `head(hidden)`."""
    targets = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    summed = sum(_chunk_loss(head, h, t) for h, t in zip(flat.split(chunk_tokens), targets.split(chunk_tokens)))
    if num_items_in_batch is None:
        return summed / (targets != IGNORE).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(summed.device)
    return summed / num_items_in_batch


def _chunk_loss(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One chunk's summed token loss; with gradients, its logits are recomputed in backward."""
    run = functools.partial(_summed_cross_entropy, head)
    if not torch.is_grad_enabled():
        return run(hidden, targets)
    # no randomness in a head: nothing to replay
    return checkpoint(run, hidden, targets, use_reentrant=False, preserve_rng_state=False)


def _summed_cross_entropy(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # HF's up-cast
    return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum")


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The HF causal LM itself: under a peft wrapper (LoRA, QLoRA), the model it adapts in place."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def install_chunked_loss(model: torch.nn.Module, chunk_tokens: int = LOSS_CHUNK_TOKENS) -> None:
    """Make `model`'s forward (the HF model's, under peft if wrapped) compute its loss chunked
    whenever it is given labels; its output then carries the loss alone (no logits)."""
    lm = causal_lm(model)
    lm.forward = _forward_with_chunked_loss(lm, lm.forward, chunk_tokens)


def _forward_with_chunked_loss(lm: torch.nn.Module, own_forward: Callable[..., Any],
                               chunk_tokens: int) -> Callable[..., Any]:
    from transformers.modeling_outputs import CausalLMOutputWithPast  # heavy: loaded with the model

    decoder = getattr(lm, lm.base_model_prefix)

    def forward(input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_items_in_batch: float | torch.Tensor | None = None, **kwargs: Any) -> Any:
        if labels is None:
            return own_forward(input_ids=input_ids, **kwargs)
        hidden = decoder(input_ids=input_ids, **kwargs).last_hidden_state
        loss = chunked_causal_lm_loss(hidden, lm.get_output_embeddings(), labels, num_items_in_batch, chunk_tokens)
        return CausalLMOutputWithPast(loss=loss)

    return forward
