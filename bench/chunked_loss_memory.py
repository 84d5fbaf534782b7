"""The loss's memory with HF's loss and with the trainer's chunked loss (trainer/chunked_loss.py) at
real vocabularies: the measured peak of one forward and backward (the CPU allocator counter,
profiler/tensor_memory.py) against planner/memory.py's backward-start prediction (plain engine; HF's
loss priced as the engines that keep it run it). One decoder layer, hidden 256, mbs 1, seq 1024.

    python -m bench.chunked_loss_memory
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from specs.core import Layout, ModelSpec
from planner.cost_model import stage_memory
from presets import load_hardware
from profiler.model_trace import trace_model
from profiler.tensor_memory import TensorMemory
from trainer.chunked_loss import install_chunked_loss
from trainer.engines.base import autocast_forward
from trainer.model import build_filled_model
from specs.capabilities import LOSS_CHUNK_TOKENS
from benchmarks_md import write_section  # noqa: E402

VOCABULARIES = (32000, 128256)


def _config(vocab: int) -> dict:
    return {"model_type": "llama", "vocab_size": vocab, "hidden_size": 256, "intermediate_size": 688,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
            "max_position_embeddings": 2048, "tie_word_embeddings": False}


def measured(layout: Layout, config: dict, memory: TensorMemory, chunked: bool) -> int:
    """Peak bytes of the second forward and backward above what was live before it."""
    model = build_filled_model(ModelSpec(name="loss", hf_config=config), layout, seed=0)
    if chunked:
        install_chunked_loss(model)
    autocast_forward(model, layout, "plain")  # bf16 runs as the plain engine runs it: fp32 weights under autocast
    ids = torch.randint(0, config["vocab_size"], (layout.mbs, layout.seq), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        base = memory.live()
        memory.reset_peak()
        model(input_ids=ids, labels=ids).loss.backward()
    return memory.peak() - base


def predicted(layout: Layout, config: dict, chunked: bool) -> float:
    trace = trace_model(ModelSpec(name="loss", hf_config=config), layout.seq, layout.dtype, device_type="cpu")
    # HF's loss (`loss=hf`), as the pipeline engine, sequence parallelism and a user's own script run it
    priced = layout if chunked else layout.model_copy(update={"loss": "hf"})
    stage = stage_memory(trace, priced, load_hardware("cpu"), 0, 1, 0, engine="plain")
    return stage.activations + stage.transient


def main() -> None:
    memory = TensorMemory(torch.device("cpu"))
    lines = ["| vocabulary | dtype | HF's loss: measured MiB | predicted | error | chunked: measured MiB | predicted "
             "| error |", "|---|---|---|---|---|---|---|---|"]
    for vocab in VOCABULARIES:
        for dtype in ("fp32", "bf16"):
            layout, config = Layout(mbs=1, seq=1024, dtype=dtype), _config(vocab)
            cells = []
            for chunked in (False, True):
                got, want = measured(layout, config, memory, chunked), predicted(layout, config, chunked)
                cells.append(f"{got / 2**20:.1f} | {want / 2**20:.1f} | {want / got - 1:+.1%}")
            lines.append(f"| {vocab:,} | {dtype} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    body = "\n".join(lines) + (
        "\n\nOne forward and backward of a 1-layer Llama (hidden 256, mbs 1, seq 1024, full fine-tuning); the "
        "peak is the CPU allocator counter's, the prediction planner/memory.py's for the plain engine. The "
        f"chunked loss computes the head and the cross-entropy {LOSS_CHUNK_TOKENS} tokens at a time and "
        "recomputes each chunk's logits in backward (trainer/chunked_loss.py), so one chunk's fp32 logits live "
        "at once instead of three logits-sized fp32 buffers of the whole micro-batch.")
    write_section("chunked_loss_memory", "The loss at real vocabularies: HF's loss against the chunked loss "
                  "(this CPU)", "python -m bench.chunked_loss_memory", body)


if __name__ == "__main__":
    main()
