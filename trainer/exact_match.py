"""Exact match: the model answers held-out prompts by greedy decoding, scored against the reference.

An answer counts when the tokens generated up to the first end-of-text equal the reference answer's
tokens, and the model did stop there: it has (longest reference answer of the micro-batch + 1) new
tokens to do so. Prompts go in micro-batches, left-padded with an attention mask, through the
model's own `generate` (greedy, no sampling). Every rank runs the same decoding: under ZeRO-3,
FSDP2 and tensor parallelism each forward is a collective that all ranks must enter together, so
`synced_gpus` keeps the ranks stepping until the last of them is done.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from specs.task import TaskSpec
from trainer.corpus import read_answer_pairs

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


def exact_match(model: torch.nn.Module, pairs: Sequence[Pair], eos: int, micro_batch: int,
                device: torch.device) -> float:
    """Share of `pairs` whose greedy answer equals the reference exactly (see the module's doc).
    A reference that ends with end-of-text is compared without it."""
    references = [list(answer[:-1]) if len(answer) and answer[-1] == eos else list(answer) for _, answer in pairs]
    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(pairs), micro_batch):
            wanted = references[start:start + micro_batch]
            prompts = [prompt for prompt, _ in pairs[start:start + micro_batch]]
            answers = greedy_answers(model, prompts, max(len(r) for r in wanted) + 1, eos, device)
            correct += sum(answer == reference for answer, reference in zip(answers, wanted))
    model.train(was_training)
    return correct / len(pairs) if pairs else 0.0


def stage_exact_match(model: torch.nn.Module, task: TaskSpec, upto: int, tokenizer: Any, micro_batch: int,
                      prompts: int, device: torch.device) -> dict[str, float | None] | None:
    """Exact match per stage (skill) with eval data, for stages 0..upto: its first `prompts` held-out
    rows with a prompt and an answer, in micro-batches of `micro_batch`; None for a skill whose eval
    rows have no answers, and None overall for an engine without a whole model (the pipeline)."""
    module = getattr(model, "module", model)  # DDP and DeepSpeed wrap the HF model
    if not can_generate(module):
        return None
    scores: dict[str, float | None] = {}
    for stage in task.stages[: upto + 1]:
        if not stage.eval_sources or prompts <= 0:
            continue
        pairs = [pair for src in stage.eval_sources
                 for pair in read_answer_pairs(src, Path(task.base_dir), tokenizer, prompts)][:prompts]
        scores[stage.name] = exact_match(module, pairs, _stop_token(pairs, tokenizer), micro_batch, device) \
            if pairs else None
    return scores


def _stop_token(pairs: Sequence[Pair], tokenizer: Any) -> int:
    """The token that closes an answer: the end-of-turn token of a chat template (every rendered
    answer ends with it), else end-of-text."""
    ends = {answer[-1] for _, answer in pairs if len(answer)}
    return ends.pop() if len(ends) == 1 else int(tokenizer.eos_token_id)
