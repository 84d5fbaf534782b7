"""What the advisor runs from a folder it is given (issue 31): a model or tokenizer folder whose files name
Python code of their own (`auto_map`) is refused in one line before transformers reads it, unless the
user opts in with --trust-remote-code. With it, the folder's config and causal-LM classes are imported
and registered with transformers' Auto classes, so that every place that builds a model from its config
(the trace, the trainer, the dry run) builds the folder's own model."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from specs.errors import UsageError

TRUST_FLAG = "--trust-remote-code"
TRUST_HELP = ("run the Python code a model or tokenizer folder names (its auto_map), as transformers' "
              "trust_remote_code=True does: read that code first, it runs with your permissions")
# model_type -> the folder (resolved) whose code this process loaded for it (load_model_code): a model
# written from it gets that code beside its config.json (save_model_code)
_LOADED: dict[str, Path] = {}


def own_code(folder: Path, file: str) -> dict[str, Any] | None:
    """The `auto_map` of `folder/file` (the classes it names in its own Python files), or None."""
    path = folder / file
    try:
        auto_map = json.loads(path.read_text()).get("auto_map") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None  # a broken file is reported by whoever reads it properly
    return auto_map if isinstance(auto_map, dict) and auto_map else None


def refuse_remote_code(folder: Path, file: str, what: str, trusted: bool = False) -> bool:
    """One line and exit 2 where a model or tokenizer folder names Python code of its own (`auto_map`)
    and the user did not pass --trust-remote-code (transformers would otherwise ask "run the custom
    code?" on a console the training log hides). Whether the folder names code (then trusted)."""
    auto_map = own_code(folder, file)
    if auto_map and not trusted:
        raise UsageError(f"{what} {folder}: {file} names its own Python code (auto_map: "
                         f"{', '.join(sorted(auto_map))[:120]}); the advisor runs a folder's code only with "
                         f"{TRUST_FLAG} (read that code first: it runs with your permissions)")
    return auto_map is not None


def model_folder(source: str) -> Path | None:
    """The folder a model spec was read from (`ModelSpec.source`: a config.json path), None for a preset."""
    return Path(source).parent if source != "preset" else None


def check_model_code(hf_config: dict[str, Any], source: str, trusted: bool, what: str) -> Path | None:
    """The folder whose Python code a model config names (`auto_map`; None for a config without any),
    refused in one line without --trust-remote-code or where that folder no longer holds the code."""
    if not hf_config.get("auto_map"):
        return None
    folder = model_folder(source)
    if folder is None or own_code(folder, "config.json") is None:
        raise UsageError(f"{what}: its config names Python code of its own (auto_map) but was not read from a "
                         f"model folder that holds it ({source}); plan from that folder")
    refuse_remote_code(folder, "config.json", what, trusted)
    return folder


def ensure_model_code(hf_config: dict[str, Any], source: str, trusted: bool, what: str) -> None:
    """Before a model is built from `hf_config`: nothing for a config without code of its own; else refused
    in one line without --trust-remote-code, and with it the code of the folder it was read from loaded."""
    folder = check_model_code(hf_config, source, trusted, what)
    if folder is not None:
        load_model_code(folder)


def code_digest(hf_config: dict[str, Any], source: str) -> str:
    """A short digest of the Python files of the folder whose code `hf_config` names ("" for a config
    without any): what a cached result computed by that code is keyed by besides the config."""
    folder = model_folder(source)
    if not hf_config.get("auto_map") or folder is None:
        return ""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def code_loaded(hf_config: dict[str, Any], source: str) -> bool:
    """Whether this process loaded the code of the folder `hf_config` was read from: the verb that loaded
    it had the opt-in, and what it calls (the timed steps of calibration and verification, which build
    the model from a spec alone) builds the same model."""
    folder = model_folder(source)
    return folder is not None and _LOADED.get(str(hf_config.get("model_type"))) == folder.resolve()


def load_model_code(folder: Path) -> None:
    """Import the folder's config class and causal-LM class (its auto_map's AutoConfig and
    AutoModelForCausalLM) and register them with transformers' Auto classes under the config's model_type,
    so that `AutoConfig.for_model` and `AutoModelForCausalLM.from_config` build them in this process.
    Runs the folder's Python: call it only where the user passed --trust-remote-code. A model_type
    transformers ships is then this folder's in this process, as transformers' own trust_remote_code
    loads it (one CLI process plans or trains one model)."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: only for a folder with code
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    auto_map = own_code(folder, "config.json") or {}
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if "AutoModelForCausalLM" not in auto_map:
        raise UsageError(f"{TRUST_FLAG}: {folder}/config.json's auto_map names no AutoModelForCausalLM "
                         f"({', '.join(sorted(auto_map))}); the advisor trains causal language models")
    try:
        config_class = (get_class_from_dynamic_module(auto_map["AutoConfig"], str(folder), local_files_only=True)
                        if "AutoConfig" in auto_map else CONFIG_MAPPING[model_type])
        model_class = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(folder),
                                                    local_files_only=True)
        AutoConfig.register(model_type, config_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, model_class, exist_ok=True)
        _LOADED[model_type] = folder.resolve()
    except Exception as exc:  # the folder's code may raise anything while it is imported
        raise UsageError(f"{TRUST_FLAG}: the code {folder} names does not load: {type(exc).__name__}: {exc}") \
            from None


def save_model_code(config: Any, out: Path) -> None:
    """Beside a config.json written from a model whose config names code of its own (auto_map), the Python
    files that code is in, copied from the folder it was loaded from: the written model (a merged or full
    fine-tune, a stage's handoff) loads again, with --trust-remote-code, as transformers' own save does."""
    from transformers.dynamic_module_utils import get_relative_import_files

    auto_map = getattr(config, "auto_map", None)
    folder = _LOADED.get(getattr(config, "model_type", ""))
    if not auto_map or folder is None:
        return
    references = [r for value in auto_map.values() for r in (value if isinstance(value, (list, tuple)) else [value])]
    for reference in filter(None, references):
        file = folder / (reference.split("--")[-1].rsplit(".", 1)[0] + ".py")
        for path in [file, *map(Path, get_relative_import_files(str(file)))] if file.is_file() else []:
            shutil.copy2(path, out / path.name)
