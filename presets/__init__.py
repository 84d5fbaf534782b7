"""Preset data shipped with the package: hardware, model configs and tasks, as YAML files.

Loaders resolve the CLI's `--model`/`--hardware`/`--task` arguments: a preset name, or a path (an HF
`config.json` or model folder for models; a `profile.json` for hardware; a task YAML). They only
read and validate, through the file formats of `advisor/`.

A task preset ships no data files: the demo's are generated on first use (trainer/data/demo_corpus.py,
called by the CLI verbs that read them) into the cache folder its loaded task points at.
"""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from specs import environment
from specs.errors import UsageError
from specs.profile import fingerprint_mismatch, looks_like_profile, profile_from_data
from specs.remote_code import ensure_model_code
from specs.core import HardwareSpec, ModelSpec, parse_user_yaml, validate
from specs.task import TaskSpec, read_task_file

PRESETS_DIR = Path(__file__).resolve().parent
KINDS = ("hardware", "models", "tasks")
# Task presets whose data is generated (same seed, same files), not shipped: name -> the command that
# writes it into a folder. `load_task(name)` points the task at `generated_data_dir(name)`.
GENERATED_TASK_DATA = {"demo": "advisor data generate-demo"}


def cache_dir() -> Path:
    """What advisor can remake lives here (traces, profiles, generated task data, compiled native
    ops): `$ADVISOR_CACHE`, else ~/.cache/advisor. Every layer reads it from here."""
    return Path(environment.read("ADVISOR_CACHE") or Path.home() / ".cache" / "advisor")


def generated_data_dir(name: str) -> Path:
    """Where a task preset's generated data goes: its sources' relative paths start here."""
    return cache_dir() / "tasks" / name


def preset_names(kind: str) -> list[str]:
    if kind not in KINDS:
        raise UsageError(f"unknown preset kind '{kind}'; allowed: {', '.join(KINDS)}")
    return sorted(p.stem for p in (PRESETS_DIR / kind).glob("*.yaml"))


@lru_cache(maxsize=None)
def _read_yaml(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a YAML mapping")
    return data


def _is_file(path: Path) -> bool:
    """Whether a name the user gave is a file; a name the filesystem cannot hold (too long) is none."""
    try:
        return path.is_file()
    except OSError:
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def preset_data(kind: str, name: str) -> dict[str, Any]:
    path = PRESETS_DIR / kind / f"{name}.yaml"
    if not _is_file(path):
        raise UsageError(f"unknown {kind} preset '{name}'; available: {', '.join(preset_names(kind))}")
    return dict(_read_yaml(path))


def load_hardware(ref: str) -> HardwareSpec:
    """A hardware preset name, or a path to a JSON/YAML file with the HardwareSpec schema."""
    path = Path(ref)
    if ref.endswith((".json", ".yaml", ".yml")) or _is_file(path):
        if not _is_file(path):
            raise UsageError(f"hardware file not found: {ref}")
        return load_hardware_file(path)
    return validate(HardwareSpec, preset_data("hardware", ref), f"hardware preset '{ref}'")


def load_hardware_file(path: Path) -> HardwareSpec:
    """A HardwareSpec file, or a `profile.json` from `advisor profile` (it has `version` and
    `hardware` keys): that one loads through its versioned schema, and warns on stderr when it
    was measured on another machine."""
    try:
        text = path.read_text()
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise UsageError(f"cannot read hardware file {path}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else parse_user_yaml(text, f"hardware file {path}")
    except ValueError as exc:
        raise UsageError(f"hardware file {path} is corrupt or truncated: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"hardware file {path}: expected a mapping")
    if looks_like_profile(data):
        profile = profile_from_data(data, path)
        warning = fingerprint_mismatch(profile)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        return profile.hardware
    return validate(HardwareSpec, data, f"hardware file {path}")


def load_model(ref: str, trusted: bool = False) -> ModelSpec:
    """A model preset name, an HF `config.json`, or a local model folder holding one. A config naming
    Python code of its own (`auto_map`) is refused in one line unless `trusted` (--trust-remote-code),
    which loads that code (specs.remote_code): the trace builds the folder's own model."""
    path = Path(ref)
    if _is_dir(path):
        path = path / "config.json"
        if not _is_file(path):
            raise UsageError(f"model folder {ref} has no config.json")
    if _is_file(path):
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read model config {path}: {exc}") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise UsageError(f"{path} is not a Hugging Face config.json (no 'model_type')")
        spec = validate(ModelSpec, {"name": path.parent.name if path.name == "config.json" else path.stem,
                                    "hf_config": config, "source": str(path)}, f"model config {path}")
        ensure_model_code(spec.hf_config, spec.source, trusted, "--model")
        return spec
    if ref.endswith(".json") or "/" in ref:
        raise UsageError(f"model config not found: {ref}")
    data = preset_data("models", ref)
    return validate(ModelSpec, {"name": ref, "hf_config": data["hf_config"]}, f"model preset '{ref}'")


def task_finding(name: str) -> str | None:
    """A measured finding about a task preset's curriculum, one sentence, where a bench wrote one
    (bench/curriculum.py: presets/findings/<name>.json, `finding` null when there is nothing to say)."""
    path = PRESETS_DIR / "findings" / f"{name}.json"
    try:
        finding = json.loads(path.read_text()).get("finding")
    except (OSError, ValueError, AttributeError):
        return None
    return finding if isinstance(finding, str) and finding else None


def pricing_band(engine: str) -> dict[str, float] | None:
    """How far the cost model's throughput for `engine` (ours, megatron) fell from published runs:
    rows, median and 90th-percentile |error| (bench/published_bench.py writes
    presets/findings/published_runs.json); None where no bench has written one."""
    path = PRESETS_DIR / "findings" / "published_runs.json"
    try:
        band = json.loads(path.read_text())["engines"][engine]
        return {key: float(band[key]) for key in ("rows", "median", "p90")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_task(ref: str) -> TaskSpec:
    """A task preset name (e.g. `demo`) or a path to a task YAML. A preset with generated data reads
    it from its cache folder (`generated_data_dir`), whether or not it is written yet."""
    path = Path(ref)
    if _is_file(path):
        return read_task_file(path)
    if ref.endswith((".yaml", ".yml")) or "/" in ref:
        raise UsageError(f"task file not found: {ref}")
    if ref not in preset_names("tasks"):
        raise UsageError(f"unknown task preset '{ref}'; available: {', '.join(preset_names('tasks'))}")
    task = read_task_file(PRESETS_DIR / "tasks" / f"{ref}.yaml")
    if ref in GENERATED_TASK_DATA:
        task = task.model_copy(update={"base_dir": str(generated_data_dir(ref))})
    return task
