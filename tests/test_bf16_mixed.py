"""dtype=bf16 is bf16-mixed on every engine (issue 28): fp32 master weights and fp32 Adam moments,
bf16 compute. Pure bf16 (bf16 weights and moments) loses AdamW updates below half of bf16's spacing
at a weight: 2e-5 on a weight of 0.02, where the spacing is 2^-13, rounds away.

The independent truth is the fp32 run: 20 AdamW steps at lr 2e-5 from the same weights and data
must move the weights as far under dtype=bf16 (the norm of the total change ||w20 - w0|| within 1%)
on the plain, DDP, FSDP2, DeepSpeed, tensor- and pipeline-parallel engines; the old pure-bf16 path
(the model cast to bf16, AdamW on it) loses most of the change.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specs.capabilities import precision
from advisor.cli import app
from specs.errors import UsageError
from specs.core import Layout, ModelSpec, parse_layout_string

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
        "initializer_range": 0.02}
STEPS, LR, SEQ = 20, 2e-5, 16
# The bound of this file: the bf16 run's total weight change has the fp32 run's norm within 1%.
WITHIN = 0.01

# (engine choice, layout fields) of the 2-rank cases; "plain" runs in this process
TWO_RANK_CASES = {
    "ddp": ("auto", {"dp": 2, "zero": 0, "mbs": 2, "gas": 1}),
    "fsdp2": ("fsdp2", {"dp": 2, "zero": 2, "mbs": 2, "gas": 1}),
    "deepspeed": ("deepspeed", {"dp": 2, "zero": 2, "mbs": 2, "gas": 1}),
    "tp": ("auto", {"tp": 2, "mbs": 2, "gas": 1}),
    "pp": ("auto", {"pp": 2, "mbs": 1, "gas": 2}),
}
PLAIN = ("auto", {"mbs": 4, "gas": 1})


def _tokens() -> torch.Tensor:
    """STEPS global batches of 4 sequences, the same for every run."""
    return torch.randint(0, TINY["vocab_size"], (STEPS, 4, SEQ), generator=torch.Generator().manual_seed(1))


def _weights(engine) -> dict[str, torch.Tensor]:
    """Every weight this rank holds, whole and in fp32: DeepSpeed's fp32 master (its module holds
    bf16 copies), a DTensor's full tensor, a plain parameter as it is."""
    from torch.distributed.tensor import DTensor

    out = {}
    if hasattr(engine, "engine"):  # DeepSpeed: the master the optimizer updates
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in engine.engine.module.named_parameters():
            out[name] = safe_get_full_fp32_param(param).detach().float().clone()
        return out
    for name, param in engine.module.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = value.detach().float().clone()
    return out


def _train(choice: str, fields: dict, dtype: str) -> tuple[dict, dict, dict]:
    """(w0, w20) of STEPS steps of the engine that runs this layout, as `advisor train` builds it,
    and the model-state bytes this rank held in the first step (`Engine.state_bytes`: the gradients
    at their most between micro-batches, the rest after the update)."""
    from planner.export import model_deepspeed_config
    from trainer.engines import make_engine, select_backend
    from trainer.model import build_model

    layout = Layout(**fields, dtype=dtype, seq=SEQ)
    spec = ModelSpec(name="tiny-bf16", hf_config=TINY)
    model = build_model(spec, layout, seed=0)
    config = model_deepspeed_config(spec, "cpu", layout) if select_backend(layout, choice) == "deepspeed" else None
    engine = make_engine(model, layout, config, clip=0.0, engine=choice)
    before = _weights(engine)
    rows = layout.mbs * layout.gas
    held: dict[str, int] = {}
    for step, batch in enumerate(_tokens()):
        mine = batch[engine.data_rank * rows:(engine.data_rank + 1) * rows]
        for micro in mine.split(layout.mbs):
            engine.micro_step(micro)
            if step == 0:
                held["gradients"] = max(held.get("gradients", 0), engine.state_bytes()["gradients"])
        engine.optimizer_step(LR)
        if step == 0:
            held = {**engine.state_bytes(), "gradients": held["gradients"]}
    after = _weights(engine)  # before evaluating: FSDP2 then holds its gathered bf16 weights as the parameters
    with torch.no_grad():  # evaluation, as the loop runs it: the engine's model, the layout's dtype
        evaluation = _tokens()[0][:2]
        held["eval_loss"] = float(engine.model(input_ids=evaluation, labels=evaluation).loss)
    return before, after, held


