"""What one device of a pipeline stage holds: its parameters (after tensor parallelism, with the
embedding and the head on the first and last stages), the trainable ones, and the engine that runs
the layout. Shared by the cost model's memory, compute and communication terms."""

from __future__ import annotations


from specs.capabilities import ENGINE_CHOICES, engine_for
from specs.layout_rules import ModelShape
from specs.core import (
                        Layout,
                        )
from planner.memory import (
    vocab_shards,
)
from profiler.model_trace import ModelTrace


def model_shape(trace: ModelTrace) -> ModelShape:
    return ModelShape(num_heads=trace.num_heads, num_kv_heads=trace.num_kv_heads,
                      intermediate_size=trace.intermediate_size, num_layers=trace.num_layers,
                      tied_embeddings=trace.head.params < trace.vocab_size * trace.hidden_size)


def stage_params(trace: ModelTrace, layers: int, first: bool, last: bool, pp: int, tp: int = 1,
                  vocab: int = 1) -> tuple[float, float, float]:
    """(params, trainable, quantizable) on one device of a stage, before ZeRO: the decoder layers
    divided by `tp`, the embedding and head by `vocab` (`vocab_shards`)."""
    params = layers * trace.layer.params / tp
    trainable = layers * trace.layer.trainable_params / tp
    # QLoRA quantises the decoder's linear weights; norms (2 vectors per layer) stay in 16 bits.
    quantizable = layers * max(trace.layer.params - trace.layer.trainable_params - 2 * trace.hidden_size, 0) / tp
    if first:
        params += trace.embedding.params / vocab
        trainable += trace.embedding.trainable_params / vocab
    if last:
        params += trace.head.params / vocab
        trainable += trace.head.trainable_params / vocab
        tied = trace.head.params < trace.vocab_size * trace.hidden_size
        if tied and pp > 1:  # Megatron keeps a copy of a tied embedding on the last stage
            params += trace.embedding.params / vocab
            trainable += trace.embedding.trainable_params / vocab
    return params, trainable, quantizable


def adapted_linears_per_layer(trace: ModelTrace) -> int:
    """Linear layers of one decoder layer that LoRA adapts (and QLoRA quantises), from the trace:
    a rank-r adapter on an (in, out) linear adds r(in + out) parameters. The attention's q, k, v
    and o projections are four of them (Llama, Mistral, Qwen2); the rest are MLP matrices of
    hidden x intermediate (two, or three when gated). GPT-2's fused q/k/v reads as 6 instead of 4:
    two tensors' constants, a few KiB."""
    hidden, heads = trace.hidden_size, trace.head_dim * trace.num_heads
    kv = trace.head_dim * trace.num_kv_heads
    attention = (hidden + heads) + 2 * (hidden + kv) + (heads + hidden)
    mlp = trace.layer.trainable_params / max(trace.lora_rank, 1) - attention
    return 4 + max(round(mlp / (hidden + trace.intermediate_size)), 0)


def device_params(trace: ModelTrace, layout: Layout, engine: str, layers: int,
                  stage: int) -> tuple[float, float, float]:
    """(params, trainable, quantizable) one device of pipeline stage `stage` holds, after tensor
    parallelism and before ZeRO, as `engine` splits them."""
    return stage_params(trace, layers, stage == 0, stage == layout.pp - 1, layout.pp, layout.tp,
                         vocab_shards(layout, engine))


def engine_of(layout: Layout, engine: str = "auto") -> str:
    """The engine that runs `layout`: `engine` is the plan's choice (auto, deepspeed, fsdp2; see
    specs.capabilities.engine_for) or already an engine's name."""
    return engine_for(layout, engine) if engine in ENGINE_CHOICES else engine
