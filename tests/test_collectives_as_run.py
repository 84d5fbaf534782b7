"""The collectives the cost model prices are the ones the trainer's engines run, counted on 2 ranks.

Tensor parallelism: one micro-batch of the sharded engine, its process group's collectives counted
with torch.profiler, against `planner.comm_time.tp_collectives`. The process group's own ops are
counted, not the functional collectives above them: under selective recomputation torch's
caching dispatch mode records a functional call twice (33 all-reduces where gloo ran 24).

DeepSpeed ZeRO-1: after its step each rank all-gathers the weight partitions the others updated,
the whole model's weights, as the cost model's data-parallel term prices (`gradient_comm`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specs.core import Layout, ModelSpec
from planner import collectives
from planner.comm_time import tp_collectives
from planner.cost_model import estimate_from_trace
from presets import load_hardware
from profiler.model_trace import trace_model
from test_trainer import CONFIG

LAYERS = 3
MODEL = {**CONFIG, "num_hidden_layers": LAYERS}
LAYOUTS = {
    "tp": Layout(tp=2, mbs=1, seq=16, dtype="fp32"),
    "tp_full_recompute": Layout(tp=2, mbs=1, seq=16, dtype="fp32", recompute="full"),
    "tp_selective_recompute": Layout(tp=2, mbs=1, seq=16, dtype="fp32", recompute="selective"),
    "tp_sp": Layout(tp=2, sp=True, mbs=1, seq=16, dtype="fp32"),
    "tp_sp_full_recompute": Layout(tp=2, sp=True, mbs=1, seq=16, dtype="fp32", recompute="full"),
}
# the process group's ops (gloo's) behind DTensor's all-reduce, all-gather and reduce-scatter
COLLECTIVES = {"all_reduce": "c10d::allreduce_", "all_gather": "c10d::allgather_into_tensor_coalesced_",
               "reduce_scatter": "c10d::reduce_scatter_tensor_coalesced_"}


def _count_collectives(rank: int, port: int, out_dir: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from profiler.ranks import finish_rank, init_rank
    from trainer.engines import make_engine
    from trainer.model import build_model

    init_rank(rank, 2, port, distributed=True, threads=1)
    counts = {}
    for name, layout in LAYOUTS.items():
        engine = make_engine(build_model(ModelSpec(name="tiny", hf_config=MODEL), layout, seed=0), layout, None,
                             clip=1.0)
        ids = torch.randint(0, MODEL["vocab_size"], (layout.mbs, layout.seq), generator=torch.Generator().manual_seed(0))
        engine.micro_step(ids)  # warm-up: lazy set-up outside the count
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.micro_step(ids)
        events = {e.key: e.count for e in prof.key_averages()}
        counts[name] = {op: events[key] for op, key in COLLECTIVES.items() if events.get(key)}
        engine.optimizer_step(0.0)
        del engine
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(counts))
    finish_rank(True)


@pytest.mark.slow
def test_the_tensor_parallel_collectives_of_a_micro_batch_are_the_ones_priced(tmp_path) -> None:
    import torch.distributed.tensor.parallel  # noqa: F401  (imported before forking)

    from profiler.ranks import free_port, launch

    launch(_count_collectives, 2, (free_port(), str(tmp_path)))
    for rank in range(2):
        counts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        print("FIGURES", counts)
        for name, layout in LAYOUTS.items():
            recomputed = LAYERS if layout.recompute != "none" else 0
            assert counts[name] == tp_collectives(layout, "fsdp2", LAYERS, recomputed, first=True, last=True), name
    # the trainer's HF projections: 2 forward and 5 backward per Llama layer, where Megatron's
    # fused q/k/v and gate/up run 4
    assert tp_collectives(LAYOUTS["tp"], "fsdp2", LAYERS, 0, True, True) == {"all_reduce": 7 * LAYERS}
    assert tp_collectives(LAYOUTS["tp"], "megatron", LAYERS, 0, True, True) == {"all_reduce": 4 * LAYERS + 2}


ZERO1 = Layout(dp=2, zero=1, mbs=1, seq=16, dtype="fp32")


def _gathered_bytes(rank: int, port: int, out_dir: str) -> None:
    """Bytes DeepSpeed's ZeRO-1 step all-gathers (every all-gather's output, counted where
    DeepSpeed's communication backend calls torch.distributed)."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from planner.export import deepspeed_config
    from profiler.ranks import finish_rank, init_rank
    from trainer.engines import make_engine
    from trainer.model import build_model

    init_rank(rank, 2, port, distributed=True, threads=1)
    gathered = [0]
    for name in ("all_gather_into_tensor", "all_gather"):
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            output = args[0] if args else kwargs.get("output_tensor", kwargs.get("tensor_list"))
            outputs = output if isinstance(output, list) else [output]
            gathered[0] += sum(t.numel() * t.element_size() for t in outputs)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    spec = ModelSpec(name="tiny", hf_config=MODEL)
    config = deepspeed_config(SimpleNamespace(model=spec, hardware=load_hardware("cpu")), ZERO1)
    engine = make_engine(build_model(spec, ZERO1, seed=0), ZERO1, config, clip=1.0)
    ids = torch.randint(0, MODEL["vocab_size"], (ZERO1.mbs, ZERO1.seq), generator=torch.Generator().manual_seed(0))
    engine.micro_step(ids)
    engine.optimizer_step(1e-3)
    before = gathered[0]
    engine.micro_step(ids)
    engine.optimizer_step(1e-3)
    Path(out_dir, f"ds{rank}.json").write_text(json.dumps({"step": gathered[0] - before}))
    del engine
    finish_rank(True)


@pytest.mark.slow
def test_deepspeed_zero1_all_gathers_the_weights_after_its_step_as_priced(tmp_path) -> None:
    import deepspeed  # noqa: F401  (imported before forking)

    from profiler.ranks import free_port, launch

    launch(_gathered_bytes, 2, (free_port(), str(tmp_path)))
    trace = trace_model(ModelSpec(name="tiny", hf_config=MODEL), ZERO1.seq, "fp32", device_type="cpu")
    weights = 4 * trace.params  # fp32
    for rank in range(2):
        ran = json.loads((tmp_path / f"ds{rank}.json").read_text())["step"]
        print("FIGURES gathered", ran, "weights", weights)
        assert ran == pytest.approx(weights, rel=0.01)
    # and the cost model prices that gather: ZeRO-1 on DeepSpeed costs one all-gather of the
    # weights more than the same reduction under DDP
    cpu = load_hardware("cpu")
    ddp, zero1 = (estimate_from_trace(trace, layout, cpu, engine).time.dp_comm_s
                  for layout, engine in ((ZERO1.model_copy(update={"zero": 0}), "plain"), (ZERO1, "deepspeed")))
    assert zero1 - ddp == pytest.approx(collectives.all_gather_s(weights, 2, cpu, False), rel=1e-9)
