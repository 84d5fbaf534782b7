"""Rows of a file that is one JSON array of objects, streamed: the array is never held whole.

LLaMA-Factory's and Axolotl's shipped datasets (`alpaca_en_demo.json`, `identity.json`, ...) are
JSON arrays. The file is read in chunks and each element decoded as soon as it is complete, so
memory holds one chunk and the row being decoded; a single row larger than MAX_ROW_CHARS is
refused rather than buffered without bound. Errors name the file and the line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import IO, Any, Iterator

from specs.errors import UsageError

CHUNK_CHARS = 1 << 20
MAX_ROW_CHARS = 256 << 20  # one row bigger than this is not training data
_WHITESPACE = re.compile(r"[ \t\r\n]*")  # JSON's white space


class _ArrayReader:
    """A window over the file: `buffer[pos:]` is unread, `line` the line `pos` is on."""

    def __init__(self, path: Path, f: IO[str]):
        self.path, self.f = path, f
        self.buffer, self.pos, self.line, self.eof = "", 0, 1, False
        self.decoder = json.JSONDecoder()

    def more(self) -> bool:
        """Read the next chunk, dropping what was consumed; False at the end of the file."""
        if self.eof:
            return False
        chunk = self.f.read(CHUNK_CHARS)
        self.line += self.buffer.count("\n", 0, self.pos)
        self.buffer, self.pos = self.buffer[self.pos:] + chunk, 0
        self.eof = not chunk
        return bool(chunk)

    def next_char(self) -> str:
        """The next character that is not white space (not consumed); '' at the end of the file."""
        while True:
            self.pos = _WHITESPACE.match(self.buffer, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.buffer) or not self.more():
                return self.buffer[self.pos:self.pos + 1]

    def where(self) -> str:
        return f"{self.path}, line {self.line + self.buffer.count(chr(10), 0, self.pos)}"

    def value(self) -> Any:
        """Decode the value at `pos`, reading more of the file until it is complete."""
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buffer, self.pos)
            except json.JSONDecodeError as exc:
                if len(self.buffer) - self.pos > MAX_ROW_CHARS:
                    raise UsageError(f"{self.where()}: a row of more than {MAX_ROW_CHARS >> 20} MiB of JSON; "
                                     "split it or write the data as JSON lines") from None
                if self.more():
                    continue
                line = self.line + self.buffer.count("\n", 0, exc.pos)
                raise UsageError(f"{self.path}, line {line}: not valid JSON in the array ({exc.msg})") from None
            self.pos = end
            return value


def read_json_array(path: Path) -> Iterator[dict[str, Any]]:
    """Each object of the JSON array in `path`, in order."""
    with open(path, encoding="utf-8-sig") as f:
        reader = _ArrayReader(Path(path), f)
        if reader.next_char() != "[":
            raise UsageError(f"{path}: not a JSON array (it does not start with '[')")
        reader.pos += 1
        number = 0
        while True:
            char = reader.next_char()
            if char == "]":
                reader.pos += 1
                break
            if number:
                if char != ",":
                    raise UsageError(f"{reader.where()}: expected ',' or ']' after row {number} of the array")
                reader.pos += 1
                char = reader.next_char()
            if not char:
                raise UsageError(f"{path}: the JSON array is not closed (the file ends after row {number})")
            row = reader.value()
            number += 1
            if not isinstance(row, dict):
                raise UsageError(f"{path}, row {number}: expected a JSON object, got {type(row).__name__}")
            yield row
        if reader.next_char():
            raise UsageError(f"{reader.where()}: more data after the JSON array's closing ']'")


class JsonArrayColumns:
    """A JSON array file iterated as `datasets` iterates one: batches of columns, a field missing
    from a row read as None (what `advisor data prepare` reads, trainer/data/sources.py)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def iter(self, batch_size: int) -> Iterator[dict[str, list[Any]]]:
        rows: list[dict[str, Any]] = []
        for row in read_json_array(self.path):
            rows.append(row)
            if len(rows) == batch_size:
                yield _columns(rows)
                rows = []
        if rows:
            yield _columns(rows)


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    names = list(dict.fromkeys(name for row in rows for name in row))
    return {name: [row.get(name) for row in rows] for name in names}
