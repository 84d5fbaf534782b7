"""Sequence parallelism with tensor parallelism (fsdp2 and pipeline engines) against the unsplit
model: the same gradients after one micro-batch (the norms' weights included, whose per-rank
gradients are partial), and the same per-step losses on the same global batch through the real
staged loop."""

import sys
from pathlib import Path

import pytest
import torch

from specs.core import Layout, ModelSpec
from test_trainer import CONFIG
from test_trainer_parallel import STEPS, _plan, _train_forked, unsplit_losses  # noqa: F401 (fixture)

SEQ = 15  # odd: the two sequence shards are uneven (8 and 7 tokens)


def _batch() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(0))


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """This rank's gradient as the optimizer will read it: TP shards gathered, but a partial
    gradient left as this rank's own part (full_tensor would sum it)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(grad, DTensor):
        return grad
    return grad.full_tensor() if any(isinstance(p, Shard) for p in grad.placements) else grad.to_local()


def _rank_gradients(rank: int, world: int, port: int, out: str) -> None:
    from profiler.ranks import finish_rank, init_rank
    from trainer.engines.sharded import ShardedEngine
    from trainer.model import build_model
    from trainer.parallelize import reduce_partial_gradients

    init_rank(rank, world, port, distributed=True, threads=1)
    layout = Layout(tp=2, sp=1, mbs=2, gas=1, dtype="fp32", seq=SEQ)
    model = build_model(ModelSpec(name="tiny", hf_config=CONFIG), layout, seed=0)
    engine = ShardedEngine(model, layout, clip=1.0)
    engine.micro_step(_batch())
    reduce_partial_gradients(engine.params)
    grads = {name: _whole(p.grad) for name, p in model.named_parameters()}
    if rank == 0:
        torch.save(grads, out)
    del engine, model
    finish_rank(True)


@pytest.mark.slow
def test_sequence_parallel_gradients_match_the_unsplit_model(tmp_path) -> None:
    from profiler.ranks import free_port, launch
    from trainer.model import build_filled_model

    out = tmp_path / "grads.pt"
    launch(_rank_gradients, 2, (2, free_port(), str(out)))
    split = torch.load(out, weights_only=True)
    model = build_filled_model(ModelSpec(name="tiny", hf_config=CONFIG), Layout(dtype="fp32", mbs=2, seq=SEQ), seed=0)
    ids = _batch()
    model(input_ids=ids, labels=ids).loss.backward()
    assert set(split) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(split[name], param.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_sequence_parallel_matches_the_unsplit_model(tmp_path, unsplit_losses) -> None:  # noqa: F811
    # norms on sequence shards, q/k/v on the all-gathered sequence, o/down reduce-scattered
    losses = _train_forked(_plan(tmp_path, {"tp": 2, "sp": True}), tmp_path / "run")
    assert len(losses) == len(unsplit_losses) == 2 * STEPS
    assert losses == pytest.approx(unsplit_losses, abs=1e-5)


@pytest.mark.slow
def test_sequence_parallel_inside_pipeline_stages_matches_the_unsplit_model(tmp_path,
                                                                          unsplit_losses) -> None:  # noqa: F811
    # 2 stages x tp 2 (4 ranks): each stage cuts its received sequence and gathers what it sends
    plan = _plan(tmp_path, {"pp": 2, "tp": 2, "sp": True, "stage_layers": [1, 1]})
    losses = _train_forked(plan, tmp_path / "run")
    assert losses == pytest.approx(unsplit_losses, abs=1e-5)
