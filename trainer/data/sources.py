"""Reading a task's data sources: local files, one at a time, so that every problem names the file and the row.

A source's file type is its `file_type`, else told from the content of a single file or from the
extensions of a folder's or glob's files (trainer/data/sniff.py): JSON lines and JSON arrays are read
with the standard library (a JSON array streamed element by element, trainer/data/json_array.py;
`json` and `jsonl` files are told apart by their first character whichever is declared), text as
blank-line-separated paragraphs, parquet, arrow and CSV files and `save_to_disk` folders through
`datasets` (streamed, or memory-mapped for a saved dataset). When `datasets` fails on a line-based
file (jsonl, text), the file is rescanned line by line to find the first bad line and say what is
wrong with it: not UTF-8 (mixed encodings), not JSON, not an object.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from specs.errors import UsageError
from trainer.data.json_array import JsonArrayColumns, read_json_array
from trainer.data.sniff import is_saved_dataset, json_layout, sniff_file_type

EXTENSIONS = {"jsonl": (".jsonl", ".json"), "json": (".json", ".jsonl"), "parquet": (".parquet",),
              "text": (".txt", ".text"), "arrow": (".arrow",), "csv": (".csv",)}
_BUILDER = {"jsonl": "json", "json": "json", "parquet": "parquet", "text": "text", "arrow": "arrow", "csv": "csv"}
_HINT_BYTES = 64 << 20  # a damaged JSON file up to this size is read whole to explain the error
SAVED_DATASET = "hf_disk"  # a `save_to_disk` folder: memory-mapped by `datasets.load_from_disk`


@dataclass
class RowBatch:
    """A batch of rows of one file: texts, 0-based row numbers, and the extra fields asked for."""

    texts: list[str]
    first_row: int
    fields: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.texts)


def expand_source_path(base_dir: Path, pattern: str, fmt: str) -> list[Path]:
    """A file, a glob or a folder (its files of the format's extensions), relative to base_dir."""
    raw = Path(pattern)
    path = raw if raw.is_absolute() else base_dir / raw
    if fmt == SAVED_DATASET:
        if not is_saved_dataset(path):
            raise UsageError(f"data source '{pattern}': {path} is not a `save_to_disk` folder")
        return [path]
    if any(ch in pattern for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise UsageError(f"data source '{pattern}': no file matches {path}")
        return files
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(EXTENSIONS[fmt]))
        if not files:
            raise UsageError(f"data source '{pattern}': folder {path} has no {'/'.join(EXTENSIONS[fmt])} files")
        return files
    if not path.exists():
        raise UsageError(f"data source not found: {path}")
    if not os.access(path, os.R_OK):
        raise UsageError(f"data source {path}: not readable (permissions)")
    return [path]


def file_type_of(base_dir: Path, source: Any) -> str:
    """A source's file type: its `file_type`; else a single file's from its content and a
    `save_to_disk` folder's from its files; else from the extensions of the files a folder or glob
    names (one kind of file). A path that is not there yet reads as JSON lines, or as text under
    the text row format (what `format` defaulted to before)."""
    if source.file_type:
        return source.file_type
    raw = Path(source.path)
    path = raw if raw.is_absolute() else base_dir / raw
    if any(ch in source.path for ch in "*?["):
        files = [Path(p) for p in glob.glob(str(path), recursive=True)]
    elif is_saved_dataset(path):
        return SAVED_DATASET
    elif path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()]
    elif path.is_file() and os.access(path, os.R_OK):
        return sniff_file_type(path, fallback=_kind(path.name) or ("text" if source.format == "text" else None))
    else:
        files = [path]
    kinds = {_kind(f.name) for f in files} - {None}
    if len(kinds) > 1:
        raise UsageError(f"data source '{source.path}' mixes {' and '.join(sorted(kinds))} files: "  # type: ignore[arg-type]
                         "set its file_type or point it at one kind")
    if kinds:
        return kinds.pop()  # type: ignore[return-value]
    return "text" if path.is_file() and source.format == "text" else "jsonl"


def _kind(name: str) -> str | None:
    for kind in ("jsonl", "parquet", "arrow", "text", "csv"):  # .json: array or lines, by content
        if name.endswith(EXTENSIONS[kind]):
            return kind
    return None


