"""The loss's memory at real vocabularies: the cost model's backward-start terms against the tensor
bytes a real training micro-step allocates on this CPU (allocator counter, profiler/tensor_memory.py).

A one-layer, 32-wide Llama with a 16k vocabulary: the logits and what the loss keeps dominate,
which is the case the cost model used to under-price (by a logits-sized fp32 buffer)."""

import pytest
import torch

from specs.core import Layout, ModelSpec
from planner.cost_model import stage_memory
from planner.memory import loss_chunks, tied_embedding_gradient_copies
from presets import load_hardware
from profiler.model_trace import trace_model
from profiler.tensor_memory import TensorMemory
from bench.chunked_loss_memory import measured
from trainer.engines.base import use_declared_loss
from trainer.model import build_filled_model

CONFIG = {"model_type": "llama", "vocab_size": 16384, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 512, "tie_word_embeddings": False}


def measured_activation_peak(layout: Layout, memory: TensorMemory, config: dict = CONFIG, chunked: bool = False) -> int:
    """Peak bytes of one forward and backward above what was live before it (the second step:
    the gradients of the first are dropped, as the optimizer's zero_grad does); HF's loss, or
    `chunked` the trainer's chunked loss."""
    return measured(layout, config, memory, chunked)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_loss_buffers_priced_as_measured(dtype: str) -> None:
    """HF's loss over the whole logits (`loss=hf`), as the engines that keep it run it (pipeline,
    sequence parallelism) and a user's own script does (the chunked loss: tests/test_chunked_loss.py)."""
    memory = TensorMemory(torch.device("cpu"))
    layout = Layout(mbs=4, seq=256, dtype=dtype, loss="hf")
    measured = measured_activation_peak(layout, memory)
    trace = trace_model(ModelSpec(name="logits", hf_config=CONFIG), layout.seq, dtype, device_type="cpu")
    stage = stage_memory(trace, layout, load_hardware("cpu"), 0, 1, 0, engine="plain")
    # the backward-start moment: activations (the saved fp32 log-softmax among them) and the loss's
    # transient buffers; the gradients of the small decoder layer come on top in the measurement
    predicted = stage.activations + stage.transient
    logits_fp32 = layout.mbs * layout.seq * CONFIG["vocab_size"] * 4
    assert measured > 2.9 * logits_fp32  # three logits-sized fp32 buffers at once: the case priced
    assert predicted == pytest.approx(measured, rel=0.05)


def test_a_tied_embeddings_gradient_copies_at_the_end_of_backward_priced_as_measured() -> None:
    """Short sequences and a wide vocabulary: the embedding's gradient, not the logits, sets the
    backward peak. The LM head's share waits for the embedding's own, and the sum is a third copy."""
    memory = TensorMemory(torch.device("cpu"))
    config = {**CONFIG, "hidden_size": 64, "tie_word_embeddings": True}
    layout = Layout(mbs=1, seq=16, dtype="fp32")
    spec = ModelSpec(name="tied", hf_config=config)
    measured = measured_activation_peak(layout, memory, config)
    stage = stage_memory(trace_model(spec, layout.seq, "fp32", device_type="cpu"), layout, load_hardware("cpu"), 0, 1, 0,
                         engine="plain")
    embedding_grad = config["vocab_size"] * config["hidden_size"] * 4
    h, inter, head_dim = config["hidden_size"], config["intermediate_size"], config["hidden_size"] // 2
    layer = 2 * h * h + 2 * h * head_dim + 3 * h * inter + 2 * h  # q, o; k, v (1 kv head); MLP; 2 norms
    trainable = 4 * (config["vocab_size"] * h + layer + h)  # the tied embedding once, 1 layer, final norm
    # by hand: every other gradient, and the embedding's three copies (held, new, their sum)
    assert stage.tied_backward - stage.weights - stage.optimizer == trainable - embedding_grad + 3 * embedding_grad
    assert measured > 2.9 * embedding_grad + (trainable - embedding_grad)
    assert stage.tied_backward - stage.weights - stage.optimizer == pytest.approx(measured, rel=0.05)
    assert stage.peak == stage.tied_backward


def measured_tied_gradient_growth(layout: Layout, config: dict, memory: TensorMemory) -> int:
    """Peak bytes that the tied embedding's own backward adds, from the moment its input gradient
    arrives (every other gradient exists, the head's share waits in autograd's buffer) to the moment
    its gradient is accumulated; the trainer's loss for `layout` (chunked where it runs so)."""
    model = build_filled_model(ModelSpec(name="tied", hf_config=config), layout, seed=0)
    use_declared_loss(model, layout, "plain")
    ids = torch.randint(0, config["vocab_size"], (layout.mbs, layout.seq), generator=torch.Generator().manual_seed(0))
    embedding = model.get_input_embeddings()
    moments: dict[str, int] = {}

    def embedding_gradient_arrives(gradient: torch.Tensor) -> None:
        moments["before"] = memory.live()
        memory.reset_peak()

    def watch_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.register_hook(embedding_gradient_arrives)

    embedding.register_forward_hook(watch_output)
    embedding.weight.register_post_accumulate_grad_hook(lambda weight: moments.__setitem__("peak", memory.peak()))
    model(input_ids=ids, labels=ids).loss.backward()
    return moments["peak"] - moments["before"]


@pytest.mark.parametrize("seq, chunks", [(256, 1), (1024, 4)])
def test_the_tied_gradients_sum_is_a_third_copy_unless_the_chunked_loss_summed_the_heads_share(
        seq: int, chunks: int) -> None:
    """Autograd adds the embedding's gradient into the waiting head share in place only when that
    share is a tensor of its own: the chunked loss's running sum over two or more chunks, not the
    weight gradient one GEMM returned (HF's loss, or one chunk)."""
    memory = TensorMemory(torch.device("cpu"))
    config = {**CONFIG, "vocab_size": 4096, "hidden_size": 256, "tie_word_embeddings": True}
    layout = Layout(mbs=1, seq=seq, dtype="fp32")
    trace = trace_model(ModelSpec(name="tied", hf_config=config), seq, "fp32", device_type="cpu")
    assert loss_chunks(trace, layout, "plain") == chunks  # the trainer's loss, in 256-token chunks
    gradient = config["vocab_size"] * config["hidden_size"] * 4
    growth = measured_tied_gradient_growth(layout, config, memory)
    copies = tied_embedding_gradient_copies(trace, layout, "plain")
    assert copies == (3 if chunks == 1 else 2)
    # the copies beyond the waiting one, within the embedding backward's own small buffers
    assert growth == pytest.approx((copies - 1) * gradient, rel=0.05)
