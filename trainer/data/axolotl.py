"""An Axolotl config's `datasets:` list read as it ships: each entry a local source.

Each entry gives its `path` (a local file or folder: beside the config, else under the working
folder; told by its content, so `ds_type` is not needed) and its `type`:

- `alpaca`: instruction/input/output rows, rendered as LLaMA-Factory's alpaca rows (through the
  tokenizer's chat template when it has one), the output trained;
- `chat_template`: a list of messages under `field_messages` (default `messages`), each message's
  role and content under the keys `message_property_mappings` names (default `role` and `content`;
  the older `message_field_role` / `message_field_content` too), ShareGPT's role names (`human`,
  `gpt`, ...) known; the turns of `roles_to_train` (default `assistant`) are trained, each with its
  end-of-turn token (Axolotl's default `train_on_eos: turn`);
- `completion`: raw text under `field` (default `text`), every token trained.

The config's `train_on_inputs: true` trains the prompts too (LLaMA-Factory's train_on_prompt).
Other types, keys this reader does not honour and hub datasets are refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specs.errors import UsageError
from specs.core import read_user_yaml
from specs.task import DataSource
from trainer.data.registry import local_data, mapping

AXOLOTL_TYPES = ("alpaca", "chat_template", "completion")
ENTRY_KEYS = ("path", "type", "ds_type", "split", "field_messages", "message_property_mappings",
              "message_field_role", "message_field_content", "roles_to_train", "train_on_eos", "field",
              "chat_template")
ROLES = ("system", "user", "assistant", "tool")  # the roles messages have once read (roles_to_train names them)
CONFIG_SUFFIXES = (".yml", ".yaml")


def is_axolotl_config(path: Path) -> bool:
    """Whether `--data` names a YAML file (data files are never YAML: it is a config)."""
    return Path(path).is_file() and Path(path).suffix.lower() in CONFIG_SUFFIXES


def axolotl_sources(config: Path) -> list[DataSource]:
    """The sources of the config's `datasets:`, in order."""
    path = Path(config)
    try:
        settings = read_user_yaml(path, f"Axolotl config {path}")
    except FileNotFoundError:
        raise UsageError(f"Axolotl config {path} not found") from None
    entries = settings.get("datasets") if isinstance(settings, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"{path}: no `datasets:` list (an Axolotl config lists the data to train on there)")
    train_on_inputs = settings.get("train_on_inputs", False)
    if not isinstance(train_on_inputs, bool):
        raise UsageError(f"{path}: train_on_inputs is {train_on_inputs!r}, not true or false")
    folders = [path.resolve().parent, Path.cwd()]
    return [_source(entry, f"{path}: datasets entry {number}", folders, train_on_inputs)
            for number, entry in enumerate(entries, 1)]


def _source(entry: Any, where: str, folders: list[Path], train_on_inputs: bool) -> DataSource:
    if not isinstance(entry, dict):
        raise UsageError(f"{where} is {type(entry).__name__}, not a mapping")
    unknown = [key for key in entry if key not in ENTRY_KEYS]
    if unknown:
        raise UsageError(f"{where}: '{unknown[0]}' is not read here (read: {', '.join(ENTRY_KEYS)})")
    kind = entry.get("type")
    if kind not in AXOLOTL_TYPES:
        raise UsageError(f"{where}: type {kind!r} is not supported here (supported: {', '.join(AXOLOTL_TYPES)})")
    _refuse_other_behaviour(entry, where)
    if not isinstance(entry.get("path"), str):
        raise UsageError(f"{where}: no path (a local file or folder)")
    data = local_data(entry["path"], folders, where)
    if kind == "completion":
        field = entry.get("field") or "text"
        return DataSource(path=data, format="text", text_field=_name(field, "field", where))
    if kind == "alpaca":
        return DataSource(path=data, format="alpaca", train_on_prompt=train_on_inputs)
    return DataSource(path=data, format="sharegpt", fields=_message_fields(entry, where),
                      roles_to_train=_roles(entry.get("roles_to_train"), where), train_on_prompt=train_on_inputs)


def _refuse_other_behaviour(entry: dict[str, Any], where: str) -> None:
    """Keys whose other values would train something else than this trainer does."""
    if entry.get("split", "train") != "train":
        raise UsageError(f"{where}: split {entry['split']!r}: a local file is read whole (its train split)")
    if entry.get("train_on_eos", "turn") != "turn":
        raise UsageError(f"{where}: train_on_eos {entry['train_on_eos']!r}: each trained turn's end-of-turn "
                         "token is trained here (Axolotl's default, turn)")
    if entry.get("chat_template", "tokenizer_default") != "tokenizer_default":
        raise UsageError(f"{where}: chat_template {entry['chat_template']!r}: rows are rendered by the "
                         "tokenizer's own template here (tokenizer_default)")


def _message_fields(entry: dict[str, Any], where: str) -> dict[str, str]:
    """The sharegpt reader's field names for the messages' list, role and content keys."""
    properties = mapping(entry, "message_property_mappings", where)
    extra = sorted(set(properties) - {"role", "content"})
    if extra:
        raise UsageError(f"{where}: message_property_mappings maps {', '.join(extra)}; only role and content "
                         "are read here")
    role = properties.get("role", entry.get("message_field_role") or "role")
    content = properties.get("content", entry.get("message_field_content") or "content")
    messages = entry.get("field_messages") or "messages"
    return {"conversations": _name(messages, "field_messages", where), "from": _name(role, "role", where),
            "value": _name(content, "content", where)}


def _roles(value: Any, where: str) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or any(role not in ROLES for role in value):
        raise UsageError(f"{where}: roles_to_train should list some of {', '.join(ROLES)} (got {value!r})")
    return list(value)


def _name(value: Any, key: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise UsageError(f"{where}: {key} should name a field (got {value!r})")
    return value