def read_rows(path: Path, fmt: str) -> Iterator[dict[str, Any]]:
    """Every row of one file as a dict, in order: JSON lines or a JSON array (told apart by the
    content), a columnar file or saved dataset through `datasets`, or a text file's
    blank-line-separated paragraphs as {"text": ...}. Unreadable rows stop with a UsageError that
    names the file and the line."""
    if fmt not in ("jsonl", "json", "text"):
        try:
            yield from _dataset_rows(path, fmt)
        except UsageError:
            raise
        except Exception as exc:  # pyarrow and datasets raise their own types
            raise UsageError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
        return
    try:
        if fmt != "text" and json_layout(path) == "array":
            yield from read_json_array(path)
            return
        if fmt == "text":
            yield from ({"text": p} for p in Path(path).read_text(encoding="utf-8").split("\n\n") if p.strip())
            return
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    raise UsageError(_diagnose(path, fmt) or f"{path}, line {line_no}: not valid JSON") from None
                if not isinstance(row, dict):
                    raise UsageError(f"{path}, line {line_no}: expected a JSON object, got {type(row).__name__}")
                yield row
    except UnicodeDecodeError as exc:
        raise UsageError(_diagnose(path, fmt) or f"{path}: not UTF-8 ({exc})") from None


def _dataset_rows(path: Path, fmt: str) -> Iterator[dict[str, Any]]:
    for batch in _dataset_stream(path, fmt).iter(batch_size=1000):
        columns = list(batch)
        count = len(batch[columns[0]]) if columns else 0
        yield from ({name: batch[name][i] for name in columns} for i in range(count))


def _dataset_stream(path: Path, fmt: str, **kwargs: Any) -> Any:
    """The file or saved folder as a dataset that iterates in batches of columns: streamed from a
    file, memory-mapped from a `save_to_disk` folder (its `train` split, or its only one)."""
    if fmt in ("json", "jsonl") and json_layout(path) == "array":
        return JsonArrayColumns(path)  # streamed here: `datasets` would load the whole array
    datasets = _quiet_datasets()
    if fmt == "csv":  # every cell is text, an empty one too: no numbers or nulls guessed from the values
        with open(path, encoding="utf-8-sig", newline="") as f:
            columns = next(csv.reader(f), [])
        kwargs.update(features=datasets.Features({name: datasets.Value("string") for name in columns}),
                      keep_default_na=False)
    if fmt != SAVED_DATASET:
        return datasets.load_dataset(_BUILDER[fmt], data_files=str(path), split="train", streaming=True, **kwargs)
    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.DatasetDict):
        splits = list(saved)
        if "train" not in saved and len(splits) != 1:
            raise UsageError(f"{path}: a saved dataset with splits {', '.join(splits)} and none named 'train': "
                             "point the source at one split's folder")
        saved = saved["train"] if "train" in saved else saved[splits[0]]
    return saved


