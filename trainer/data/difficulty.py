"""Difficulty grades of documents, and the named bands the grades are cut into.

A grade is a number (higher is harder): the document's length in tokens, a numeric field of the
row, a rule (built-in `numbers` or `words`, or a user function `module:function` /
`path/to/file.py:function` taking the text), or the mean next-token loss of a small local
reference model that shares the task's tokenizer.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from specs.errors import UsageError
from specs.remote_code import refuse_remote_code
from specs.task import DifficultySpec

_NUMBER_RE = re.compile(r"\d+(?:\.\d+)?")
_WORD_RE = re.compile(r"\w+")

BUILTIN_RULES: dict[str, Callable[[str], float]] = {
    "numbers": lambda text: float(len(_NUMBER_RE.findall(text))),  # more operands: more steps to reason
    "words": lambda text: float(len(_WORD_RE.findall(text))),
}


def merge_difficulty(task_wide: DifficultySpec, stage: DifficultySpec | None) -> DifficultySpec:
    if stage is None:
        return task_wide
    return task_wide.model_copy(update={k: getattr(stage, k) for k in stage.model_fields_set})


def band_names(spec: DifficultySpec) -> list[str]:
    count = len(spec.edges) + 1
    if spec.names is not None:
        return list(spec.names)
    if count == 1:
        return ["all"]
    if count == 3:
        return ["easy", "medium", "hard"]
    return [f"band{i}" for i in range(count)]


def check_spec(spec: DifficultySpec, where: str) -> None:
    if list(spec.edges) != sorted(spec.edges) or len(set(spec.edges)) != len(spec.edges):
        raise UsageError(f"{where}: difficulty edges must increase: {spec.edges}")
    if spec.names is not None and len(spec.names) != len(spec.edges) + 1:
        raise UsageError(f"{where}: {len(spec.edges)} difficulty edges make {len(spec.edges) + 1} bands, "
                         f"but {len(spec.names)} names are given")
    if spec.by == "field" and not spec.field:
        raise UsageError(f"{where}: difficulty by field needs `field:` (the row field holding the grade)")
    if spec.by == "rule" and not spec.rule:
        raise UsageError(f"{where}: difficulty by rule needs `rule:` ({', '.join(BUILTIN_RULES)} or module:function)")
    if spec.by == "loss" and not spec.reference_model:
        raise UsageError(f"{where}: difficulty by loss needs `reference_model:` (a local model folder)")


def band_index(grades: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """Band of each grade: edges [e1, e2] give [-inf, e1) -> 0, [e1, e2) -> 1, [e2, inf) -> 2."""
    return np.searchsorted(np.asarray(edges, dtype=np.float64), grades, side="right").astype(np.int16)


def load_rule(rule: str, base_dir: Path, allow_code: bool = False) -> Callable[[str], float]:
    """A built-in rule name, `module:function`, or `path/to/file.py:function` (relative to the task).

    The last two import and run code named by a data file (`os:system` would run every document as
    a shell command), so they need the user's explicit `--allow-code`; nothing is imported without it."""
    if rule in BUILTIN_RULES:
        return BUILTIN_RULES[rule]
    if ":" not in rule:
        raise UsageError(f"difficulty rule '{rule}': use {', '.join(BUILTIN_RULES)}, module:function "
                         f"or path/to/file.py:function")
    if not allow_code:
        raise UsageError(f"difficulty.rule '{rule}' runs code named by the task file: pass --allow-code "
                         f"to allow it (built-in rules: {', '.join(BUILTIN_RULES)})")
    target, name = rule.rsplit(":", 1)
    try:
        if target.endswith(".py"):
            path = Path(target) if Path(target).is_absolute() else base_dir / target
            spec = importlib.util.spec_from_file_location(f"advisor_rule_{path.stem}", path)
            if spec is None or spec.loader is None or not path.is_file():
                raise UsageError(f"difficulty rule file not found: {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"difficulty rule '{rule}': cannot import {target}: {exc}") from None
    func = getattr(module, name, None)
    if not callable(func):
        raise UsageError(f"difficulty rule '{rule}': {target} has no function '{name}'")
    return func


class ReferenceLoss:
    """Mean next-token cross-entropy (nats) of each document under a small local causal LM.

    The model must use the task's tokenizer (ids are fed as they are); documents are truncated to
    `max_tokens`. Batches are padded on the right and the padding is masked out of the mean.
    """

    def __init__(self, folder: Path, max_tokens: int, batch_size: int = 16, trusted: bool = False) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if not (folder / "config.json").is_file():
            raise UsageError(f"reference model {folder}: not a local model folder (no config.json)")
        # its own Python code (auto_map) refused in one line, unless --trust-remote-code (`trusted`)
        refuse_remote_code(folder, "config.json", "reference model", trusted)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                              trust_remote_code=trusted)
        except Exception as exc:
            raise UsageError(f"cannot load reference model {folder}: {exc}") from None
        self.model.eval()
        self.vocab_size = self.model.config.vocab_size
        positions = getattr(self.model.config, "max_position_embeddings", None) or max_tokens
        self.max_tokens = min(max_tokens, positions)
        self.batch_size = batch_size
        self.torch = torch

    def __call__(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        torch = self.torch
        out = np.full(len(token_ids), math.nan)
        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))  # similar lengths batch together
        for lo in range(0, len(order), self.batch_size):
            chunk = order[lo:lo + self.batch_size]
            seqs = [list(token_ids[i][: self.max_tokens]) for i in chunk]
            if any(t >= self.vocab_size for s in seqs for t in s):
                raise UsageError(f"reference model vocabulary ({self.vocab_size}) is smaller than the task "
                                 "tokenizer's: it must share the task's tokenizer")
            width = max(len(s) for s in seqs)
            ids = torch.zeros((len(seqs), width), dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for r, s in enumerate(seqs):
                ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
                mask[r, : len(s)] = 1
            with torch.no_grad():
                logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            ).view(len(seqs), width - 1)
            valid = mask[:, 1:].float()
            mean = (nll * valid).sum(1) / valid.sum(1).clamp(min=1)
            for r, i in enumerate(chunk):
                out[i] = mean[r].item() if len(seqs[r]) > 1 else math.nan
        return out


