"""The host's time per launched op (`Efficiency.host_op_s`), measured where it binds.

An eager training step pays, for every op it launches, Python, autograd, the dispatcher and the
launch itself; a GPU whose kernels are shorter than that waits for the host between them
(planner/host_floor.py: a 1.1B Llama's step at micro-batch 1 on an H200 took 70 ms where its FLOPs
take 20). A decoder of tiny width makes every kernel short, so the wall time of its training step is
its host time: that time over the ops the step launches is the host's time per op. The ops are
counted by the trace's own kernel log (`profiler.model_trace.kernel_log`), so the measured time per
op and the ops the cost model multiplies it by are the same ops.

The step runs as the trainer's bf16 engines run one on a GPU: fp32 weights, forward and loss under
bf16 autocast, backward (specs.capabilities `precision`); elsewhere in fp32. A CPU records the
figure but prices none of it: there the host is the device, and its calibrated rates hold that time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from profiler.hardware_bench import Repeater, warmed
from profiler.model_trace import kernel_log

# A Llama decoder (grouped-query attention, SwiGLU, RMSNorm: what current models run) so narrow that
# each of its kernels lasts a few microseconds on any GPU, and long enough (2 layers, 64 tokens) that
# the per-layer ops outnumber the embedding's and the loss's.
HOST_OP_CONFIG: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
}
HOST_OP_SEQ = 64
SAMPLE_S = 0.02  # seconds per timed sample: tens of steps of about a millisecond each


def tiny_decoder(device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**HOST_OP_CONFIG)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device).train()


def training_step(model: torch.nn.Module, device: torch.device) -> Callable[[], None]:
    """One micro-batch as the trainer runs it on `device`: forward and loss (under bf16 autocast on a
    GPU), backward; the gradients are dropped (set to None, which launches nothing) after each."""
    ids = torch.randint(0, HOST_OP_CONFIG["vocab_size"], (1, HOST_OP_SEQ), device=device)
    cast = (torch.autocast(device_type="cuda", dtype=torch.bfloat16) if device.type == "cuda"
            else contextlib.nullcontext())

    def step() -> None:
        with cast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
    return step


def launched_ops(step: Callable[[], None]) -> int:
    """The ops one call of `step` launches, as the trace counts them (views and metadata ops: none)."""
    log = kernel_log()
    with log:
        step()
    fields = log.fields()
    return int(fields["fwd_ops"] + fields["bwd_ops"])


def bench_host_op(device: torch.device, budget_s: float) -> dict[str, Any]:
    """The median warm step of the tiny decoder over the ops it launches: seconds per op."""
    threads = torch.get_num_threads()
    # one thread: the host's work per op is one thread's (Python, autograd, dispatch), and a tiny CPU
    # kernel split over threads that another process holds waited 60x longer here (0.23 s a step, not 4 ms)
    torch.set_num_threads(1)
    try:
        model = tiny_decoder(device)
        step = training_step(model, device)
        step()  # kernels loaded, allocator warm, autograd's graph machinery set up
        ops = launched_ops(step)
        timing = Repeater(budget_s=budget_s).run(warmed(step, device, target_s=SAMPLE_S))
    finally:
        torch.set_num_threads(threads)
    return {"ops": ops, "step_s": timing.median_s, "host_op_s": timing.median_s / ops, **timing.__dict__}