def _quiet_datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing is fetched: local files only
    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def read_batches(path: Path, fmt: str, text_field: str, extra_fields: tuple[str, ...] = (),
                 batch_size: int = 1000) -> Iterator[RowBatch]:
    """Stream one file in batches; stop with a UsageError that names the file and the row."""
    kwargs: dict[str, Any] = {}
    if fmt == "text":
        kwargs["keep_linebreaks"] = False
    try:
        stream = _dataset_stream(path, fmt, **kwargs)
        rows_seen = 0
        for batch in stream.iter(batch_size=batch_size):
            row_batch = _row_batch(path, fmt, batch, rows_seen, text_field, extra_fields)
            yield row_batch
            rows_seen += len(row_batch)
    except UsageError:
        raise
    except UnicodeDecodeError as exc:
        raise UsageError(_diagnose(path, fmt) or f"{path}: not UTF-8 ({exc})") from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(_diagnose(path, fmt) or f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # pyarrow and datasets raise their own types
        raise UsageError(_diagnose(path, fmt) or f"cannot read {path}: {type(exc).__name__}: {exc}") from None


def _row_batch(path: Path, fmt: str, batch: dict[str, list[Any]], first_row: int, text_field: str,
               extra_fields: tuple[str, ...]) -> RowBatch:
    """Columns of one batch as a RowBatch, every text checked (present, a string)."""
    column_field = "text" if fmt == "text" else text_field
    n = len(next(iter(batch.values()))) if batch else 0
    texts = batch.get(column_field)
    if texts is None:
        raise UsageError(f"{row_location(path, fmt, first_row)}: no field '{text_field}' "
                         f"(fields: {', '.join(sorted(batch)) or 'none'})")
    for i, text in enumerate(texts):
        if text is None:  # `datasets` reads a missing field as null too
            raise UsageError(f"{row_location(path, fmt, first_row + i)}: no field '{text_field}' (or it is null)")
        if not isinstance(text, str):
            raise UsageError(f"{row_location(path, fmt, first_row + i)}: field '{text_field}' is "
                             f"{type(text).__name__}, not a string")
    extras = {name: batch.get(name, [None] * n) for name in extra_fields}
    return RowBatch(texts=texts, first_row=first_row, fields=extras)


def line_offsets(path: Path, every: int) -> tuple[int, list[int]]:
    """(rows, byte offset of rows 0, every, 2*every, ...) of a JSON-lines file, where a row is a
    line holding more than white space (what the JSON-lines reader counts): where a range of rows
    starts, so that a worker reads its rows without reading the ones before."""
    rows, offsets, position = 0, [], 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                if rows % every == 0:
                    offsets.append(position)
                rows += 1
            position += len(line)
    return rows, offsets


def read_line_range(path: Path, fmt: str, text_field: str, extra_fields: tuple[str, ...], batch_size: int,
                    byte_range: tuple[int, int], first_row: int) -> Iterator[RowBatch]:
    """The rows of a JSON-lines file between two byte offsets (row boundaries from `line_offsets`),
    in batches, parsed by pyarrow's JSON reader as `datasets` parses the whole file."""
    import pyarrow.json as pa_json

    start, stop = byte_range
    with open(path, "rb") as f:
        f.seek(start)
        raw = f.read(stop - start)
    try:
        # one block for the whole range: a row is never cut at a block boundary
        table = pa_json.read_json(io.BytesIO(raw), read_options=pa_json.ReadOptions(block_size=max(len(raw), 1 << 16)))
    except Exception as exc:  # pyarrow raises its own types
        problem = _diagnose(path, fmt) or _range_problem(path, fmt, raw, first_row, text_field)
        raise UsageError(problem or f"cannot read {path} (rows {first_row + 1} on): {type(exc).__name__}: {exc}") from None
    for lo in range(0, table.num_rows, batch_size):
        yield _row_batch(path, fmt, table.slice(lo, batch_size).to_pydict(), first_row + lo, text_field, extra_fields)


def _range_problem(path: Path, fmt: str, raw: bytes, first_row: int, text_field: str) -> str | None:
    """The first row of a range whose text field is missing or not a string (what makes pyarrow's
    reader fail on a column's type), named by its line in the file; None when every text is one."""
    rows = [json.loads(line) for line in raw.splitlines() if line.strip()]
    try:
        _row_batch(path, fmt, {text_field: [row.get(text_field) for row in rows]}, first_row, text_field, ())
    except UsageError as exc:
        return str(exc)
    return None


def row_location(path: Path, fmt: str, row: int) -> str:
    """'file, line L (row R)' for line-based files, 'file, row R' for others; rows count from 1."""
    if fmt in ("jsonl", "json") and json_layout(path) == "array":
        return f"{path}, row {row + 1}"
    if fmt in ("jsonl", "json", "text"):
        line = _line_of_row(path, row, skip_blank=fmt != "text")
        if line is not None:
            return f"{path}, line {line} (row {row + 1})"
    return f"{path}, row {row + 1}"


def _line_of_row(path: Path, row: int, skip_blank: bool) -> int | None:
    try:
        with open(path, "rb") as f:
            seen = -1
            for number, line in enumerate(f, 1):
                if skip_blank and not line.strip():
                    continue
                seen += 1
                if seen == row:
                    return number
    except OSError:
        return None
    return None


def _diagnose(path: Path, fmt: str) -> str | None:
    """Find the first bad line of a line-based file and say what is wrong with it."""
    if fmt not in ("jsonl", "text", "json"):
        return None
    if fmt == "jsonl" and json_layout(path) == "array":
        fmt = "json"  # its lines are not rows: only their encoding is checked here
    try:
        with open(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    return (f"{path}, line {number}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                            f"{exc.start + 1}); the file mixes encodings: convert it to UTF-8, e.g. "
                            f"`iconv -f latin1 -t utf-8`")
                if fmt != "jsonl" or not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    return _one_object_hint(path) or (f"{path}, line {number}: not valid JSON ({exc.msg} at "
                                                      f"column {exc.colno})")
                if not isinstance(value, dict):
                    return f"{path}, line {number}: expected a JSON object, got {type(value).__name__}"
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    return None


def _one_object_hint(path: Path) -> str | None:
    """What to say of a file that is one JSON object over several lines rather than JSON lines (a
    pretty-printed row, or rows under a key): read whole, only to explain the error, when small."""
    try:
        if Path(path).stat().st_size > _HINT_BYTES:
            return None
        value = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return None
    if not isinstance(value, dict):
        return None
    keys = [k for k, v in value.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)]
    fix = (f"its rows seem to be the list under '{keys[0]}': write that list as the file (a JSON array) or as "
           "JSON lines" if keys else "write one object per line (JSON lines) or a JSON array of objects")
    return f"{path}: one JSON object spread over several lines, not JSON lines; {fix}"
