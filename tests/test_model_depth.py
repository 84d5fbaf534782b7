"""A config at another depth keeps its per-layer lists in step with its layer count (issue 32), and
the trace of a model whose layers differ adds up to the model."""

from __future__ import annotations

import pytest

from specs.errors import UsageError
from specs.model_depth import first_layers, layer_kinds, per_layer_keys, with_layers
from specs.core import ModelSpec
from profiler.model_trace import trace_model

# Gemma-2-like: sliding and full attention alternate; Laguna-like per-layer head counts; Qwen-MoE's
# dense-MLP layers by index; a Llama 3.1 list of end tokens as long as the model is deep
MIXED = {"model_type": "x", "num_hidden_layers": 3,
         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
         "num_attention_heads_per_layer": [4, 8, 4], "mlp_only_layers": [1], "eos_token_id": [7, 8, 9],
         "architectures": ["A", "B", "C"], "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 64}


def test_cut_keeps_every_per_layer_list_in_step() -> None:
    assert per_layer_keys(MIXED) == ["layer_types", "num_attention_heads_per_layer"]
    one = with_layers(MIXED, [1])
    assert one["num_hidden_layers"] == 1 and one["layer_types"] == ["full_attention"]
    assert one["num_attention_heads_per_layer"] == [8] and one["mlp_only_layers"] == [0]
    assert one["eos_token_id"] == [7, 8, 9] and one["architectures"] == ["A", "B", "C"] and one["hidden_size"] == 32
    two = first_layers(MIXED, 2)
    assert two["layer_types"] == ["sliding_attention", "full_attention"] and two["mlp_only_layers"] == [1]
    deeper = first_layers(MIXED, 5)  # the pattern repeats
    assert deeper["num_attention_heads_per_layer"] == [4, 8, 4, 4, 8] and deeper["mlp_only_layers"] == [1, 4]
    assert MIXED["num_hidden_layers"] == 3 and len(MIXED["layer_types"]) == 3  # the original is left alone
    with pytest.raises(UsageError, match="at least one decoder layer"):
        with_layers(MIXED, [])


def test_layer_kinds_most_common_first() -> None:
    assert layer_kinds(MIXED) == [(0, 2), (1, 1)]
    assert layer_kinds({"n_layer": 4}) == [(0, 4)]  # no per-layer lists: one kind (GPT-2's key)
    gemma3 = {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    assert layer_kinds(gemma3) == [(0, 5), (5, 1)]


def test_trace_of_mixed_layers_adds_up_to_the_model() -> None:
    """Gemma 2 at 3 layers (sliding, full, sliding), a window shorter than the sequence: the trace
    cuts its layer_types with the count (transformers refuses them apart), traces both kinds, and the
    model's parameters are the real model's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {"model_type": "gemma2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64,
           "max_position_embeddings": 64, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    with torch.device("meta"):
        real = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), attn_implementation="eager")
    trace = trace_model(ModelSpec(name="gemma2-mixed", hf_config=cfg), 16, dtype="fp32", device_type="cpu",
                        use_disk_cache=False)
    assert trace.params == sum(p.numel() for p in real.parameters())
    assert trace.num_layers == 3 and any("2 kinds" in note for note in trace.notes)


def test_layers_of_several_kinds_are_each_traced_and_weighted(monkeypatch) -> None:
    """The layer block is the mean of the kinds by their counts, the rest what the one-layer model
    holds besides its layer: the model's total is the sum of its layers and its rest, whatever kind
    of layer the shallow copies were built of (traces stood in by a model of 100 parameters outside
    the layers and 10, 30, 10 in its three)."""
    import profiler.model_trace as model_trace

    sizes = {0: 10.0, 1: 30.0, 2: 10.0}  # layer 1 has twice the heads (MIXED)
    built = []

    def fake_trace(cfg, layers, *args, **kwargs):
        built.append(list(layers))
        assert with_layers(MIXED, layers) == with_layers(cfg, layers)
        return model_trace.BlockTrace(params=100 + sum(sizes[i] for i in layers), fwd_flops=len(layers)), 0, 0

    monkeypatch.setattr(model_trace, "_trace_once", fake_trace)
    layer, rest = model_trace._layer_and_rest(MIXED, 16, "fp32", "full", 16, "sdpa", False, False)
    assert built == [[0], [0, 0], [0, 1]]  # one layer of the common kind, then one of each kind after it
    assert rest.params == 100 and 3 * layer.params == pytest.approx(50)
    assert layer.fwd_flops == 1 and rest.fwd_flops == 0
