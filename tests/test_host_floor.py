"""The host floor (planner/host_floor.py): the kernels and bytes a trace counts are what an eager
step launches and moves, and a GPU step is priced as the larger of its device and host time per kind
of kernel, while a CPU keeps its calibrated rule."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specs.core import ModelSpec, resolve_layout
from planner.cost_model import estimate
from presets import load_hardware
from profiler.model_trace import trace_model

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu"}
SEQ = 32


class _Launches(TorchDispatchMode):
    """Kernels of a real eager step, counted without the trace's machinery: no fake tensors, no meta
    model, no layer difference; views and torch's `prim` queries launch nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.moved = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (func.is_view or func.namespace == "prim" or name in ("_unsafe_view", "detach", "alias")):
            self.ops += 1
        return out


def _real_step_ops(layers: int) -> tuple[int, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**TINY, "num_hidden_layers": layers})
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    ids = torch.randint(0, TINY["vocab_size"], (1, SEQ))
    forward, backward = _Launches(), _Launches()
    with forward:
        loss = model(input_ids=ids, labels=ids).loss
    with backward:
        loss.backward()
    return forward.ops, backward.ops


def test_the_trace_counts_the_kernels_a_real_eager_step_launches() -> None:
    trace = trace_model(ModelSpec(name="tiny-ops", hf_config=TINY), SEQ, dtype="fp32", device_type="cpu",
                        use_disk_cache=False)
    one, two = _real_step_ops(1), _real_step_ops(2)
    assert trace.layer.fwd_ops == two[0] - one[0]
    assert trace.layer.bwd_ops == two[1] - one[1]
    # a Llama layer: 7 projections and the attention kernel forward, twice the projections backward
    assert trace.layer.fwd_dense_ops == 8 and trace.layer.bwd_dense_ops == 15
    assert trace.layer.fwd_traffic_bytes > 0 and trace.layer.bwd_traffic_bytes > trace.layer.fwd_traffic_bytes


def test_a_gpu_step_is_at_least_its_launches_and_a_cpu_step_has_no_floor() -> None:
    model = ModelSpec(name="tiny-ops", hf_config=TINY)
    h200 = load_hardware("h200-141g")
    layout = resolve_layout(f"mbs=1,gas=1,seq={SEQ}", 1, h200)
    trace = trace_model(model, SEQ, dtype="bf16", device_type="cuda")
    kernels = 3 * (trace.autocast.layer.fwd_ops + trace.autocast.layer.bwd_ops)
    priced = estimate(model, h200, layout).time.compute_s
    # a tiny model's kernels are all shorter than a launch: the step is its launches
    assert priced >= kernels * h200.efficiency.host_op_s
    assert priced == pytest.approx(
        estimate(model, h200.model_copy(update={"efficiency": h200.efficiency.model_copy(
            update={"host_op_s": 2 * h200.efficiency.host_op_s})}), layout).time.compute_s / 2, rel=0.05)
    cpu = load_hardware("cpu")
    assert cpu.efficiency.host_op_s == 0  # a CPU prices its host in its calibrated rates
