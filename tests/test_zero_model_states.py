"""Model-state memory against the ZeRO paper (Rajbhandari et al. 2020, Table 1)."""

import pytest
from paper_tables import ZERO_TABLE1, ZERO_TABLE1_PRINTED

from specs.core import Layout
from planner.memory import model_state_bytes

COLUMNS = {"baseline_gb": 0, "os_gb": 1, "os_g_gb": 2, "os_g_p_gb": 3}


def printed_interval(printed: float, how: str) -> tuple[float, float]:
    """The exact values that the paper would print as `printed`: rounded to the digits shown, or
    truncated to an integer."""
    if how == "truncate" and printed == int(printed):
        return printed, printed + 1
    decimals = len(repr(float(printed)).split(".")[1].rstrip("0"))
    half_unit = 0.5 * 10.0**-decimals
    return printed - half_unit, printed + half_unit


@pytest.mark.parametrize("row", ZERO_TABLE1, ids=lambda r: f"{r['params']:.3g}-dp{r['dp']}")
@pytest.mark.parametrize("column", list(COLUMNS))
def test_zero_table1_reproduced_within_rounding(row: dict, column: str) -> None:
    psi = row["params"]
    layout = Layout(dp=row["dp"], zero=COLUMNS[column], dtype="bf16")
    predicted_gb = model_state_bytes(psi, psi, layout, engine="deepspeed").total / 1e9  # the paper's GB is 1e9 bytes
    low, high = printed_interval(row[column], ZERO_TABLE1_PRINTED[psi])
    # e.g. 0.12 (7.5B, ZeRO-3, dp 1024) admits [0.115, 0.125); 513 (128B, truncated) admits [513, 514)
    assert low <= predicted_gb < high, (predicted_gb, row[column])


def test_printed_interval_reads_the_papers_rounding() -> None:
    assert printed_interval(0.12, "round") == pytest.approx((0.115, 0.125))
    assert printed_interval(41.3, "round") == pytest.approx((41.25, 41.35))
    assert printed_interval(120, "round") == (119.5, 120.5)
    assert printed_interval(513, "truncate") == (513, 514)
    assert printed_interval(15.6, "truncate") == pytest.approx((15.55, 15.65))


def test_zero3_shards_all_model_states() -> None:
    psi, dp = 1e9, 8
    full = model_state_bytes(psi, psi, Layout(dtype="bf16"), engine="deepspeed")
    z3 = model_state_bytes(psi, psi, Layout(dp=dp, zero=3, dtype="bf16"), engine="deepspeed")
    assert (full.weights, full.gradients, full.optimizer) == (2 * psi, 2 * psi, 12 * psi)
    assert z3.total == pytest.approx(full.total / dp)


def test_offload_moves_optimizer_states_and_fp32_gradients_to_host() -> None:
    # ZeRO-Offload (Ren et al. 2021, section 4): 16-bit weights stay on the device; fp32 master,
    # Adam moments and the fp32 gradient partition (12 + 4 bytes per parameter) go to the host.
    psi, dp = 1e9, 4
    states = model_state_bytes(psi, psi, Layout(dp=dp, zero=2, offload="optimizer", dtype="bf16"))
    assert (states.weights, states.gradients, states.optimizer) == (2 * psi, 0, 0)
    assert states.host == pytest.approx(16 * psi / dp)


def test_lora_freezes_base_and_keeps_fp32_adapters() -> None:
    params, adapters = 7e9, 40e6
    states = model_state_bytes(params, adapters, Layout(method="lora", dtype="bf16"))
    assert states.weights == pytest.approx((params - adapters) * 2 + adapters * 4)
    assert states.gradients == pytest.approx(adapters * 4)
    assert states.optimizer == pytest.approx(adapters * 8)


def test_qlora_stores_frozen_linear_weights_in_nf4() -> None:
    params, adapters = 7e9, 40e6
    states = model_state_bytes(params, adapters, Layout(method="qlora", dtype="bf16"), quantizable=params - adapters)
    # 4 bits plus double-quantised block constants: ~4.13 bits per weight (QLoRA, section 3)
    nf4_bytes = states.weights - adapters * 4  # fp32 adapters ride along with the frozen base
    assert nf4_bytes / (params - adapters) == pytest.approx(4.127 / 8, abs=1e-3)


