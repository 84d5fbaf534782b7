"""Model-state memory against the ZeRO paper (Rajbhandari et al. 2020, Table 1)."""

import pytest
from paper_tables import ZERO_TABLE1, ZERO_TABLE1_PRINTED

from advisor.specs import Layout
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
# per engine: what each of the trainer's engines keeps (advisor.capabilities.engine_for)


def test_plain_engine_keeps_no_fp32_master_in_bf16() -> None:
    # build_model casts the model to bf16 and AdamW steps those weights: moments in bf16, no master
    psi = 1e9
    states = model_state_bytes(psi, psi, Layout(dtype="bf16"), engine="plain")
    assert (states.weights, states.gradients, states.optimizer) == (2 * psi, 2 * psi, 4 * psi)
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
