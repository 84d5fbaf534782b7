"""The pipeline engine runs what the planner prices for pipelines: interleaved stages (vpp > 1)
with uneven layer splits, ZeRO-1/2/3 across pipeline replicas (ZeRO-3 resharding the weights
after every micro-batch's forward, ZeRO-2/3 reduce-scattering gradients after every micro-batch),
and per-stage recompute counts landing on each device's own layers.

Every multi-rank run is compared with one process training the unsplit 5-layer model on the same
global batch (fp32, 3 steps, within 1e-5). Three multi-rank launches in all: the real staged loop
for pp=2 vpp=2 (evaluation included) and its resume, and one 4-rank launch that builds the engine
for three DP x PP layouts in turn. The priced in-flight activations are checked against torch's
own interleaved schedule, replayed.
"""

import json
import shutil
from pathlib import Path

import pytest

from specs.capabilities import ENGINES, config_shape, runnable_problem
from specs.layout_rules import pipeline_problem
from specs.plan_file import load_plan
from specs.core import Layout, ModelSpec, chunk_layers
from planner.memory import micro_batches_in_flight
from test_trainer import CONFIG, make_plan_file
from test_trainer_parallel import _train_forked
from trainer.recompute import recomputed_layer_indices

FIVE_LAYERS = {**CONFIG, "num_hidden_layers": 5}
UNSPLIT = {"dp": 1, "tp": 1, "pp": 1, "mbs": 1, "gas": 4, "zero": 0, "dtype": "fp32"}
STEPS = 3


# -- the split, the rules and the in-flight counts, against hand-worked examples ---------------


def test_each_device_splits_its_layers_into_vpp_chunks_remainder_on_its_later_chunks() -> None:
    # 5 layers as 3/2 on two devices, two chunks each: device 0 runs virtual stages 0 and 2
    layout = Layout(pp=2, vpp=2, gas=4, stage_layers=[3, 2])
    assert [list(r) for r in chunk_layers(5, layout)] == [[0], [1], [2, 3], [4]]
    assert [list(r) for r in chunk_layers(7, Layout(pp=3))] == [[0, 1], [2, 3], [4, 5, 6]]  # = stages
    assert [len(r) for r in chunk_layers(11, Layout(pp=2, vpp=3, gas=2))] == [1, 2, 2, 2, 2, 2]


def test_recompute_counts_take_each_devices_own_layers_first_chunk_first() -> None:
    layout = Layout(pp=2, vpp=2, gas=4, stage_layers=[3, 2], recompute="full", recompute_layers=[2, 1])
    # device 0 holds 0 | 2 3 and recomputes 0 and 2; device 1 holds 1 | 4 and recomputes 1
    assert recomputed_layer_indices(5, layout) == {0, 1, 2}
    assert recomputed_layer_indices(5, layout.model_copy(update={"recompute_layers": None})) == set(range(5))


@pytest.mark.parametrize("pp, vpp, gas, split, layers, message", [
    (2, 2, 4, [3, 2], 5, None),                                    # uneven interleaving runs
    (2, 3, 4, None, 5, "pp*vpp = 6 exceeds the 5 layers"),
    (2, 2, 3, None, 8, "needs gas divisible by pp"),
    (2, 2, 4, [4, 1], 5, "each device needs at least vpp=2 layers"),
    (4, 1, 2, None, 8, None),                                      # GPipe below pp micro-batches
])
def test_pipeline_rules(pp, vpp, gas, split, layers, message) -> None:
    problem = pipeline_problem(pp, vpp, gas, split, layers)
    assert problem is None if message is None else message in problem


def test_in_flight_micro_batches_follow_the_schedule_that_runs() -> None:
    assert micro_batches_in_flight(1, Layout(pp=4, gas=8)) == 3        # 1F1B: pp - r
    assert micro_batches_in_flight(3, Layout(pp=4, gas=2)) == 2        # GPipe: every forward first
    # torch's interleaved warm-up for rank 0 of pp=2, vpp=2: (vpp-1)pp + 2(pp-1) = 4 chunks, + 1
    assert micro_batches_in_flight(0, Layout(pp=2, vpp=2, gas=4)) == 5 / 2


