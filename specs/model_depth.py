"""A Hugging Face config at another depth: the layer count and every per-layer list cut together.

Current families describe each decoder layer in lists as long as the model is deep: `layer_types`
(Qwen2/3, Gemma 2/3, Mistral variants: sliding or full attention), `mlp_layer_types`, per-layer head
counts, no-RoPE flags. transformers 5 refuses a config whose layer count and lists disagree, so the
trace (two shallow copies of the model), calibration (a few real layers) and the curriculum's proxy
must shorten the lists with the count. Pure dict work: no transformers import.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from specs.errors import UsageError

LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
# top-level lists that may happen to be as long as the model is deep without describing its layers
_NOT_PER_LAYER = {"architectures"}
# lists of layer indices rather than one entry per layer (Qwen2-MoE / Qwen3-MoE: dense-MLP layers)
_LAYER_INDEX_LISTS = ("mlp_only_layers",)


def layer_count_key(cfg: dict[str, Any]) -> str:
    """The key that holds the decoder layer count in this config."""
    for key in LAYER_COUNT_KEYS:
        if key in cfg:
            return key
    raise UsageError(f"model config of type {cfg.get('model_type')} names no layer count")


def per_layer_keys(cfg: dict[str, Any]) -> list[str]:
    """The top-level lists with one entry per decoder layer (token-id lists are never per layer)."""
    layers = int(cfg[layer_count_key(cfg)])
    return sorted(key for key, value in cfg.items()
                  if isinstance(value, list) and len(value) == layers and layers > 1
                  and key not in _NOT_PER_LAYER and not key.endswith("_token_id"))


def _layer_signature(cfg: dict[str, Any], keys: list[str], index: int) -> str:
    """What layer `index` is made of: its entry in every per-layer list and index list."""
    entries = {key: cfg[key][index] for key in keys}
    entries.update({key: index in (cfg.get(key) or []) for key in _LAYER_INDEX_LISTS})
    return json.dumps(entries, sort_keys=True)


def layer_kinds(cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """The distinct kinds of decoder layer as (index of its first layer, how many layers), the most
    common first (ties: the earlier first). A model without per-layer lists has one kind."""
    layers = int(cfg[layer_count_key(cfg)])
    keys = per_layer_keys(cfg)
    signatures = [_layer_signature(cfg, keys, i) for i in range(layers)]
    counts = Counter(signatures)
    firsts = {signature: signatures.index(signature) for signature in counts}
    return sorted(((firsts[s], n) for s, n in counts.items()), key=lambda kind: (-kind[1], kind[0]))


def with_layers(cfg: dict[str, Any], source_layers: list[int]) -> dict[str, Any]:
    """`cfg` as a model of len(source_layers) decoder layers, layer i built like layer
    source_layers[i] of the original (indices past its depth wrap around: a deeper copy repeats the
    pattern)."""
    if not source_layers:
        raise UsageError("a model needs at least one decoder layer")
    out = dict(cfg)
    key = layer_count_key(cfg)
    depth = int(cfg[key])
    picked = [index % depth for index in source_layers]
    for name in per_layer_keys(cfg):
        out[name] = [cfg[name][index] for index in picked]
    for name in _LAYER_INDEX_LISTS:
        if isinstance(cfg.get(name), list):
            out[name] = [new for new, old in enumerate(picked) if old in cfg[name]]
    out[key] = len(picked)
    return out


def first_layers(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    """`cfg` cut (or repeated) to its first `layers` decoder layers."""
    return with_layers(cfg, list(range(layers)))
