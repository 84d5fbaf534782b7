"""The chunked loss (trainer/chunked_loss.py): the value and gradients of HF's loss, its memory as
planner/memory.py prices it (independent truth: the CPU allocator counter), and where it runs."""

import pytest
import torch

from specs.capabilities import LOSS_CHUNK_TOKENS, chunked_loss
from specs.core import Layout, ModelSpec
from planner.compute_time import loss_recompute_flops
from planner.stage_memory import stage_memory
from presets import load_hardware
from profiler.model_trace import trace_model
from profiler.tensor_memory import TensorMemory
from test_logits_memory import measured_activation_peak
from trainer.chunked_loss import install_chunked_loss
from trainer.model import build_filled_model

SMALL = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 128}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, SMALL["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :7] = -100  # a prompt
    labels[1, 30:] = -100  # padding
    return ids, labels


def _loss_and_grads(model: torch.nn.Module, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("num_items", [None, 57.0])
@pytest.mark.parametrize("method", ["full", "lora"])
def test_chunked_loss_and_gradients_equal_hf(tied: bool, num_items: float | None, method: str) -> None:
    config = {**SMALL, "tie_word_embeddings": tied}
    spec, layout = ModelSpec(name="small", hf_config=config), Layout(method=method, lora_rank=4, dtype="fp32")
    reference, chunked = build_filled_model(spec, layout, seed=0), build_filled_model(spec, layout, seed=0)
    install_chunked_loss(chunked, chunk_tokens=16)  # 120 tokens: 8 chunks, the last one partial
    ids, labels = _batch()
    inputs = {"input_ids": ids, "labels": labels}
    if num_items is not None:
        inputs["num_items_in_batch"] = num_items
    expected, expected_grads = _loss_and_grads(reference, **inputs)
    loss, grads = _loss_and_grads(chunked, **inputs)
    assert torch.allclose(loss, expected, atol=1e-6, rtol=0)
    assert expected_grads.keys() == grads.keys() and grads
    if method == "lora":
        assert all("lora" in name for name in grads)
    for name, grad in grads.items():
        assert torch.allclose(grad, expected_grads[name], atol=1e-6, rtol=0), name
    with torch.no_grad():  # evaluation: the same value without recomputation
        assert torch.allclose(chunked(**inputs).loss, expected, atol=1e-6, rtol=0)
    assert chunked(input_ids=ids).logits.shape == (*ids.shape, config["vocab_size"])  # generation: HF's forward


MEMORY = {"model_type": "llama", "vocab_size": 16384, "hidden_size": 64, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 2048, "tie_word_embeddings": False}


@pytest.mark.parametrize("method, hidden", [("full", 64), ("lora", 64), ("full", 512)])
def test_chunked_loss_peak_drops_as_priced(method: str, hidden: int) -> None:
    """hidden 64: one chunk's three fp32 logits set the loss's peak; hidden 512: the trainable head's
    gradient copies do (three at each chunk's accumulation), a frozen one has none."""
    memory = TensorMemory(torch.device("cpu"))
    config = {**MEMORY, "hidden_size": hidden}
    layout = Layout(mbs=2, seq=1024, dtype="fp32", method=method, lora_rank=4)  # 8 chunks
    assert chunked_loss(layout, "plain", "llama", hidden)
    hf = measured_activation_peak(layout, memory, config)
    chunked = measured_activation_peak(layout, memory, config, chunked=True)
    trace = trace_model(ModelSpec(name="logits", hf_config=config), layout.seq, "fp32", method=method, device_type="cpu")

    def backward_start(loss: str) -> float:
        stage = stage_memory(trace, layout.model_copy(update={"loss": loss}), load_hardware("cpu"), 0, 1, 0,
                             engine="plain")
        return stage.activations + stage.transient

    predicted_chunked = backward_start("chunked")
    predicted_hf = backward_start("hf")
    chunk_fp32 = LOSS_CHUNK_TOKENS * MEMORY["vocab_size"] * 4
    head_gradient = MEMORY["vocab_size"] * hidden * 4 if method == "full" else 0
    assert hf > 2.9 * 8 * chunk_fp32  # HF: three fp32 buffers of the whole logits
    assert chunked > max(3 * chunk_fp32 + head_gradient, 3 * head_gradient)  # the case priced
    assert chunked < hf / 2
    assert predicted_chunked == pytest.approx(chunked, rel=0.05)
    assert predicted_hf - predicted_chunked == pytest.approx(hf - chunked, rel=0.05)


def test_the_declaration_chunks_where_the_engine_runs_it() -> None:
    # 8192 tokens: under bf16-mixed the plain and TP engines' head gradient is fp32 (autocast), and at
    # 4096 tokens of a 4096-wide head its three copies (3 x 4096 x 4 bytes per vocabulary entry) equal
    # HF's three fp32 logits (3 x 4096 x 4): no less held, HF's loss kept
    long = {"seq": 8192, "dtype": "bf16"}
    assert chunked_loss(Layout(**long), "plain", "llama", 4096)
    assert chunked_loss(Layout(zero=3, dp=2, **long), "deepspeed", "qwen2", 4096)
    assert chunked_loss(Layout(tp=2, **long), "fsdp2", "llama", 4096)
    assert not chunked_loss(Layout(tp=2, sp=1, **long), "fsdp2", "llama", 4096)  # the head's input hook gathers shards
    assert not chunked_loss(Layout(pp=2, gas=2, **long), "pipeline", "llama", 4096)  # the schedule applies HF's loss
    assert not chunked_loss(Layout(**long), "plain", "gemma2", 4096)  # soft-capped logits: not HF's plain loss
    # a short micro-batch of a wide trainable head: three head gradients (3 x 4096 x 4 bytes per vocabulary
    # entry, fp32 under autocast) would outweigh HF's three fp32 logits of 1024 tokens (3 x 1024 x 4); a
    # frozen head has none
    assert not chunked_loss(Layout(seq=1024, dtype="bf16"), "plain", "llama", 4096)
    assert chunked_loss(Layout(seq=1024, dtype="bf16", method="lora"), "plain", "llama", 4096)
    # loss=hf: transformers' loss, as a user's own script runs it, on every engine
    for engine, layout in [("plain", Layout(**long)), ("deepspeed", Layout(zero=3, dp=2, **long)),
                           ("fsdp2", Layout(tp=2, **long))]:
        assert not chunked_loss(layout.model_copy(update={"loss": "hf"}), engine, "llama", 4096)


def test_the_chunked_head_runs_its_forward_twice_in_the_time() -> None:
    trace = trace_model(ModelSpec(name="small", hf_config=SMALL), 64, "fp32", device_type="cpu")
    assert loss_recompute_flops(trace, Layout(seq=64), "plain") == trace.head.fwd_flops > 0
    assert loss_recompute_flops(trace, Layout(seq=64, pp=2, gas=2), "pipeline") == 0.0


def test_the_plain_engine_trains_on_the_chunked_loss() -> None:
    from trainer.batch import MicroBatch
    from trainer.engines import make_engine
    from trainer.model import build_model

    layout = Layout(seq=40, dtype="fp32")
    spec = ModelSpec(name="small", hf_config=SMALL)
    reference = build_filled_model(spec, layout, seed=0)
    engine = make_engine(build_model(spec, layout, seed=0), layout, None, clip=0.0)
    ids, labels = _batch()
    loss = engine.micro_step(MicroBatch(ids, labels))
    assert engine.model(input_ids=ids, labels=labels).logits is None  # the chunked forward ran
    assert loss == pytest.approx(float(reference(input_ids=ids, labels=labels).loss), abs=1e-6)


def test_the_plain_engine_trains_on_hfs_loss_where_the_layout_asks_for_it() -> None:
    from trainer.batch import MicroBatch
    from trainer.engines import make_engine
    from trainer.model import build_model

    layout = Layout(seq=40, dtype="fp32", loss="hf")
    spec = ModelSpec(name="small", hf_config=SMALL)
    reference = build_filled_model(spec, layout, seed=0)
    engine = make_engine(build_model(spec, layout, seed=0), layout, None, clip=0.0)
    ids, labels = _batch()
    loss = engine.micro_step(MicroBatch(ids, labels))
    assert engine.model(input_ids=ids, labels=labels).logits is not None  # HF's forward: the whole logits
    assert loss == pytest.approx(float(reference(input_ids=ids, labels=labels).loss), abs=1e-6)
