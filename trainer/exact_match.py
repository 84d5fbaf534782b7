"""Exact match: the model answers held-out prompts by greedy decoding, scored against the reference.

An answer counts when the tokens generated up to the first end-of-text equal the reference answer's
tokens, and the model did stop there: it has (longest reference answer of the batch + 1) new
tokens to do so (more new tokens cannot change the score: the answer must stop there). Prompts go
in batches, in order, left-padded with an attention mask, through the model's own `generate`
(greedy, no sampling). A batch holds as many prompts as fit half the tokens of one training
micro-batch (mbs x seq / 2, prompt and answer counted), and at least mbs. Decoding holds no
gradients, and its KV cache keeps two vectors per layer and token where a training micro-step keeps
at least one (the layer's input, under full recomputation) and its gradient in backward: a batch of
half those tokens is not what runs out of memory. One decoding step of many prompts costs about
what one prompt's does where the step is bound by launching its kernels (small models, and the
host's side of every GPU step). Each data-parallel replica answers its share of the prompts and
the counts are added (trainer/eval_shards.py); the ranks of one replica run the same decoding. Under
ZeRO-3, FSDP2 and tensor parallelism each forward is a collective that all ranks must enter
together: every rank makes as many `generate` calls (a shorter share pads with one-token calls),
and `synced_gpus` keeps the ranks stepping until the last of them is done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from specs.task import TaskSpec
from trainer.corpus import read_answer_pairs
from trainer.eval_shards import EvalShard

# A pipeline engine's model is its chunks run in turn (trainer/engines/pipeline.py PipelineForward):
# it has no `generate`, and the summary says exact match was not scored there.
NOT_SCORED_PIPELINE = "not scored: the pipeline engine holds no whole model to decode with"

Pair = tuple[Sequence[int], Sequence[int]]  # (prompt token ids, reference answer token ids)


def can_generate(model: torch.nn.Module) -> bool:
    return callable(getattr(model, "generate", None))


def greedy_answers(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos: int,
                   device: torch.device) -> list[list[int]]:
    """One micro-batch of prompts answered greedily: each answer's tokens up to (without) the first
    end-of-text, or all `max_new_tokens` when it never stopped."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding: every prompt ends where generation starts
        ids[row, width - len(prompt):] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    synced = dist.is_initialized() and dist.get_world_size() > 1
    # the trainer builds its models with use_cache off (training needs no KV cache); decoding does
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False, num_beams=1,
                         max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos, synced_gpus=synced,
                         use_cache=True)
    answers = []
    for row in out[:, width:].tolist():
        answers.append(row[:row.index(eos)] if eos in row else row)
    return answers


def answer_batches(pairs: Sequence[Pair], micro_batch: int, tokens: int) -> list[slice]:
    """`pairs` cut, in order, into batches of at least `micro_batch` prompts (fewer only at the end)
    that grow while every row, padded to the batch's longest prompt and answered with the batch's
    longest answer + 1 tokens, fits `tokens` in all."""
    batches, start = [], 0
    while start < len(pairs):
        stop, width, new = start, 0, 0
        while stop < len(pairs):
            grown_width = max(width, len(pairs[stop][0]))
            grown_new = max(new, len(pairs[stop][1]) + 1)
            if stop - start >= micro_batch and (stop + 1 - start) * (grown_width + grown_new) > tokens:
                break
            stop, width, new = stop + 1, grown_width, grown_new
        batches.append(slice(start, stop))
        start = stop
    return batches


def exact_match(model: torch.nn.Module, pairs: Sequence[Pair], eos: int, micro_batch: int,
                device: torch.device, tokens: int = 0, shard: EvalShard = EvalShard()) -> float:
    """Share of `pairs` whose greedy answer equals the reference exactly (see the module's doc), in
    batches of `answer_batches` (`tokens` 0: of `micro_batch` prompts), each data-parallel replica
    answering its `shard` of them (trainer/eval_shards.py). A reference that ends with end-of-text is
    compared without it."""
    references = [list(answer[:-1]) if len(answer) and answer[-1] == eos else list(answer) for _, answer in pairs]
    shares = [answer_batches(pairs[slice(*EvalShard(r, shard.replicas).bounds(len(pairs), micro_batch))],
                             micro_batch, tokens) for r in range(shard.replicas)]  # every rank's call count
    lo = shard.bounds(len(pairs), micro_batch)[0]
    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for k in range(max(map(len, shares), default=0)):  # as many `generate` calls on every rank
            if k >= len(shares[shard.rank]):  # a shorter share: one token of the first prompt, dropped
                greedy_answers(model, [pairs[0][0]], 1, eos, device)
                continue
            batch = shares[shard.rank][k]
            wanted = references[lo + batch.start:lo + batch.stop]
            prompts = [prompt for prompt, _ in pairs[lo + batch.start:lo + batch.stop]]
            answers = greedy_answers(model, prompts, max(len(r) for r in wanted) + 1, eos, device)
            correct += sum(answer == reference for answer, reference in zip(answers, wanted))
    model.train(was_training)
    return round(shard.total([correct], device)[0]) / len(pairs) if pairs else 0.0


def stage_exact_match(model: torch.nn.Module, task: TaskSpec, upto: int, tokenizer: Any, micro_batch: int,
                      prompts: int, device: torch.device, seq: int = 0,
                      shard: EvalShard = EvalShard()) -> dict[str, float | None] | None:
    """Exact match per stage (skill) with eval data, for stages 0..upto: its first `prompts` held-out
    rows with a prompt and an answer, in batches of `micro_batch` prompts or more (half the tokens of
    a training micro-batch of `seq`-token rows: see the module's doc), this replica's `shard` of
    them; None for a skill whose eval rows have no answers, and None overall for an engine without a
    whole model (the pipeline)."""
    module = getattr(model, "module", model)  # DDP and DeepSpeed wrap the HF model
    if not can_generate(module):
        return None
    scores: dict[str, float | None] = {}
    for stage in task.stages[: upto + 1]:
        if not stage.eval_sources or prompts <= 0:
            continue
        pairs = [pair for src in stage.eval_sources
                 for pair in read_answer_pairs(src, Path(task.base_dir), tokenizer, prompts)][:prompts]
        scores[stage.name] = exact_match(module, pairs, _stop_token(pairs, tokenizer), micro_batch, device,
                                         micro_batch * seq // 2, shard) if pairs else None
    return scores


def _stop_token(pairs: Sequence[Pair], tokenizer: Any) -> int:
    """The token that closes an answer: the end-of-turn token of a chat template (every rendered
    answer ends with it), else end-of-text."""
    ends = {answer[-1] for _, answer in pairs if len(answer)}
    return ends.pop() if len(ends) == 1 else int(tokenizer.eos_token_id)
