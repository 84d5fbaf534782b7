"""No code from a folder the advisor is given (issue 31): model and tokenizer folders whose files name
Python code of their own are refused before transformers reads them."""

from __future__ import annotations

import json
from pathlib import Path

from advisor.errors import UsageError


def refuse_remote_code(folder: Path, file: str, what: str) -> None:
    """One line and exit 2 where a model or tokenizer folder names Python code of its own (`auto_map`):
    the advisor runs no code from a folder it is given (transformers would ask "run the custom code?"
    on a console the training log hides, and a yes would run the folder's Python)."""
    path = folder / file
    try:
        auto_map = json.loads(path.read_text()).get("auto_map") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return  # a broken file is reported by whoever reads it properly
    if auto_map:
        raise UsageError(f"{what} {folder}: {file} names its own Python code (auto_map: "
                         f"{', '.join(sorted(auto_map))[:120]}); the advisor runs no code from a model folder, "
                         "use a model transformers ships")
