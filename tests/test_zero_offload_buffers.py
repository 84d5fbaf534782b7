"""DeepSpeed ZeRO-1/2's device buffers as the cost model prices them (planner/zero_buffers.py),
against DeepSpeed's own optimizer built by the trainer on this CPU from the config we export.

One rank (dp=1: the buffers exist at every dp, issue 29), bf16, the GPU's config (`overlap_comm`,
optimizer offload) and the CPU's: the reduce buckets DeepSpeed sets up (`setup_buckets`), the offload
staging buffer (`temp_grad_buffer_for_gpu_offload`) and the largest transient of handing one gradient
to the host (`copy_grads_in_partition`: its fp64 norm copy), each read off DeepSpeed's objects or
counted with the CPU allocator counter (profiler/tensor_memory.py), equal to the priced bytes. A
bucket narrower than the LM head (as 5e7 elements are for TinyLlama's 65.5M-element head) checks that
such a gradient is kept apart from the buckets while it is normed, as `_first_reduce_bytes` prices."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from specs.core import Layout, ModelSpec
from planner.zero_buffers import NORM_COPY_BYTES, ZeroSettings, largest_trainable_elems, zero_buffers, zero_settings
from profiler.model_trace import ModelTrace, trace_model

MODEL = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 128,
         "tie_word_embeddings": False}
SPEC = ModelSpec(name="zero-buffers", hf_config=MODEL)
NARROW_BUCKET = 200_000  # elements: below the head's 2048 x 128 = 262,144
# name: (layout, the device type whose exported config runs, a bucket narrower than the head's gradient)
CASES = {
    "zero2-offload-gpu-config": (Layout(dp=1, zero=2, offload="optimizer", mbs=2, seq=64, dtype="bf16"), "cuda", False),
    "zero1-offload-gpu-config": (Layout(dp=1, zero=1, offload="optimizer", mbs=2, seq=64, dtype="bf16"), "cuda", False),
    "zero2-cpu-config": (Layout(dp=1, zero=2, mbs=2, seq=64, dtype="bf16"), "cpu", False),
    "zero2-offload-narrow-bucket": (Layout(dp=1, zero=2, offload="optimizer", mbs=2, seq=64, dtype="bf16"), "cuda", True),
}


def _settings(trace: ModelTrace, layout: Layout, device_type: str, narrow: bool) -> ZeroSettings:
    settings = zero_settings(trace, layout, device_type)
    return dataclasses.replace(settings, bucket_elems=NARROW_BUCKET) if narrow else settings


def _trace(layout: Layout) -> ModelTrace:
    return trace_model(SPEC, layout.seq, layout.dtype, device_type="cpu")


def _read_buffers(rank: int, port: int, out_dir: str) -> None:
    """Build each case's engine, run two steps, and record DeepSpeed's buffers and transients."""
    import torch

    from planner.export import model_deepspeed_config
    from profiler.ranks import finish_rank, init_rank
    from profiler.tensor_memory import TensorMemory
    from trainer.engines import make_engine
    from trainer.model import build_model

    init_rank(rank, 1, port, distributed=True, threads=1)
    memory = TensorMemory(torch.device("cpu"))
    readings = {}
    for name, (layout, device_type, narrow) in CASES.items():
        config = model_deepspeed_config(SPEC, device_type, layout)
        bucket = _settings(_trace(layout), layout, device_type, narrow).bucket_elems
        config["zero_optimization"].update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
        engine = make_engine(build_model(SPEC, layout, seed=0), layout, config, clip=1.0)
        readings[name] = _two_steps(engine, layout, memory)
        del engine
    Path(out_dir, "readings.json").write_text(json.dumps(readings))
    finish_rank(True)


def _two_steps(engine, layout: Layout, memory) -> dict:
    """DeepSpeed's buffers over two steps (the second has the optimizer's states, as every later one)."""
    import torch

    optimizer = engine.engine.optimizer
    staging = getattr(optimizer, "temp_grad_buffer_for_gpu_offload", None)
    reading: dict = {"staging": 0 if staging is None else staging.numel() * staging.element_size(), "copies": []}
    setup, copy = optimizer.setup_buckets, optimizer.copy_grads_in_partition

    def counted_setup() -> None:
        first = not optimizer.ready_for_gradients
        setup()
        if first:
            reading["buckets"] = sum(buffer.numel() * buffer.element_size()
                                     for bucket in optimizer.ipg_buckets.values() for buffer in bucket.buffer)

    def counted_copy(param, group_idx=None) -> None:
        bucket_storages = {buffer.untyped_storage().data_ptr()
                           for bucket in optimizer.ipg_buckets.values() for buffer in bucket.buffer}
        in_bucket = param.grad is not None and param.grad.untyped_storage().data_ptr() in bucket_storages
        before = memory.live()
        memory.reset_peak()
        copy(param, group_idx)
        reading["copies"].append({"numel": param.numel(), "transient": memory.peak() - before, "in_bucket": in_bucket})

    optimizer.setup_buckets, optimizer.copy_grads_in_partition = counted_setup, counted_copy
    ids = torch.randint(0, MODEL["vocab_size"], (layout.mbs, layout.seq), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        reading["copies"].clear()
        engine.micro_step(ids)
        engine.optimizer_step(1e-3)
    return reading


@pytest.fixture(scope="module")
def readings(tmp_path_factory) -> dict:
    import deepspeed  # noqa: F401  (imported before forking)

    from profiler.ranks import free_port, launch

    out = tmp_path_factory.mktemp("zero-buffers")
    launch(_read_buffers, 1, (free_port(), str(out)))
    return json.loads((out / "readings.json").read_text())


def _priced(name: str):
    layout, device_type, narrow = CASES[name]
    trace = _trace(layout)
    settings = _settings(trace, layout, device_type, narrow)
    head = trace.vocab_size * trace.hidden_size * 2  # the untied head's bf16 gradient
    return trace, layout, settings, zero_buffers(trace, layout, settings, trace.trainable_params, 2, head)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_deepspeeds_buckets_and_staging_buffer_are_the_priced_bytes(readings, name) -> None:
    measured = readings[name]
    _, _, _, priced = _priced(name)
    print("FIGURES", name, "buckets", measured["buckets"], "priced", priced.buckets,
          "staging", measured["staging"], "priced", priced.staging)
    assert measured["buckets"] == priced.buckets
    assert measured["staging"] == priced.staging


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[0].offload != "none"])
def test_handing_the_largest_gradient_to_the_host_costs_its_priced_fp64_copy(readings, name) -> None:
    trace, layout, settings, priced = _priced(name)
    largest = max(readings[name]["copies"], key=lambda copy: copy["numel"])
    assert largest["numel"] == largest_trainable_elems(trace, layout)
    # beside the buckets: the fp64 copy the call makes (its peak also holds the norm itself, one fp64
    # scalar) and the gradient, where it was kept apart from the buckets (bf16)
    kept_apart = 0 if largest["in_bucket"] else largest["numel"] * 2
    assert largest["transient"] - NORM_COPY_BYTES + kept_apart == priced.reduce - priced.buckets


@pytest.mark.slow
def test_a_gradient_wider_than_the_bucket_is_normed_apart_from_it(readings) -> None:
    """The head's gradient skips a bucket narrower than itself, so while it is normed for the host it
    sits beside the buckets (priced in `first_gradient`); narrower gradients are normed in a bucket."""
    trace, _, settings, priced = _priced("zero2-offload-narrow-bucket")
    copies = readings["zero2-offload-narrow-bucket"]["copies"]
    head = trace.vocab_size * trace.hidden_size
    assert all(copy["in_bucket"] == (copy["numel"] <= settings.bucket_elems) for copy in copies)
    assert priced.first_gradient == priced.buckets + head * 2 + NORM_COPY_BYTES * head


def test_the_h200_offload_row_prices_deepspeeds_buffers_by_hand() -> None:
    """Row 5 of the H200 evidence (TinyLlama's shapes, ZeRO-2, optimizer offload, bf16, dp=1, the GPU's
    config): DeepSpeed's formulas applied by hand. Two 5e7-element bf16 buckets (`setup_buckets` under
    `overlap_comm`); the staging buffer of the largest tensor, the 32000 x 2048 head; and, as the
    head's gradient (wider than a bucket, so kept apart) is normed during backward, its fp64 copy."""
    from bench.gpu_check import LLAMA_1B

    layout = Layout(dp=1, zero=2, offload="optimizer", mbs=2, seq=2048, dtype="bf16")
    trace = trace_model(ModelSpec(name="tinyllama-mha", hf_config={**LLAMA_1B, "num_key_value_heads": 32}),
                        layout.seq, layout.dtype, device_type="cuda")
    settings = zero_settings(trace, layout, "cuda")
    head = 32000 * 2048
    priced = zero_buffers(trace, layout, settings, trace.trainable_params, 2, head * 2)
    assert settings.bucket_elems == 50_000_000 and settings.overlap_comm and settings.offload_optimizer
    assert priced.buckets == 2 * 50_000_000 * 2
    assert priced.staging == head * 2
    assert priced.first_gradient == priced.buckets + head * 2 + 8 * head
    assert priced.reduce == priced.buckets + head * 2 + 8 * head  # the embedding's, last, as wide as the head
