"""Turn a stage's data sources into packed token sequences (and cache them in the run dir)."""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path

import numpy as np

from advisor.errors import UsageError
from advisor.task import DataSource, StageSpec, TaskSpec
from trainer.stream import Source, pack

BYTE_EOS = 256  # byte-level fallback: ids 0-255 are bytes, 256 closes a document


class ByteTokenizer:
    """UTF-8 bytes as tokens: needs no files and no training, fits any vocabulary >= 257."""

    eos_token_id = BYTE_EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _read_texts(source: DataSource, base: Path) -> list[str]:
    pattern = str(base / source.path) if not Path(source.path).is_absolute() else source.path
    paths = sorted(glob.glob(pattern)) or ([pattern] if Path(pattern).exists() else [])
    if not paths:
        raise UsageError(f"data source not found: {pattern}")
    texts = []
    for path in paths:
        if source.format in ("jsonl", "json"):
            with open(path, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except ValueError:
                        raise UsageError(f"{path}:{line_no}: not valid JSON") from None
                    if source.text_field not in row:
                        raise UsageError(f"{path}:{line_no}: no '{source.text_field}' field")
                    texts.append(str(row[source.text_field]))
        elif source.format == "text":
            texts.extend(p for p in Path(path).read_text(encoding="utf-8").split("\n\n") if p.strip())
        else:
            raise UsageError(f"{path}: format {source.format} is read by `advisor data prepare` shards")
    return texts


def load_source(source: DataSource, task: TaskSpec, tokenizer, seq: int, cache: Path | None) -> np.ndarray:
    base = Path(task.base_dir)
    key = hashlib.sha256(json.dumps([source.model_dump(), str(base), seq, type(tokenizer).__name__]).encode())
    cached = cache / f"{key.hexdigest()[:20]}.npy" if cache else None
    if cached and cached.is_file():
        return np.load(cached)
    texts = _read_texts(source, base)
    packed = pack([tokenizer.encode(t) for t in texts], seq, tokenizer.eos_token_id)
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp.npy")
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
    return sources
