"""Which attention a family's model can run: the one asked for, or eager where it has no SDPA path.

Gemma 2 caps its attention logits (soft-capping), which PyTorch's SDPA kernel cannot do, so its
transformers model refuses `attn_implementation="sdpa"` at construction. The trainer, its dry run
and the trace all build through here, so that the trace measures the attention that trains (eager
saves the s x s scores; the cost model then prices them).
"""

from __future__ import annotations

from typing import Any

SDPA, EAGER = "sdpa", "eager"


def runnable_attention(config: Any, wanted: str) -> str:
    """`wanted`, unless it is SDPA and the config's causal-LM class declares no SDPA support: eager."""
    if wanted != SDPA:
        return wanted
    from transformers import AutoModelForCausalLM  # deferred: heavy, callers import it already

    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return wanted  # not a mapped causal LM: transformers itself says what is wrong when it builds
    return wanted if getattr(model_class, "_supports_sdpa", True) else EAGER
