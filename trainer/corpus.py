"""Turn a stage's data sources into packed token sequences (and cache them in the run dir)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from advisor.errors import UsageError
from advisor.task import DataSource, StageSpec, TaskSpec
from trainer.data.demo_corpus import generate_command
from trainer.data.sources import expand_source_path, read_batches
from trainer.data.tokenizer import TextTokenizer, resolve_tokenizer_path
from trainer.stream import Source, pack

BYTE_EOS = 256  # byte-level fallback: ids 0-255 are bytes, 256 closes a document


class ByteTokenizer:
    """UTF-8 bytes as tokens: needs no files and no training, fits any vocabulary >= 257. The
    fallback when neither the task nor the model preset names a tokenizer."""

    eos_token_id = BYTE_EOS
    name = "bytes"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]


class FileTokenizer:
    """A local tokenizer (the task's `data.tokenizer`, or the one shipped for the model preset)."""

    def __init__(self, path: Path):
        self._inner = TextTokenizer(path)
        if self._inner.eos_id is None:
            raise UsageError(f"tokenizer {path} has no end-of-text token to separate packed documents")
        self.eos_token_id = int(self._inner.eos_id)
        self.vocab_size = self._inner.vocab_size
        self.name = str(path)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._inner.encode(texts)


def tokenizer_for(task: TaskSpec, model_name: str, vocab_size: int):
    """The task's tokenizer, else the model preset's shipped one, else bytes."""
    configured = getattr(getattr(task, "data", None), "tokenizer", None)
    try:
        path = resolve_tokenizer_path(configured, model_name, Path(task.base_dir))
    except UsageError:
        if configured:
            raise
        if vocab_size <= BYTE_EOS:
            raise UsageError("no tokenizer for this model and its vocabulary is too small for bytes (< 257)") from None
        return ByteTokenizer()
    tokenizer = FileTokenizer(path)
    if tokenizer.vocab_size > vocab_size:
        raise UsageError(f"tokenizer {path} has {tokenizer.vocab_size} tokens, the model only {vocab_size}")
    return tokenizer


def _source_files(source: DataSource, base: Path) -> list[Path]:
    """The source's files: a file, a glob or a folder (trainer.data.sources reads paths the same way
    for `advisor data prepare`)."""
    try:
        return expand_source_path(base, source.path, source.format)
    except UsageError as exc:
        command = generate_command(base)
        raise UsageError(f"{exc} (generated data: `{command}` writes it)" if command else str(exc)) from None


def _read_texts(source: DataSource, base: Path) -> list[str]:
    texts = []
    for path in _source_files(source, base):
        if source.format in ("jsonl", "json"):
            with open(path, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError:
                        raise UsageError(f"{path}:{line_no}: not valid JSON") from None
                    text = row.get(source.text_field) if isinstance(row, dict) else None
                    if not isinstance(text, str):  # missing, null, a number: a bad row, never the string "None"
                        raise UsageError(f"{path}:{line_no}: field '{source.text_field}' is missing or not a string")
                    texts.append(text)
        elif source.format == "text":
            texts.extend(p for p in Path(path).read_text(encoding="utf-8").split("\n\n") if p.strip())
        else:  # columnar files: through `datasets`, as `advisor data prepare` reads them
            texts.extend(text for batch in read_batches(path, source.format, source.text_field) for text in batch.texts)
    return texts


def read_prompt_answers(source: DataSource, base: Path, limit: int) -> list[tuple[str, str]]:
    """Up to `limit` (prompt, reference answer) pairs of a source, in file order: its JSON-lines rows
    that hold both a `prompt` and a `completion` string (other rows and formats have no answer to
    score and give none)."""
    pairs: list[tuple[str, str]] = []
    if source.format not in ("jsonl", "json"):
        return pairs
    for path in _source_files(source, base):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if len(pairs) >= limit:
                    return pairs
                try:
                    row = json.loads(line) if line.strip() else None
                except ValueError:
                    continue  # training reads the same file and names a bad row
                if isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
                    pairs.append((row["prompt"], row["completion"]))
    return pairs


def _files_stamp(source: DataSource, base: Path) -> list[list]:
    """Each file of the source with its size and modification time: an edited file misses the cache."""
    stamps = []
    for path in _source_files(source, base):
        st = os.stat(path)
        stamps.append([str(path), st.st_size, st.st_mtime_ns])
    return stamps


def load_source(source: DataSource, task: TaskSpec, tokenizer, seq: int, cache: Path | None) -> np.ndarray:
    base = Path(task.base_dir)
    key = hashlib.sha256(json.dumps([source.model_dump(mode="json"), str(base), seq, tokenizer.name,
                                     _files_stamp(source, base)]).encode())
    cached = cache / f"{key.hexdigest()[:20]}.npy" if cache else None
    if cached and cached.is_file():
        return np.load(cached)
    texts = _read_texts(source, base)
    packed = pack(tokenizer.encode_batch(texts), seq, tokenizer.eos_token_id)
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.stem}.{os.getpid()}.npy")  # ranks may race to write it
        np.save(tmp, packed)
        tmp.replace(cached)
    return packed


def stage_sources(task: TaskSpec, index: int, tokenizer, seq: int, cache: Path | None) -> list[Source]:
    """The stage's own sources by weight, plus replayed earlier stages by their share of tokens."""
    stage: StageSpec = task.stages[index]
    own_share = 1.0 - sum(stage.replay.values())
    if own_share <= 0:
        raise UsageError(f"stage '{stage.name}': replay shares leave nothing for its own data")
    sources = []
    weight_total = sum(s.weight for s in stage.sources) or 1.0
    for src in stage.sources:
        sources.append(Source(f"{stage.name}:{src.path}", load_source(src, task, tokenizer, seq, cache),
                              own_share * src.weight / weight_total))
    for name, share in stage.replay.items():
        earlier = next(s for s in task.stages if s.name == name)
        total = sum(s.weight for s in earlier.sources) or 1.0
        for src in earlier.sources:
            sources.append(Source(f"{name}:{src.path}", load_source(src, task, tokenizer, seq, cache),
                                  share * src.weight / total))
    if stage.ramp_steps and index > 0:
        _ramp_from(task.stages[index - 1], sources, lambda src: load_source(src, task, tokenizer, seq, cache))
    return sources


def _ramp_from(previous: StageSpec, sources: list[Source], load) -> None:
    """A ramped stage starts from the previous stage's own data, by that stage's weights: its
    sources get those start weights (added with no weight in the target mix where this stage does
    not replay them)."""
    total = sum(s.weight for s in previous.sources) or 1.0
    by_name = {s.name: s for s in sources}
    for src in previous.sources:
        name = f"{previous.name}:{src.path}"
        if name not in by_name:
            by_name[name] = Source(name, load(src), 0.0)
            sources.append(by_name[name])
        by_name[name].start_weight = src.weight / total


def epoch_pass_tokens(task: TaskSpec, model_name: str, vocab_size: int, seq: int) -> dict[str, int]:
    """For each stage budgeted in epochs whose data is readable now: the tokens of one pass over its
    own sources, packed at `seq` as the trainer packs them, with its replay share on top
    (own / (1 - replay)), the way the prepared manifest counts a stage. `advisor plan` sizes such
    stages from these; a stage whose data is not there yet is left out (sized at run time)."""
    counts: dict[str, int] = {}
    wanted = [stage for stage in task.stages if stage.epochs is not None and stage.sources]
    if not wanted:
        return counts
    tokenizer = tokenizer_for(task, model_name, vocab_size)
    for stage in wanted:
        try:
            rows = sum(len(load_source(src, task, tokenizer, seq, None)) for src in stage.sources)
        except (UsageError, OSError):
            continue
        share = 1.0 - sum(stage.replay.values())
        if rows and share > 0:
            counts[stage.name] = round(rows * seq / share)
    return counts