# ------------------------------------------------------------------------------------------------
# per engine: what each of the trainer's engines keeps (specs.capabilities.engine_for)


def test_plain_engine_keeps_fp32_weights_and_moments_in_bf16() -> None:
    # bf16 is bf16-mixed (issue 28): fp32 weights (the master), fp32 gradients and AdamW moments,
    # bf16 compute under autocast: the field's 16 bytes per parameter
    psi = 1e9
    states = model_state_bytes(psi, psi, Layout(dtype="bf16"), engine="plain")
    assert (states.weights, states.gradients, states.optimizer) == (4 * psi, 4 * psi, 8 * psi)
    fp32 = model_state_bytes(psi, psi, Layout(dtype="fp32"), engine="plain")
    assert (fp32.weights, fp32.gradients, fp32.optimizer) == (4 * psi, 4 * psi, 8 * psi)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_fsdp2_shards_fp32_states_at_every_zero_stage(zero: int) -> None:
    # FSDP2 keeps fp32 shards (compute in bf16 through its MixedPrecisionPolicy), fp32 gradients
    # (reduce_dtype), Adam moments of the shards and no master: 16 bytes per parameter over dp
    psi, dp = 1e9, 4
    states = model_state_bytes(psi, psi, Layout(dp=dp, zero=zero, dtype="bf16"), engine="fsdp2")
    assert (states.weights, states.gradients, states.optimizer) == (4 * psi / dp, 4 * psi / dp, 8 * psi / dp)


def test_deepspeed_keeps_fp32_master_even_for_fp32_models() -> None:
    psi, dp = 1e9, 2
    states = model_state_bytes(psi, psi, Layout(dp=dp, zero=1, dtype="fp32"), engine="deepspeed")
    assert (states.weights, states.gradients, states.optimizer) == (4 * psi, 4 * psi, 12 * psi / dp)


def test_fsdp2_gathers_the_whole_stage_below_zero3() -> None:
    from planner.memory import gathered_parameter_bytes

    params, layer, root = 1e9, 1e8, 2e8
    z2 = gathered_parameter_bytes(params, layer, root, Layout(dp=2, zero=2, dtype="bf16"), "fsdp2")
    z3 = gathered_parameter_bytes(params, layer, root, Layout(dp=2, zero=3, dtype="bf16"), "fsdp2")
    ds3 = gathered_parameter_bytes(params, layer, root, Layout(dp=2, zero=3, dtype="bf16"), "deepspeed")
    assert z2 == 2 * params  # reshard_after_forward=False: every unit gathered, in bf16
    assert z3 == 2 * (root + 2 * layer)  # the root stays gathered; one layer computed, one prefetched
    assert ds3 == 2 * params  # below stage3_max_live_parameters DeepSpeed keeps everything gathered


# -- what each engine's ranks hold, against the model-state terms ---------------------------------

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
# The exported DeepSpeed config's ZeRO-3 setting that decides what a rank holds (planner/export.py):
# no parameter is kept whole ("persistent") on every rank.
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2, "train_batch_size": 4,
             "zero_optimization": {"stage": 0, "stage3_param_persistence_threshold": 0},
             "steps_per_print": 1_000_000}
FP32 = {"mbs": 1, "gas": 2, "dtype": "fp32", "seq": 16}  # accumulating: ZeRO-1 holds whole gradients
# (engine choice, layout) of every engine on 2 ranks
TWO_RANK_CASES = {
    "ddp": ("auto", {"dp": 2, "zero": 0}),
    **{f"deepspeed-zero{z}": ("deepspeed", {"dp": 2, "zero": z}) for z in (1, 2, 3)},
    **{f"fsdp2-zero{z}": ("fsdp2", {"dp": 2, "zero": z}) for z in (1, 2, 3)},
    "pipeline": ("auto", {"pp": 2}),
}


