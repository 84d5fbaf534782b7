"""QLoRA as priced: a bitsandbytes NF4 base with fp32 LoRA adapters, the same losses on 2 DDP ranks
as on 1 process, the model-state bytes the cost model predicts, and a plan that chooses it on CPU."""

import json

import pytest
import torch
from typer.testing import CliRunner

from advisor.cli import app
from specs.plan_file import load_plan
from specs.core import Layout, ModelSpec
from planner.cost_model import stage_memory
from planner.plan import PlanOptions, make_plan
from presets import load_hardware, load_task
from profiler.model_trace import trace_model
from test_trainer import read_jsonl, write_task

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 272, "max_position_embeddings": 128}
MODEL = ModelSpec(name="tiny-qlora", hf_config=CONFIG)
# tied embeddings (one fp32 matrix for both ends), GQA, and q/k/v biases beside the 4-bit weights
QWEN2 = ModelSpec(name="tiny-qwen2", hf_config={
    "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": True,
    "max_position_embeddings": 128})
STEPS = 3
# bf16 compute over the 4-bit base, fp32 adapters and gradients. Each rank's micro-batch runs the
# same shapes as the 1-process run's micro-batches, and DDP's fp32 mean of two gradients equals the
# accumulation of two halves: measured identical losses over 6 steps. The bound allows fp32
# rounding of the reduction only; a wrong data shard or a missed gradient moves the loss by >1e-3.
BF16_LOSS_RTOL = 1e-6


def _qlora_layout(**fields) -> Layout:
    return Layout(method="qlora", dtype="bf16", lora_rank=4, mbs=1, gas=2, **fields)