def _schedule_peak_activations(layout: Layout, layers: int, rank: int, recomputed: set[int], kept: float) -> float:
    """Most activations `rank` holds at once under torch's own interleaved 1F1B order (its action
    list, replayed: a forward adds its chunk's layers, a backward frees them), a layer weighing 1,
    or `kept` when it recomputes."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    schedule = object.__new__(ScheduleInterleaved1F1B)  # the order only: no stages, no process group
    schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = layout.vpp, layout.pp, layout.gas
    schedule.number_of_rounds = max(1, layout.gas // layout.pp)
    schedule.microbatches_per_round = layout.gas // schedule.number_of_rounds
    weight = [sum(kept if i in recomputed else 1.0 for i in chunk) for chunk in chunk_layers(layers, layout)]
    live = peak = 0.0
    for action in filter(None, schedule._calculate_single_rank_operations(rank)):
        if action.computation_type == _ComputationType.FORWARD:
            live += weight[action.stage_index]
            peak = max(peak, live)
        elif action.computation_type == _ComputationType.FULL_BACKWARD:
            live -= weight[action.stage_index]
    return peak


@pytest.mark.parametrize("pp, vpp, gas", [(2, 2, 4), (3, 2, 3), (4, 3, 8), (2, 4, 2)])
def test_priced_in_flight_activations_equal_torchs_schedule_on_even_chunks_and_bound_it_otherwise(pp, vpp, gas) -> None:
    from specs.core import layers_per_stage

    kept = 0.25  # what a recomputed layer keeps, relative to a whole layer's activations
    for layers in range(pp * vpp, 3 * pp * vpp + 1):
        split = Layout(pp=pp, vpp=vpp, gas=gas, recompute="full")
        held = layers_per_stage(layers, split)
        for share in (0.0, 0.5, 1.0):  # of each device's layers recomputed
            counts = [int(share * n) for n in held]
            layout = split.model_copy(update={"stage_layers": held, "recompute_layers": counts})
            recomputed = recomputed_layer_indices(layers, layout)
            for rank, (n, k) in enumerate(zip(held, counts)):
                priced = micro_batches_in_flight(rank, layout) * (n - k + k * kept)
                ran = _schedule_peak_activations(layout, layers, rank, recomputed, kept)
                if n % vpp == 0 and k in (0, n):
                    assert ran == pytest.approx(priced), (layers, rank, k)
                else:  # remainders on a device's later chunks, recomputation on its first ones
                    assert ran <= priced + 1e-9, (layers, rank, k)


def test_the_declaration_admits_interleaving_and_zero3_under_pp() -> None:
    shape = config_shape(FIVE_LAYERS)
    layout = Layout(dp=2, pp=2, vpp=2, gas=4, zero=3, stage_layers=[3, 2], dtype="fp32")
    assert runnable_problem(layout, shape, "cpu") is None
    assert ENGINES["pipeline"].max_vpp >= 2 and 3 in ENGINES["pipeline"].zero_stages
    # FSDP2 shards the optimizer across pipeline replicas, which zero=0 does not price
    whole_replicas = layout.model_copy(update={"zero": 0})
    assert "plan zero>=1" in runnable_problem(whole_replicas, shape, "cpu")
    assert runnable_problem(whole_replicas.model_copy(update={"dp": 1, "gas": 8}), shape, "cpu") is None


@pytest.mark.parametrize("memory_share", [2.0, 1.0, 0.8])
def test_stage_split_ilp_equals_brute_force_for_uneven_interleaved_splits(memory_share) -> None:
    import itertools

    from specs.errors import UsageError
    from planner.cost_model import estimate_from_trace
    from planner.search import StageProgram, _all_coefficients
    from profiler.model_trace import trace_model
    from test_plan_search import SEQ, compositions, hardware

    # a 4k vocabulary makes the last stage (LM head, loss) the heavy one: the best split is 3/2
    model = ModelSpec(name="tiny5", hf_config={**FIVE_LAYERS, "hidden_size": 64, "intermediate_size": 128,
                                               "num_attention_heads": 4, "num_key_value_heads": 4,
                                               "vocab_size": 4096})
    trace = trace_model(model, SEQ, "bf16", attention="eager", device_type="cuda")
    shape = Layout(pp=2, vpp=2, gas=4, recompute="full", dtype="bf16", seq=SEQ)
    roomy = estimate_from_trace(trace, shape.model_copy(update={"stage_layers": [3, 2]}), hardware(1e6))
    hw = hardware(roomy.memory.peak * memory_share / 2**20)
    best = None
    for split in compositions(5, 2):
        for recomputed in itertools.product(*[range(n + 1) for n in split]):
            layout = shape.model_copy(update={"stage_layers": split, "recompute_layers": list(recomputed)})
            try:
                est = estimate_from_trace(trace, layout, hw)
            except UsageError:  # a device with fewer layers than chunks
                continue
            if est.memory.peak <= hw.usable_bytes and (best is None or est.time.step_s < best[0] - 1e-12):
                best = (est.time.step_s, layout)
    chosen = StageProgram(_all_coefficients(trace, shape, hw), shape, trace.num_layers, hw.usable_bytes, 0.0).solve()
    if best is None:
        assert chosen is None
        return
    assert estimate_from_trace(trace, chosen, hw).time.step_s == pytest.approx(best[0], rel=1e-9)
    assert chosen.stage_layers == [3, 2]


# -- pp=2, vpp=2, 5 layers as 3/2, through the real staged loop ---------------------------------


def _five_layer_plan(root: Path, fields: dict) -> Path:
    layout = {**UNSPLIT, **fields}
    path = make_plan_file(root, devices=layout["dp"] * layout["pp"], steps=STEPS, layout_fields=layout)
    plan = load_plan(path)
    plan.model = plan.model.model_copy(update={"hf_config": FIVE_LAYERS})
    plan.write(path)
    return path


def _evals(run_dir: Path) -> list[float]:
    stages = json.loads((run_dir / "summary.json").read_text())["stages"]
    return [loss for stage in stages for loss in stage["eval"].values()]


@pytest.mark.slow
def test_interleaved_uneven_pipeline_matches_the_unsplit_model_and_resumes(tmp_path) -> None:
    import torch.distributed.pipelining  # noqa: F401  (imported before forking)

    reference = _train_forked(_five_layer_plan(tmp_path / "one", {}), tmp_path / "one" / "run")
    plan = _five_layer_plan(tmp_path / "pp", {"pp": 2, "vpp": 2, "stage_layers": [3, 2]})
    run = tmp_path / "pp" / "run"
    losses = _train_forked(plan, run)
    assert len(losses) == 2 * STEPS
    assert losses == pytest.approx(reference, abs=1e-5)
    assert _evals(run) == pytest.approx(_evals(tmp_path / "one" / "run"), abs=1e-5)  # forward through the chunks

    # resume from the first curriculum stage's DCP checkpoint (names independent of the chunking)
    checkpoints = run / "checkpoints"
    assert (checkpoints / f"step-{STEPS:08d}" / "dcp").is_dir()
    shutil.rmtree(checkpoints / f"step-{2 * STEPS:08d}")
    assert _train_forked(plan, run, resume=True) == losses


# -- DP x PP on 4 ranks: ZeRO-1/2/3 as priced, recompute counts per device ----------------------

DP_PP = {"dp": 2, "pp": 2, "mbs": 1, "gas": 2, "dtype": "fp32"}
DP_PP_LAYOUTS = {
    # 5 layers as 3/2; ZeRO-3 gathers every layer for each micro-batch's forward and backward
    "zero3": {"zero": 3, "stage_layers": [3, 2]},
    # even split 2/3, chunks [0] [1] | [2] [3 4]: device 0 recomputes layer 0, device 1 layers 1 and 3
    "zero2_interleaved_recompute": {"zero": 2, "vpp": 2, "recompute": "full", "recompute_layers": [1, 2]},
    "zero1_interleaved": {"zero": 1, "vpp": 2, "stage_layers": [3, 2]},
}
LR = 1e-2


def _batches():
    import torch

    generator = torch.Generator().manual_seed(0)
    return [[torch.randint(0, CONFIG["vocab_size"], (1, 16), generator=generator) for _ in range(4)]
            for _ in range(STEPS)]


def _observe(model) -> tuple[dict, set]:
    """Forward calls per decoder layer (a recomputed layer runs twice per micro-batch), and whether
    a layer's weights are sharded DTensors right after its forward (hooks run after FSDP's own)."""
    import torch
    from torch.distributed.tensor import DTensor

    forwards: dict[str, int] = {}
    sharded: set[bool] = set()
    for key, layer in model.model.layers.items():
        def count(module, args, key=key):
            forwards[key] = forwards.get(key, 0) + 1

        def check(module, args, output):
            if torch.is_grad_enabled():
                sharded.add(isinstance(module.self_attn.q_proj.weight, DTensor))
        # transformers checkpoints a layer's `forward`, so only hooks inside it see the recompute,
        # and a pre-hook: the recompute stops early, once the last saved tensor is rebuilt
        layer.mlp.register_forward_pre_hook(count)
        layer.register_forward_hook(check)
    return forwards, sharded


def _run_layout(layout: Layout, reduces: list[int]) -> dict:
    from trainer.engines import make_engine
    from trainer.model import build_model

    model = build_model(ModelSpec(name="tiny", hf_config=FIVE_LAYERS), layout, seed=0)
    engine = make_engine(model, layout, None, clip=1.0)
    forwards, sharded = _observe(model)
    losses, reduced = [], []
    for step, batch in enumerate(_batches()):
        if step == 1:
            forwards.clear()  # the first step also infers the stages' shapes
        reduces[0] = 0
        for j in range(layout.gas):
            loss = engine.micro_step(batch[engine.data_rank * layout.gas + j])
        losses.append(loss)
        reduced.append(reduces[0])
        engine.optimizer_step(LR)
    whole = sum(p.numel() for p in model.parameters())  # a DTensor counts its global size
    return {"losses": losses, "forwards": forwards, "sharded": sorted(sharded), "reduces": reduced,
            "layers": sorted(int(k) for k in model.model.layers), "data_rank": engine.data_rank,
            "stage": engine.stage_index, "state": engine.state_bytes(), "device_params": whole}


def _rank_dp_pp(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    from profiler.ranks import finish_rank, init_rank

    init_rank(rank, world, port, distributed=True, threads=1)
    reduces = [0]
    reduce = param_group.foreach_reduce

    def counted(*args, **kwargs):  # one call per FSDP parameter group and gradient reduction
        reduces[0] += 1
        return reduce(*args, **kwargs)

    param_group.foreach_reduce = counted
    results = {name: _run_layout(Layout(**{**DP_PP, **fields}), reduces) for name, fields in DP_PP_LAYOUTS.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finish_rank(True)


def _unsplit_losses() -> list[float]:
    """One process, the four micro-batches of each step on the whole model."""
    from trainer.engines import make_engine
    from trainer.model import build_model

    layout = Layout(**UNSPLIT)
    engine = make_engine(build_model(ModelSpec(name="tiny", hf_config=FIVE_LAYERS), layout, seed=0), layout,
                         None, clip=1.0)
    losses = []
    for batch in _batches():
        losses.append(sum(engine.micro_step(b) for b in batch) / len(batch))
        engine.optimizer_step(LR)
    return losses


@pytest.mark.slow
def test_dp_x_pp_runs_zero_1_2_3_and_recompute_counts_as_priced(tmp_path) -> None:
    import torch.distributed.fsdp  # noqa: F401  (imported before forking)
    import torch.distributed.pipelining  # noqa: F401

    from profiler.ranks import free_port, launch

    reference = _unsplit_losses()
    launch(_rank_dp_pp, 4, (4, free_port(), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name, fields in DP_PP_LAYOUTS.items():
        layout = Layout(**{**DP_PP, **fields})
        last = [r[name] for r in ranks if r[name]["stage"] == 1]
        replica_mean = [sum(r["losses"][s] for r in last) / 2 for s in range(STEPS)]
        assert replica_mean == pytest.approx(reference, abs=1e-5), name

        recomputed = recomputed_layer_indices(5, layout)
        for r in ranks:
            held = r[name]
            # weights: ZeRO-3 sharded again right after each forward; ZeRO-1/2 stay gathered
            assert held["sharded"] == [layout.zero == 3], name
            # gradients: ZeRO-2/3 reduce-scatter every micro-batch, ZeRO-1 once per step, one
            # reduction per FSDP group: each decoder layer, plus the embedding or the head group
            groups = len(held["layers"]) + 1
            assert held["reduces"][1:] == [groups * (layout.gas if layout.zero >= 2 else 1)] * (STEPS - 1), name
            # recomputed layers run forward twice per micro-batch (2 steps x gas micro-batches)
            runs = 2 * layout.gas
            assert held["forwards"] == {str(i): runs * (2 if i in recomputed else 1) for i in held["layers"]}, name
            # at rest the weights are sharded over the 2 replicas (FSDP2), fp32
            assert held["state"]["parameters"] == 4 * held["device_params"] // 2, name
    assert recomputed_layer_indices(5, Layout(**{**DP_PP, **DP_PP_LAYOUTS["zero2_interleaved_recompute"]})) == {0, 1, 3}
