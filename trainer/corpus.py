"""Turn a stage's data sources into rows of token ids, labels and positions (cached in the run dir).

Each row of a source (a JSON array or JSON lines, parquet, arrow, CSV, text or a `save_to_disk`
folder: trainer/data/sources.py) is rendered in its row format (trainer/data/formats.py: text,
prompt_completion, chat, alpaca, sharegpt; detected from the first rows' fields when the task does
not say) into token ids with a label per token, then packed into rows of the plan's sequence length
with position ids that restart per document (trainer/stream.py `pack_stream` for text,
`pack_examples` for the supervised formats).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from specs.errors import UsageError
from specs.task import DataSource, StageSpec, TaskSpec
from trainer.data.chat_templates import builtin_template, use_builtin_template
from trainer.data.demo_corpus import generate_command
from trainer.data.formats import (BadRow, HFRowTokenizer, LossRule, prompt_and_answer, render_example,
                                  source_format)
from trainer.data.holdout import split_mask
from trainer.data.messages import refuse_media
from trainer.data.sources import expand_source_path, file_type_of, read_rows, row_location
from trainer.data.tokenizer import TextTokenizer, load_tokenizer, resolve_tokenizer_path
from trainer.stream import Packed, Source, pack_examples, pack_stream

BYTE_EOS = 256  # byte-level fallback: ids 0-255 are bytes, 256 closes a document


class ByteTokenizer:
    """UTF-8 bytes as tokens: needs no files and no training, fits any vocabulary >= 257. The
    fallback when neither the task nor the model preset names a tokenizer."""

    eos_token_id = BYTE_EOS
    name = "bytes"
    builtin_jinja: str | None = None  # no built-in chat template goes with bytes

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def has_chat_template(self) -> bool:
        return False

    def chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        raise UsageError("chat data needs a tokenizer with a chat template: set `data: {tokenizer: FOLDER}` in the "
                         "task or train from --weights FOLDER holding one (there is none for this model)")


class FileTokenizer:
    """A local tokenizer (the task's `data.tokenizer`, the --weights folder's, or the one shipped for
    the model preset). Chat templates are read through transformers, loaded on first use."""

    def __init__(self, path: Path, template: str | None = None, trusted: bool = False):
        self._inner = TextTokenizer(path, trusted)
        self.trusted = trusted  # --trust-remote-code: the folder's own tokenizer code may run
        if self._inner.eos_id is None:
            raise UsageError(f"tokenizer {path} has no end-of-text token to separate packed documents")
        self.eos_token_id = int(self._inner.eos_id)
        self.vocab_size = self._inner.vocab_size
        self.template = template
        if template is not None:
            builtin_template(template)  # an unknown name refused before any row is read
        # the name keys the run's cache of rendered rows: another template renders other tokens
        self.name = str(path) + (f" (template {template})" if template else "")
        self.path = Path(path)
        self._hf: HFRowTokenizer | None = None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._inner.encode(texts)

    def encode(self, text: str) -> list[int]:
        return self._inner.encode([text])[0]

    @property
    def _templates(self) -> HFRowTokenizer:
        """The transformers tokenizer of the same files, for its chat template (loaded on first use)."""
        if self._hf is None:
            hf = load_tokenizer(self.path, self.trusted)
            if self.template:
                hf = use_builtin_template(hf, self.template, str(self.path))
            self._hf = HFRowTokenizer(hf, str(self.path), self.eos_token_id)
        return self._hf

    @property
    def builtin_jinja(self) -> str | None:
        """The built-in chat template chosen with --template (None: the tokenizer's own, if any)."""
        return builtin_template(self.template).jinja if self.template else None

    def has_chat_template(self) -> bool:
        return self._templates.has_chat_template()

    def chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
        return self._templates.chat(messages, add_generation_prompt, tools)


def tokenizer_for(task: TaskSpec, model_name: str, vocab_size: int, weights: str | None = None,
                  template: str | None = None, trusted: bool = False):
    """The task's tokenizer, else the one in the --weights folder, else the model preset's shipped
    one, else bytes; with `template`, a built-in chat template (trainer/data/chat_templates.py)
    instead of the tokenizer's own. `trusted`: --trust-remote-code."""
    configured = getattr(getattr(task, "data", None), "tokenizer", None)
    if not configured and weights and _has_tokenizer(Path(weights)):
        configured = str(Path(weights).resolve())
    try:
        path = resolve_tokenizer_path(configured, model_name, Path(task.base_dir))
    except UsageError:
        if configured:
            raise
        if vocab_size <= BYTE_EOS:
            raise UsageError("no tokenizer for this model and its vocabulary is too small for bytes (< 257)") from None
        if template:
            raise UsageError(f"--template {template} needs a tokenizer with the family's special tokens: set "
                             "`data: {tokenizer: FOLDER}` in the task or train from --weights FOLDER holding one") from None
        return ByteTokenizer()
    tokenizer = FileTokenizer(path, template, trusted)
    if tokenizer.vocab_size > vocab_size:
        raise UsageError(f"tokenizer {path} has {tokenizer.vocab_size} tokens, the model only {vocab_size}")
    return tokenizer


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()


def _source_files(source: DataSource, base: Path) -> list[tuple[Path, str]]:
    """The source's files and their file type: a file, a glob or a folder (trainer.data.sources reads
    paths the same way for `advisor data prepare`)."""
    try:
        file_type = file_type_of(base, source)
        return [(path, file_type) for path in expand_source_path(base, source.path, file_type)]
    except UsageError as exc:
        command = generate_command(base)
        raise UsageError(f"{exc} (generated data: `{command}` writes it)" if command else str(exc)) from None


def _documents(source: DataSource, base: Path, format: str, tokenizer) -> list[tuple[list[int], list[int]]]:
    """Every row of the source rendered: (token ids, labels), the source's loss rule applied."""
    names, rule = source.field_names(), LossRule.of(source)
    documents = []
    for path, file_type in _source_files(source, base):
        rows = read_rows(path, file_type)
        if format == "text":  # batch-encoded: continued pre-training reads much text
            texts, field = [], "text" if file_type == "text" else names["text"]
            for number, row in enumerate(rows):
                text = row.get(field)
                try:
                    refuse_media(row)
                except BadRow as exc:
                    raise UsageError(f"{row_location(path, file_type, number)}: {exc} ({format} format)") from None
                if not isinstance(text, str):  # missing, null, a number: a bad row, never the string "None"
                    raise UsageError(f"{row_location(path, file_type, number)}: field '{field}' is missing "
                                     "or not a string")
                texts.append(text)
            documents += [(ids + [tokenizer.eos_token_id],) * 2 for ids in tokenizer.encode_batch(texts)]
            continue
        for number, row in enumerate(rows):
            try:
                documents.append(render_example(row, format, tokenizer, names, rule))
            except BadRow as exc:
                raise UsageError(f"{row_location(path, file_type, number)}: {exc} ({format} format)") from None
    if source.val_size is not None:  # one side of the source's held-out split
        documents = [d for d, kept in zip(documents, split_mask(len(documents), source.val_size, source.split)) if kept]
    return documents


def read_answer_pairs(source: DataSource, base: Path, tokenizer, limit: int) -> list[tuple[list[int], list[int]]]:
    """Up to `limit` (prompt ids, reference answer ids) of a source's rows, in file order, rendered
    as training renders them (`formats.prompt_and_answer`: the answer is the last trained run, its
    end token included). Text rows have no answer to score and give none."""
    format = source_format(source, base)
    if format == "text" or limit <= 0:
        return []
    rows = [(row, path, file_type, number) for path, file_type in _source_files(source, base)
            for number, row in enumerate(read_rows(path, file_type))]
    if source.val_size is not None:  # one side of the source's held-out split, as training reads it
        rows = [r for r, kept in zip(rows, split_mask(len(rows), source.val_size, source.split)) if kept]
    pairs = []
    for row, path, file_type, number in rows[:limit]:
        try:
            pairs.append(prompt_and_answer(row, format, tokenizer, source.field_names()))
        except BadRow as exc:
            raise UsageError(f"{row_location(path, file_type, number)}: {exc} ({format} format)") from None
    return pairs


def _files_stamp(source: DataSource, base: Path) -> list[list]:
    """Each file of the source with its size and modification time: an edited file misses the cache."""
    stamps = []
    for path, _ in _source_files(source, base):
        st = os.stat(path)
        stamps.append([str(path), st.st_size, st.st_mtime_ns])
    return stamps


def load_rows(source: DataSource, task: TaskSpec, tokenizer, seq: int, cache: Path | None) -> Packed:
    """The source's rows of `seq` tokens with labels and positions. Text is packed as a stream
    (`pack_stream`); the supervised formats keep examples whole, several to a row (`pack_examples`).
    Every engine keeps packed documents apart (their position ids)."""
    base = Path(task.base_dir)
    # a source's mixture weight does not change its rows: a reweighted source reads the same cache
    key = hashlib.sha256(json.dumps([source.model_dump(mode="json", exclude={"weight"}), str(base), seq,
                                     tokenizer.name, _files_stamp(source, base), task.packing]).encode())
    cached = cache / f"{key.hexdigest()[:20]}.npz" if cache else None
    if cached and cached.is_file():
        with np.load(cached) as saved:
            counts = [int(saved[name]) if name in saved else 0 for name in ("truncated", "dropped")]
            return Packed(saved["ids"], saved["labels"], saved["positions"], *counts)
    format = source_format(source, base)
    documents = _documents(source, base, format, tokenizer)
    if format == "text" and task.packing:
        packed = pack_stream(documents, seq)
    else:  # supervised rows, or any row without packing: one example kept whole (or cut) per place
        packed = pack_examples(documents, seq, packing=task.packing)
    if cached:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.stem}.{os.getpid()}.npz")  # ranks may race to write it
        np.savez(tmp, ids=packed.ids, labels=packed.labels, positions=packed.positions, truncated=packed.truncated,
                 dropped=packed.dropped)
        tmp.replace(cached)
    return packed


