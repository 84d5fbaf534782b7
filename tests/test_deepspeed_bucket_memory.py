"""DeepSpeed ZeRO-1/2's gradient bucket in backward, measured on the trainer's engine (2 ranks).

DeepSpeed sets its bucket up as the first gradient arrives (`setup_buckets`, from its gradient
hook), once the loss's buffers are freed and while every activation is still alive. With a small
vocabulary the loss's buffers are smaller than the bucket, and that moment is the step's peak: the
cost model priced `advisor run`'s demo (ZeRO-1, mbs 8) 13% low before it counted the bucket there.
The live bytes just after the bucket is set up, above the model states held before the step, are
counted with the CPU allocator counter (profiler/tensor_memory.py) against the cost model's moment
(`StageMemory.first_gradient` on top of the activations)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specs.core import Layout, ModelSpec
from planner.cost_model import stage_memory
from presets import load_hardware
from profiler.model_trace import trace_model

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
LAYOUTS = {zero: Layout(dp=2, zero=zero, mbs=4, seq=128, dtype="fp32") for zero in (1, 2)}


def _bucket_moment(rank: int, port: int, out_dir: str) -> None:
    from types import SimpleNamespace

    import torch

    from planner.export import deepspeed_config
    from profiler.ranks import finish_rank, init_rank
    from profiler.tensor_memory import TensorMemory
    from trainer.engines import make_engine
    from trainer.model import build_model

    init_rank(rank, 2, port, distributed=True, threads=1)
    memory = TensorMemory(torch.device("cpu"))
    spec = ModelSpec(name="small-vocab", hf_config=MODEL)
    readings = {}
    for zero, layout in LAYOUTS.items():
        config = deepspeed_config(SimpleNamespace(model=spec, hardware=load_hardware("cpu")), layout)
        engine = make_engine(build_model(spec, layout, seed=0), layout, config, clip=1.0)
        optimizer = engine.engine.optimizer
        setup = optimizer.setup_buckets
        seen: dict[str, int] = {}

        def counted_setup(_setup=setup, _optimizer=optimizer, _seen=seen) -> None:
            first = not _optimizer.ready_for_gradients
            _setup()
            if first:
                _seen["after_setup"] = memory.live()

        optimizer.setup_buckets = counted_setup
        ids = torch.randint(0, MODEL["vocab_size"], (layout.mbs, layout.seq), generator=torch.Generator().manual_seed(0))
        for _ in range(2):  # the second step has the optimizer's states, as every later one
            seen.clear()
            static = memory.live()  # weights and optimizer states (and what an earlier engine left)
            memory.reset_peak()
            engine.micro_step(ids)
            backward_peak = memory.peak()
            engine.optimizer_step(1e-3)
        readings[zero] = {"after_setup": seen["after_setup"] - static, "backward_peak": backward_peak - static}
        del engine, optimizer
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(readings))
    finish_rank(True)


@pytest.mark.slow
def test_the_bucket_set_up_in_backward_is_priced(tmp_path) -> None:
    import deepspeed  # noqa: F401  (imported before forking)

    from profiler.ranks import free_port, launch

    launch(_bucket_moment, 2, (free_port(), str(tmp_path)))
    readings = json.loads((tmp_path / "rank0.json").read_text())
    for zero, layout in LAYOUTS.items():
        measured = readings[str(zero)]
        trace = trace_model(ModelSpec(name="small-vocab", hf_config=MODEL), layout.seq, "fp32", device_type="cpu")
        stage = stage_memory(trace, layout, load_hardware("cpu"), 0, trace.num_layers, 0, engine="deepspeed")
        states = stage.weights + stage.optimizer
        moment = stage.resident_gradients + stage.activations + stage.first_gradient
        print("FIGURES zero", zero, "above the states: after setup", measured["after_setup"], "priced", round(moment),
              "backward peak", measured["backward_peak"], "priced peak", round(stage.peak - states))
        # the moment itself, and the peak it makes: above the loss's buffers here
        assert stage.first_gradient > stage.logits
        assert moment == pytest.approx(measured["after_setup"], rel=0.03)
        assert stage.peak - states == pytest.approx(measured["backward_peak"], rel=0.08)
