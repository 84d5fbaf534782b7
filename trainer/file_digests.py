"""Content digests of the files a run reads (data, weights, tokenizer), for its fingerprint
(trainer/run_identity.py).

A file's size and modification time say nothing about its content (a prepared folder rewritten in
place, weights replaced by a fine-tune of the same shape), and change when nothing else does (a copy
to another disk). So the fingerprint holds content digests. Hashing reads every byte (about a second a
GB), so the digests of a run are kept in its run.json with the size and time they were read at, and a
file that still has both is not read again.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CHUNK = 1 << 20


class FileDigests:
    """sha256 digests of files by path, reusing `known` ones (path: [size, mtime_ns, digest]) whose file
    still has that size and time; `known` holds every digest taken, to be saved with the run."""

    def __init__(self, known: dict[str, Any] | None = None):
        self.known: dict[str, list[Any]] = {k: v for k, v in (known or {}).items()
                                            if isinstance(v, list) and len(v) == 3}

    def of_file(self, path: Path) -> str:
        key, stat = str(path.resolve()), path.stat()
        seen = self.known.get(key)
        if seen is not None and seen[:2] == [stat.st_size, stat.st_mtime_ns]:
            return seen[2]
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(CHUNK):
                digest.update(block)
        self.known[key] = [stat.st_size, stat.st_mtime_ns, digest.hexdigest()]
        return digest.hexdigest()

    def of_folder(self, folder: Path) -> str:
        """One digest of a folder's files, by their paths inside it and their contents (hidden files,
        which tools leave as caches, do not count)."""
        files = sorted(p for p in folder.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(folder).parts))
        return combined([[str(p.relative_to(folder)), self.of_file(p)] for p in files])

    def of_path(self, path: Path) -> str:
        return self.of_folder(path) if path.is_dir() else self.of_file(path)


def combined(parts: Any) -> str:
    """One short digest of a JSON-able value of digests."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