def load_source(source: DataSource, task: TaskSpec, tokenizer, seq: int, cache: Path | None) -> np.ndarray:
    """The token ids of `load_rows`."""
    return load_rows(source, task, tokenizer, seq, cache).ids


def stage_sources(task: TaskSpec, index: int, tokenizer, seq: int, cache: Path | None) -> list[Source]:
    """The stage's own sources by weight, plus replayed earlier stages by their share of tokens."""
    stage: StageSpec = task.stages[index]
    own_share = 1.0 - sum(stage.replay.values())
    if own_share <= 0:
        raise UsageError(f"stage '{stage.name}': replay shares leave nothing for its own data")
    sources = []
    weight_total = sum(s.weight for s in stage.sources) or 1.0
    for src in stage.sources:
        sources.append(Source.of(f"{stage.name}:{src.path}", load_rows(src, task, tokenizer, seq, cache),
                                 own_share * src.weight / weight_total))
    for name, share in stage.replay.items():
        earlier = next(s for s in task.stages if s.name == name)
        total = sum(s.weight for s in earlier.sources) or 1.0
        for src in earlier.sources:
            sources.append(Source.of(f"{name}:{src.path}", load_rows(src, task, tokenizer, seq, cache),
                                     share * src.weight / total))
    if stage.ramp_steps and index > 0:
        _ramp_from(task.stages[index - 1], sources, lambda src: load_rows(src, task, tokenizer, seq, cache))
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
            by_name[name] = Source.of(name, load(src), 0.0)
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