def _held_after_one_step(layout: Layout, choice: str) -> dict[str, int]:
    """Gradients at their most between the micro-batches of a step (after each backward: whole
    while ZeRO-0/1 accumulate, partitions from ZeRO-2 on), parameters and optimizer states after
    the optimizer step (Adam's moments exist from then on)."""
    import torch

    from specs.core import ModelSpec
    from trainer.engines import make_engine
    from trainer.model import build_model

    model = build_model(ModelSpec(name="tiny", hf_config=TINY), layout, seed=0)
    config = {**DS_CONFIG, "zero_optimization": {**DS_CONFIG["zero_optimization"], "stage": layout.zero}}
    engine = make_engine(model, layout, config if choice == "deepspeed" else None, clip=0.0, engine=choice)
    tokens = torch.randint(0, TINY["vocab_size"], (layout.gas, 1, 16), generator=torch.Generator().manual_seed(0))
    gradients = 0
    for micro_batch in tokens:
        engine.micro_step(micro_batch)
        gradients = max(gradients, engine.state_bytes()["gradients"])
    engine.optimizer_step(1e-3)
    return {**engine.state_bytes(), "gradients": gradients}


def _rank_holdings(rank: int, world: int, port: int, out: str) -> None:
    import json
    from pathlib import Path

    from profiler.ranks import finish_rank, init_rank
    from trainer.engines import select_backend

    init_rank(rank, world, port, distributed=True, threads=1)
    held = {}
    for case, (choice, fields) in TWO_RANK_CASES.items():
        layout = Layout(**FP32, **fields)
        held[case] = {**_held_after_one_step(layout, choice), "engine": select_backend(layout, choice)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(held))
    finish_rank(True)


def _priced(params: float, layout: Layout, engine: str):
    """The cost model's model-state terms, as `engine` keeps them."""
    return model_state_bytes(params, params, layout, engine=engine)


def _stage_params(rank: int, layout: Layout) -> int:
    """Parameters this rank's pipeline stage holds (whole model when pp = 1), from the unsplit model's
    names: stage 0 the embedding and first layer, stage 1 the second layer, final norm and head."""
    from specs.core import ModelSpec
    from trainer.model import build_model

    model = build_model(ModelSpec(name="tiny", hf_config=TINY), Layout(**FP32), seed=0)  # meta: shapes only
    if layout.pp == 1:
        return sum(p.numel() for p in model.parameters())
    first = ("model.embed_tokens.", "model.layers.0.")
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(first) == (rank == 0))


@pytest.fixture(scope="module")
def two_rank_holdings(tmp_path_factory) -> list[dict]:
    import json

    import deepspeed  # noqa: F401  (imported before forking: the ranks inherit it loaded)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401

    from profiler.ranks import free_port, launch

    out = tmp_path_factory.mktemp("holdings")
    launch(_rank_holdings, 2, (2, free_port(), str(out)))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_each_rank_holds_the_model_states_the_cost_model_prices(two_rank_holdings, case) -> None:
    choice, fields = TWO_RANK_CASES[case]
    layout = Layout(**FP32, **fields)
    for rank, held in enumerate(two_rank_holdings):
        measured = held[case]
        priced = _priced(_stage_params(rank, layout), layout, measured["engine"])
        assert measured["parameters"] == pytest.approx(priced.weights, rel=0.02), (rank, measured, priced)
        assert measured["gradients"] == pytest.approx(priced.gradients, rel=0.02), (rank, measured, priced)
        assert measured["optimizer"] == pytest.approx(priced.optimizer, rel=0.02), (rank, measured, priced)


def test_one_process_holds_the_model_states_the_cost_model_prices() -> None:
    layout = Layout(**FP32)
    measured = _held_after_one_step(layout, "auto")
    priced = _priced(_stage_params(0, layout), layout, "plain")
    assert (measured["parameters"], measured["gradients"]) == (priced.weights, priced.gradients)
    assert measured["optimizer"] == pytest.approx(priced.optimizer, rel=0.02)  # plus Adam's 4-byte steps
