"""What kind of data a file or folder holds, told from its content rather than its name.

LLaMA-Factory and Axolotl ship `.json` files that are JSON arrays, people rename parquet files, and
a `datasets` `save_to_disk` folder is recognised by the files it writes. The kinds:

- ``json``: a JSON array of rows (first non-space character ``[``);
- ``jsonl``: JSON lines (first non-space character ``{``);
- ``parquet``: the ``PAR1`` magic; ``arrow``: an Arrow IPC file (``ARROW1``) or stream;
- ``csv``: a ``.csv`` name, or a first line that is a comma-separated header naming a row format's field;
- ``text``: anything else that is UTF-8 text (paragraphs separated by blank lines);
- ``hf_disk``: a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

SNIFF_BYTES = 64 * 1024  # enough for a CSV header line and past any leading blank space
PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_MARKER = b"\xff\xff\xff\xff"  # an IPC stream's first message starts with this continuation
UTF8_BOM = b"\xef\xbb\xbf"
# fields that name a row format (trainer/data/formats.py): a CSV header with one of them is data
FORMAT_FIELDS = {"text", "prompt", "completion", "instruction", "input", "output", "messages", "conversations",
                 "system", "question", "answer", "response", "query"}


def is_saved_dataset(folder: Path) -> bool:
    """Whether `folder` was written by `datasets`' save_to_disk (a Dataset or a DatasetDict)."""
    folder = Path(folder)
    return folder.is_dir() and ((folder / "dataset_dict.json").is_file()
                                or ((folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()))


def sniff_file_type(path: Path, fallback: str | None = None) -> str:
    """The kind of data in one file, from its first bytes. An empty or blank file is `fallback`
    (its extension's kind, for the caller to read and report), else JSON lines."""
    with open(path, "rb") as f:
        head = f.read(SNIFF_BYTES)
    if head.startswith(PARQUET_MAGIC):
        return "parquet"
    if head.startswith(ARROW_FILE_MAGIC) or head.startswith(ARROW_STREAM_MARKER):
        return "arrow"
    body = head[len(UTF8_BOM):] if head.startswith(UTF8_BOM) else head
    stripped = body.lstrip()
    if not stripped:
        return fallback or "jsonl"
    if stripped[:1] == b"[":
        return "json"
    if stripped[:1] == b"{":
        return "jsonl"
    if Path(path).name.lower().endswith(".csv") or _looks_like_csv_header(stripped):
        return "csv"
    if fallback in ("jsonl", "json"):
        return "jsonl"  # a .jsonl whose first line is damaged: read as JSON lines, which names the line
    return "text"


def json_layout(path: Path) -> str:
    """'array' when a JSON file holds one array of rows, else 'lines'."""
    try:
        return "array" if sniff_file_type(path) == "json" else "lines"
    except OSError:
        return "lines"


def _looks_like_csv_header(head: bytes) -> bool:
    """A first line of at least two comma-separated names, one of them a row format's field, and a
    second line with as many cells: prose rarely looks like that."""
    text = head.decode("utf-8", errors="replace")
    lines = text.splitlines()
    if len(lines) < 2:
        return False
    rows = list(csv.reader(io.StringIO("\n".join(lines[:2]))))
    if len(rows) < 2 or len(rows[0]) < 2:
        return False
    header = [cell.strip() for cell in rows[0]]
    return (all(cell.isidentifier() for cell in header) and bool(FORMAT_FIELDS & set(header))
            and len(rows[1]) == len(header))