def _pure_bf16() -> tuple[dict, dict]:
    """The path before issue 28: the model cast to bf16 and torch's AdamW stepping it (bf16 weights
    and moments, no master)."""
    from trainer.model import build_filled_model

    model = build_filled_model(ModelSpec(name="tiny-bf16", hf_config=TINY), Layout(dtype="fp32", seq=SEQ), seed=0,
                               on=torch.device("cpu")).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    for batch in _tokens():
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return before, {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _change(run: tuple) -> dict[str, torch.Tensor]:
    before, after = run[:2]
    return {name: after[name] - before[name] for name in before}


def _norm(changes: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(c.double().pow(2).sum()) for c in changes.values()))


def _compare(fp32: dict[str, torch.Tensor], bf16: dict[str, torch.Tensor]) -> dict[str, float]:
    """The relative difference of the change's norm, and the norm of the changes' difference, both
    over the fp32 change's norm."""
    reference = _norm(fp32)
    return {"norm_fp32": reference, "norm_bf16": _norm(bf16),
            "norm_ratio_diff": abs(_norm(bf16) - reference) / reference,
            "change_diff": _norm({n: bf16[n] - fp32[n] for n in fp32}) / reference}


# -- one process ------------------------------------------------------------------------------------


def test_plain_engine_bf16_moves_the_weights_as_fp32_does() -> None:
    choice, fields = PLAIN
    fp32 = _change(_train(choice, fields, "fp32"))
    bf16 = _change(_train(choice, fields, "bf16"))
    figures = _compare(fp32, bf16)
    print("plain", json.dumps(figures))
    assert figures["norm_ratio_diff"] < WITHIN, figures


def test_plain_engine_keeps_fp32_weights_and_moments_under_bf16() -> None:
    from trainer.engines import make_engine
    from trainer.model import build_model

    layout = Layout(mbs=1, dtype="bf16", seq=SEQ)
    engine = make_engine(build_model(ModelSpec(name="tiny-bf16", hf_config=TINY), layout, seed=0), layout, None, 0.0)
    engine.micro_step(_tokens()[0][:1])
    engine.optimizer_step(LR)
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}
    moments = [t for state in engine.optimizer.state.values() for k, t in state.items() if k != "step"]
    assert moments and {t.dtype for t in moments} == {torch.float32}


def test_pure_bf16_loses_most_of_the_update() -> None:
    fp32 = _change(_train(*PLAIN, "fp32"))
    pure = _change(_pure_bf16())
    lost = 1 - _norm(pure) / _norm(fp32)
    print("pure-bf16 lost share", lost)
    # most weights of 0.02 cannot move by 2e-5 steps: the bulk of the fp32 change is lost
    assert lost > 0.4, lost  # measured: 53% lost


def test_bf16_true_is_refused_with_one_line() -> None:
    with pytest.raises(UsageError) as refused:
        parse_layout_string("dp=1,dtype=bf16-true")
    message = str(refused.value)
    assert "\n" not in message and "round away" in message and "dtype=bf16" in message
    result = CliRunner().invoke(app, ["estimate", "--model", "llama2-7b", "--hardware", "h100-80g",
                                      "--gpus-per-node", "1", "--layout", "dtype=bf16-true"])
    assert result.exit_code == 2 and "bf16-true" in result.stderr and "Traceback" not in result.stderr


def test_every_engine_declares_fp32_master_state_for_bf16() -> None:
    for engine, fields in (("plain", {}), ("fsdp2", {"tp": 2}), ("pipeline", {"pp": 2}),
                           ("fsdp2", {"dp": 2, "zero": 1}), ("pipeline", {"dp": 2, "pp": 2, "zero": 1}),
                           ("deepspeed", {"dp": 2, "zero": 2})):
        how = precision(Layout(dtype="bf16", **fields), engine)
        assert how.master or how.weight_bytes == 4, (engine, fields, how)
        assert how.mode != "fp32"


# -- 7B on one 80 GB card --------------------------------------------------------------------------