def _trained_engine(layout: Layout, model: ModelSpec = MODEL):
    """A QLoRA model on the plain engine after one optimizer step and one more backward: its
    parameters, gradients and Adam states all exist."""
    from trainer.engines import make_engine
    from trainer.model import build_model

    engine = make_engine(build_model(model, layout, seed=0), layout, None, clip=1.0)
    batch = torch.randint(0, model.hf_config["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(0))
    engine.micro_step(batch)
    engine.optimizer_step(1e-3)
    engine.micro_step(batch)
    return engine


@pytest.mark.parametrize("model", [MODEL, QWEN2], ids=lambda m: m.name)
def test_qlora_base_is_nf4_and_model_states_match_the_cost_model(model: ModelSpec) -> None:
    import bitsandbytes as bnb

    layout = _qlora_layout(seq=32)
    engine = _trained_engine(layout, model)
    layers = model.hf_config["num_hidden_layers"]
    linears = [m for name, m in engine.module.named_modules() if name.endswith("base_layer")]
    assert len(linears) == 7 * layers  # q, k, v, o, gate, up, down
    assert all(isinstance(m, bnb.nn.Linear4bit) and isinstance(m.weight, bnb.nn.Params4bit)
               and m.weight.dtype == torch.uint8 and m.weight.quant_state.quant_type == "nf4" for m in linears)
    assert all(m.weight.quant_state.nested for m in linears)  # double quantisation
    adapters = [p for p in engine.module.parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, p in engine.module.named_parameters() if p.requires_grad)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in adapters)

    held = engine.state_bytes()
    trace = trace_model(model, 32, dtype="bf16", method="qlora", lora_rank=4, device_type="cpu",
                        use_disk_cache=False)
    priced = stage_memory(trace, layout, load_hardware("cpu"), 0, layers, 0)
    assert held["parameters"] == pytest.approx(priced.weights, rel=0.02)
    assert held["gradients"] == pytest.approx(priced.gradients, rel=0.02)
    assert held["optimizer"] == pytest.approx(priced.optimizer, rel=0.02)


def test_a_qlora_checkpoint_restores_the_4bit_base_and_adapters_into_another_model() -> None:
    from trainer.model import build_model

    saved, other = build_model(MODEL, _qlora_layout(), seed=0), build_model(MODEL, _qlora_layout(), seed=1)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = saved(input_ids=ids).logits
        assert not torch.equal(other(input_ids=ids).logits, expected)
        other.load_state_dict(saved.state_dict())  # what the engines' checkpoints write and --resume reads
        assert torch.equal(other(input_ids=ids).logits, expected)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_qlora_keeps_the_plans_recomputation(recompute: str) -> None:
    # peft's prepare_model_for_kbit_training would checkpoint every layer by default
    from trainer.model import build_model

    layout = _qlora_layout(recompute=recompute, **({"recompute_layers": [1]} if recompute == "full" else {}))
    layers = [m for m in build_model(MODEL, layout, seed=0).modules() if m.__class__.__name__.endswith("DecoderLayer")]
    assert [layer.gradient_checkpointing for layer in layers] == ([True, False] if recompute == "full" else [False, False])


def test_a_training_forward_after_a_backward_that_missed_the_adapters_is_refused() -> None:
    from specs.errors import UsageError
    from trainer.model import build_model

    model = build_model(MODEL, _qlora_layout(), seed=0)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # evaluation does not count, and must not repack the weights for inference
        model.eval()
        model(input_ids=ids)
        model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.detach().requires_grad_().backward()  # a backward that never reaches the adapters (trap 4)
    with pytest.raises(UsageError, match="without a gradient"):
        model(input_ids=ids, labels=ids)


def _plan_file(root, dp: int) -> str:
    task = write_task(root, steps=STEPS * 2)
    plan = make_plan(PlanOptions(model=MODEL, hardware=load_hardware("cpu"), gpus_per_node=dp,
                                 task=load_task(str(task)), method="qlora", min_compute_fraction=0.0))
    layout = plan.chosen.layout.model_copy(update={"dp": dp, "gas": 2 // dp, "mbs": 1, "tp": 1, "pp": 1,
                                                   "zero": 0, "dtype": "bf16", "recompute": "none",
                                                   "lora_rank": 4, "method": "qlora"})
    plan.chosen.layout = layout
    for stage in plan.stages:
        stage.layout = layout
        stage.steps = STEPS
    path = root / "plan.yaml"
    plan.write(path)
    return str(path)


def _rank_train(rank: int, world: int, port: int, plan_path: str, run_dir: str) -> None:
    from pathlib import Path

    from profiler.ranks import finish_rank, init_rank
    from trainer.loop import TrainOptions, train

    init_rank(rank, world, port, distributed=world > 1, threads=1)
    train(load_plan(plan_path), Path(run_dir), False, TrainOptions(show_progress=False))
    finish_rank(world > 1)


def _losses(root, dp: int) -> list[float]:
    from profiler.ranks import free_port, launch

    plan = _plan_file(root, dp)
    launch(_rank_train, dp, (dp, free_port(), plan, str(root / "run")))
    assert json.loads((root / "run" / "summary.json").read_text())["world_size"] == dp
    return [m["loss"] for m in read_jsonl(root / "run" / "metrics.jsonl")]


@pytest.mark.slow
def test_qlora_on_two_ddp_ranks_matches_one_process(tmp_path) -> None:
    one = _losses(tmp_path / "one", 1)
    two = _losses(tmp_path / "two", 2)
    assert len(one) == len(two) >= 2 * STEPS
    assert two == pytest.approx(one, rel=BF16_LOSS_RTOL)
    assert one[STEPS - 1] < one[0]  # the adapters learn


def test_plan_method_qlora_on_cpu_chooses_a_layout_the_trainer_runs(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    result = CliRunner().invoke(app, ["plan", "--model", str(config), "--hardware", "cpu", "--gpus-per-node", "1",
                                      "--seq-len", "32", "--global-batch", "2", "--method", "qlora", "--json"])
    assert result.exit_code == 0, result.output
    chosen = Layout(**json.loads(result.stdout)["plans"][0]["layout"])
    assert chosen.method == "qlora" and chosen.dtype == "bf16"
    engine = _trained_engine(chosen)  # make_engine refuses what the trainer does not run as priced
    assert all(p.grad is not None for p in engine.module.parameters() if p.requires_grad)
