"""LLaMA-Factory's dataset registry (`dataset_info.json`) read as it ships: named datasets as sources.

An entry names a local `file_name` (a file or folder beside the registry), its `formatting`
(`alpaca`, the default, or `sharegpt`), the `columns` that hold each part and, for sharegpt, the
`tags` that name the roles. They map onto a source's row format and field names
(trainer/data/formats.py):

- alpaca: prompt -> instruction, query -> input, response -> output, system, history, tools;
- sharegpt: messages -> conversations, system, tools; role_tag -> from, content_tag -> value, and the
  user, assistant, system, function and observation tags.

Entries this trainer cannot honour are refused in one line: datasets fetched from a hub or by a
script (nothing is downloaded here), preference data (`ranking`, KTO tags), and images, videos or
audios columns (training is text-only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specs.errors import UsageError
from specs.task import DataSource

REGISTRY_NAME = "dataset_info.json"
COLUMNS = {
    "alpaca": {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
               "history": "history", "tools": "tools"},
    "sharegpt": {"messages": "conversations", "system": "system", "tools": "tools"},
}
TAGS = {"role_tag": "from", "content_tag": "value", "user_tag": "user_tag", "assistant_tag": "assistant_tag",
        "system_tag": "system_tag", "function_tag": "function_tag", "observation_tag": "observation_tag"}
MEDIA_COLUMNS = ("images", "videos", "audios")
REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
PREFERENCE_COLUMNS = ("chosen", "rejected", "kto_tag")


def registry_sources(registry: Path, names: list[str]) -> list[DataSource]:
    """The sources of the datasets `names` in the registry file `registry` (or the folder holding
    it), in order, each reading its file as the entry says."""
    path = Path(registry)
    path = path / REGISTRY_NAME if path.is_dir() else path
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UsageError(f"cannot read the dataset registry {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"dataset registry {path}: not valid JSON ({exc})") from None
    if not isinstance(entries, dict):
        raise UsageError(f"dataset registry {path}: expected an object of named datasets")
    if not names:
        raise UsageError(f"name the datasets of {path} to train on (it has: {', '.join(entries) or 'none'})")
    sources = []
    for name in names:
        if name not in entries:
            raise UsageError(f"dataset '{name}' is not in {path} (it has: {', '.join(entries) or 'none'})")
        sources.append(_source(name, entries[name], path.parent))
    return sources


def _source(name: str, entry: Any, folder: Path) -> DataSource:
    where = f"dataset '{name}'"
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: its entry is {type(entry).__name__}, not an object")
    remote = [key for key in REMOTE_KEYS if entry.get(key)]
    if remote and not entry.get("file_name"):
        raise UsageError(f"{where} is fetched by LLaMA-Factory ({remote[0]}); nothing is downloaded here: save "
                         "it locally and register its file_name")
    if not isinstance(entry.get("file_name"), str):
        raise UsageError(f"{where}: no file_name")
    columns = mapping(entry, "columns", where)
    tags = mapping(entry, "tags", where)
    if entry.get("ranking") or any(columns.get(key) for key in PREFERENCE_COLUMNS) or tags.get("kto_tag"):
        raise UsageError(f"{where} is preference data (ranking, chosen/rejected or KTO tags): this trainer "
                         "fine-tunes on answers only")
    media = [key for key in MEDIA_COLUMNS if columns.get(key)]
    if media:
        raise UsageError(f"{where} has an {media[0]} column ('{columns[media[0]]}'): training here is text-only")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in COLUMNS:
        raise UsageError(f"{where}: formatting '{formatting}' (known: {', '.join(COLUMNS)})")
    fields = _fields(formatting, columns, tags, where)
    path = local_data(entry["file_name"], [folder], where)
    return DataSource(path=path, format=formatting, fields=fields)  # type: ignore[arg-type]


def local_data(name: str, folders: list[Path], where: str) -> str:
    """The absolute path of the local file or folder `name`, sought in `folders` in order (an
    absolute `name` as it is); a UsageError where none has it: nothing is downloaded here."""
    for folder in folders:
        path = Path(folder) / name
        if path.exists():
            return str(path.resolve())
    sought = " or ".join(str(Path(folder) / name) for folder in folders)
    raise UsageError(f"{where}: {sought} not found (nothing is downloaded here: save the data locally)")


def mapping(entry: dict[str, Any], key: str, where: str) -> dict[str, str]:
    """The object under `key` of a dataset's entry (none: empty), its null values dropped."""
    value = entry.get(key) or {}
    if not isinstance(value, dict):
        raise UsageError(f"{where}: '{key}' is {type(value).__name__}, not an object")
    return {k: v for k, v in value.items() if v is not None}


def _fields(formatting: str, columns: dict[str, str], tags: dict[str, str], where: str) -> dict[str, str]:
    """The source's field names: each given column under the name our format gives that part."""
    known = COLUMNS[formatting]
    unknown = sorted(set(columns) - set(known) - set(MEDIA_COLUMNS))
    if unknown:
        raise UsageError(f"{where}: {formatting} columns {', '.join(unknown)} are not read here "
                         f"(known: {', '.join(known)})")
    fields = {known[part]: column for part, column in columns.items()}
    if formatting == "sharegpt":
        fields.update({TAGS[tag]: value for tag, value in tags.items() if tag in TAGS})
    elif tags:
        raise UsageError(f"{where}: tags apply to sharegpt formatting, not {formatting}")
    return fields