def test_llama2_7b_bf16_model_states_cost_16_bytes_per_parameter() -> None:
    # gas=2: the gradients are resident at the peak (accumulated), so the estimate shows all three
    result = CliRunner().invoke(app, ["estimate", "--model", "llama2-7b", "--hardware", "h100-80g",
                                      "--gpus-per-node", "1", "--json",
                                      "--layout", "dp=1,zero=0,dtype=bf16,mbs=1,gas=2"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    memory, params = out["memory"], out["model"]["params"]
    assert (memory["weights"] + memory["gradients"] + memory["optimizer"]) / params == pytest.approx(16, abs=1e-6)
    assert not memory["fits"]


def test_llama2_7b_full_finetune_on_one_80g_card_needs_offload() -> None:
    result = CliRunner().invoke(app, ["plan", "--model", "llama2-7b", "--hardware", "h100-80g", "--gpus-per-node",
                                      "1", "--global-batch", "16", "--seq-len", "2048", "--json"])
    if result.exit_code == 2:  # refused outright: no plan at all
        return
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)["plans"]
    assert plans and all(p["layout"]["offload"] != "none" for p in plans), [p["layout"] for p in plans]


# -- two ranks ---------------------------------------------------------------------------------------


def _rank_runs(rank: int, world: int, port: int, out: str) -> None:
    from profiler.ranks import finish_rank, init_rank

    init_rank(rank, world, port, distributed=True, threads=1)
    for case, (choice, fields) in TWO_RANK_CASES.items():
        for dtype in ("fp32", "bf16"):
            run = _train(choice, fields, dtype)
            torch.save(_change(run), Path(out, f"{case}-{dtype}-rank{rank}.pt"))
            Path(out, f"{case}-{dtype}-rank{rank}.json").write_text(json.dumps(run[2]))
    finish_rank(True)


@pytest.fixture(scope="module")
def two_rank_changes(tmp_path_factory) -> Path:
    import deepspeed  # noqa: F401  (imported before forking: the ranks inherit it loaded)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401

    from profiler.ranks import free_port, launch

    out = tmp_path_factory.mktemp("bf16-mixed")
    launch(_rank_runs, 2, (2, free_port(), str(out)))
    return out


def _whole_change(out: Path, case: str, dtype: str) -> dict[str, torch.Tensor]:
    """The change of every weight, from the ranks that hold it (pipeline stages hold different ones;
    replicas and full tensors the same)."""
    whole: dict[str, torch.Tensor] = {}
    for rank in range(2):
        whole.update(torch.load(out / f"{case}-{dtype}-rank{rank}.pt", weights_only=True))
    return whole


@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_two_rank_engine_bf16_moves_the_weights_as_fp32_does(two_rank_changes, case) -> None:
    fp32 = _whole_change(two_rank_changes, case, "fp32")
    bf16 = _whole_change(two_rank_changes, case, "bf16")
    for rank in range(2):  # evaluation ran too, in bf16, and agrees with fp32's to bf16's precision
        losses = [json.loads((two_rank_changes / f"{case}-{dtype}-rank{rank}.json").read_text())["eval_loss"]
                  for dtype in ("fp32", "bf16")]
        assert losses[1] == pytest.approx(losses[0], abs=0.02), losses
    assert fp32.keys() == bf16.keys() and len(fp32) == 2 + 9 * TINY["num_hidden_layers"] + 1
    figures = _compare(fp32, bf16)
    print(case, json.dumps(figures))
    assert figures["norm_ratio_diff"] < WITHIN, figures


def _rank_params(rank: int, layout: Layout) -> int:
    """Parameters of this rank's model (its pipeline stage's under pp: stage 0 the embedding and
    the first layer), before any sharding."""
    from trainer.model import build_model

    model = build_model(ModelSpec(name="tiny-bf16", hf_config=TINY), Layout(dtype="fp32", seq=SEQ), seed=0)
    if layout.pp == 1:
        return sum(p.numel() for p in model.parameters())
    first = ("model.embed_tokens.", "model.layers.0.")
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(first) == (rank == 0))


@pytest.mark.parametrize("case", [c for c in TWO_RANK_CASES if c != "tp"])
def test_each_rank_holds_the_bf16_model_states_the_cost_model_prices(two_rank_changes, case) -> None:
    from planner.memory import model_state_bytes
    from trainer.engines import select_backend

    choice, fields = TWO_RANK_CASES[case]
    layout = Layout(**fields, dtype="bf16", seq=SEQ)
    engine = select_backend(layout, choice)
    for rank in range(2):
        held = json.loads((two_rank_changes / f"{case}-bf16-rank{rank}.json").read_text())
        params = _rank_params(rank, layout)
        priced = model_state_bytes(params, params, layout, engine=engine)
        assert held["parameters"] == pytest.approx(priced.weights, rel=0.02), (rank, held, priced)
        assert held["gradients"] == pytest.approx(priced.gradients, rel=0.02), (rank, held, priced)
        assert held["optimizer"] == pytest.approx(priced.optimizer, rel=0.02), (rank, held, priced)