class Grader:
    """Grades a batch of documents by the stage's difficulty spec."""

    def __init__(self, spec: DifficultySpec, base_dir: Path, max_tokens: int, allow_code: bool = False,
                 trusted: bool = False) -> None:
        self.spec = spec
        self._rule = load_rule(spec.rule, base_dir, allow_code) if spec.by == "rule" else None
        self._loss = None
        if spec.by == "loss":
            folder = Path(spec.reference_model)  # type: ignore[arg-type]
            self._loss = ReferenceLoss(folder if folder.is_absolute() else base_dir / folder, max_tokens,
                                       trusted=trusted)

    def grade(self, texts: Sequence[str], token_ids: Sequence[Sequence[int]], field_values: Sequence[Any] | None,
              where: Callable[[int], str]) -> np.ndarray:
        by = self.spec.by
        if by == "length":
            return np.fromiter((len(t) for t in token_ids), dtype=np.float64, count=len(token_ids))
        if by == "loss":
            assert self._loss is not None
            return self._loss(token_ids)
        if by == "rule":
            assert self._rule is not None
            values: Sequence[Any] = [self._rule(t) for t in texts]
            label = f"rule {self.spec.rule}"
        else:
            values = field_values if field_values is not None else [None] * len(texts)
            label = f"field '{self.spec.field}'"
        out = np.empty(len(values), dtype=np.float64)
        for i, v in enumerate(values):
            try:
                out[i] = float(v)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise UsageError(f"{where(i)}: difficulty {label} gave {v!r}, not a number") from None
        return out