def test_plain_engine_holds_the_bf16_model_states_the_cost_model_prices() -> None:
    from planner.memory import model_state_bytes

    choice, fields = PLAIN
    layout = Layout(**fields, dtype="bf16", seq=SEQ)
    held = _train(choice, fields, "bf16")[2]
    params = _rank_params(0, layout)
    priced = model_state_bytes(params, params, layout, engine="plain")
    assert (held["parameters"], held["gradients"]) == (priced.weights, priced.gradients) == (4 * params, 4 * params)
    assert held["optimizer"] == pytest.approx(priced.optimizer, rel=0.02)  # plus Adam's 4-byte steps


# -- the trace of what runs ---------------------------------------------------------------------------


def test_the_bf16_trace_runs_fp32_weights_under_autocast() -> None:
    from planner.memory import activation_blocks, autocast_weight_copy_bytes
    from profiler.model_trace import trace_model

    spec = ModelSpec(name="tiny-bf16", hf_config=TINY)
    trace = trace_model(spec, SEQ, "bf16", device_type="cpu", use_disk_cache=False)
    h, i, kv = TINY["hidden_size"], TINY["intermediate_size"], TINY["hidden_size"] // 2  # 2 of 4 heads
    projections = 2 * h * h + 2 * h * kv + 3 * h * i  # q, o; k, v; gate, up, down
    assert trace.autocast is not None
    # autocast keeps one bf16 copy of each GEMM's weight: the projections and the LM head, not the
    # embedding (a lookup) nor the norms (an element-wise product)
    assert trace.autocast.layer.cast_weight_bytes == 2 * projections
    assert trace.autocast.head.cast_weight_bytes == 2 * TINY["vocab_size"] * h
    # the residual stream stays fp32: a layer's input is 4 bytes per element, and what the layer keeps
    # is more than the 16-bit module keeps (fp32 norm inputs beside their bf16 casts)
    assert trace.autocast.layer.input_bytes == SEQ * h * 4 == 2 * trace.layer.input_bytes
    assert trace.autocast.layer.act_bytes > trace.layer.act_bytes
    plain, deepspeed = Layout(dtype="bf16", seq=SEQ), Layout(dtype="bf16", seq=SEQ, dp=2, zero=1)
    assert activation_blocks(trace, plain, "plain") == (trace.autocast.layer, trace.autocast.head)
    assert activation_blocks(trace, deepspeed, "deepspeed") == (trace.layer, trace.head)  # its module is bf16
    assert autocast_weight_copy_bytes(trace, plain, "plain", 2, True) == 2 * (2 * projections + TINY["vocab_size"] * h)
    assert autocast_weight_copy_bytes(trace, deepspeed, "deepspeed", 2, True) == 0.0
    assert trace_model(spec, SEQ, "fp32", device_type="cpu", use_disk_cache=False).autocast is None


def test_bf16_activations_priced_as_measured_under_autocast() -> None:
    """The plain engine's backward-start activations and transients under bf16-mixed against the
    CPU allocator counter (profiler/tensor_memory.py): priced as closely as fp32's, whose gap on this
    small model (the layers' gradients arriving in backward, which the moment does not count) is the
    reference."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from bench.chunked_loss_memory import measured
    from planner.cost_model import stage_memory
    from presets import load_hardware
    from profiler.model_trace import trace_model
    from profiler.tensor_memory import TensorMemory

    memory = TensorMemory(torch.device("cpu"))
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "tie_word_embeddings": False}
    ratios = {}
    for dtype in ("fp32", "bf16"):
        layout = Layout(mbs=2, seq=512, dtype=dtype)
        trace = trace_model(ModelSpec(name="acts", hf_config=config), layout.seq, dtype, device_type="cpu")
        stage = stage_memory(trace, layout, load_hardware("cpu"), 0, 2, 0, engine="plain")
        ratios[dtype] = (stage.activations + stage.transient) / measured(layout, config, memory, False)
    # measured: fp32 0.923, bf16 0.903 (the 16-bit module's trace, without autocast's fp32 residual
    # stream and weight copies, priced it at 0.68)
    assert ratios["bf16"] == pytest.approx(ratios["fp32"], abs=0.03), ratios
