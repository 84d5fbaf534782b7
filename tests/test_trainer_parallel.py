"""Tensor, pipeline and FSDP2 engines against the unsplit model: the same per-step losses on the
same global batch, exact resume from their DCP checkpoints, and one-line errors for what they
cannot split.

Ranks are forked from this process after it has imported and built the model code once
(docs/notes-cpu-stack.md, "Time"); each rank runs the real staged loop (`trainer.loop.train`).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specs.errors import UsageError
from specs.plan_file import load_plan
from specs.core import Layout, ModelSpec, layers_per_stage
from test_trainer import CONFIG, _free_port, make_plan_file, read_jsonl

UNSPLIT = {"dp": 1, "tp": 1, "pp": 1, "mbs": 1, "gas": 4, "zero": 0, "dtype": "fp32"}
STEPS = 3  # optimizer steps per curriculum stage (two stages)


def _rank_train(rank: int, world: int, port: int, plan_path: str, run_dir: str, resume: bool) -> None:
    from trainer.loop import TrainOptions, train
    from profiler.ranks import finish_rank, init_rank

    init_rank(rank, world, port, distributed=world > 1, threads=1)
    train(load_plan(plan_path), Path(run_dir), resume, TrainOptions(show_progress=False))
    finish_rank(world > 1)


def _plan(root: Path, fields: dict, engine: str = "auto") -> Path:
    layout = {**UNSPLIT, **fields}
    path = make_plan_file(root, devices=layout["dp"] * layout["tp"] * layout["pp"], steps=STEPS,
                          layout_fields=layout)
    plan = load_plan(path)
    plan.engine = engine
    plan.write(path)
    return path


def _train_forked(plan: Path, run_dir: Path, resume: bool = False) -> list[float]:
    from profiler.ranks import free_port, launch

    world = load_plan(plan).chosen.layout.devices
    launch(_rank_train, world, (world, free_port(), str(plan), str(run_dir), resume))
    return [m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def unsplit_losses(tmp_path_factory) -> list[float]:
    """One process, 4 micro-batches of 1 sequence per step. Also warms this parent: the model
    code is imported and built once here instead of in every forked rank (~20 s each)."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    from trainer.model import build_model

    build_model(ModelSpec(name="tiny", hf_config=CONFIG), Layout(**UNSPLIT), seed=0)
    root = tmp_path_factory.mktemp("unsplit")
    return _train_forked(_plan(root, {}), root / "run")


@pytest.mark.slow
def test_tensor_parallel_matches_the_unsplit_model(tmp_path, unsplit_losses) -> None:
    # q/k/v/gate/up split by columns, o/down by rows: one head and half the MLP per rank
    losses = _train_forked(_plan(tmp_path, {"tp": 2}), tmp_path / "run")
    assert len(losses) == len(unsplit_losses) == 2 * STEPS
    assert losses == pytest.approx(unsplit_losses, abs=1e-5)


@pytest.mark.slow
def test_pipeline_matches_the_unsplit_model_and_resumes_from_a_stage_checkpoint(tmp_path, unsplit_losses) -> None:
    # 2 stages of one decoder layer, 1F1B over the step's 4 micro-batches
    plan = _plan(tmp_path, {"pp": 2, "stage_layers": [1, 1]})
    losses = _train_forked(plan, tmp_path / "run")
    assert losses == pytest.approx(unsplit_losses, abs=1e-5)
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"math"' in summary  # both curriculum stages evaluated through the pipeline

    # resume from the first curriculum stage's end: the second stage is redone identically
    checkpoints = tmp_path / "run" / "checkpoints"
    assert (checkpoints / f"step-{STEPS:08d}" / "dcp").is_dir()
    shutil.rmtree(checkpoints / f"step-{2 * STEPS:08d}")
    resumed = _train_forked(plan, tmp_path / "run", resume=True)
    assert resumed == losses


@pytest.mark.slow
def test_fsdp2_two_ranks_match_one_rank_with_twice_the_accumulation(tmp_path, unsplit_losses) -> None:
    losses = _train_forked(_plan(tmp_path, {"dp": 2, "gas": 2, "zero": 3}, engine="fsdp2"), tmp_path / "run")
    assert losses == pytest.approx(unsplit_losses, abs=1e-5)
    assert (tmp_path / "run" / "checkpoints" / f"step-{2 * STEPS:08d}" / "dcp").is_dir()  # DCP, not DeepSpeed's


@pytest.mark.slow
def test_advisor_train_runs_a_tensor_parallel_plan_through_torchrun(tmp_path, unsplit_losses) -> None:
    plan = _plan(tmp_path, {"tp": 2})
    command = [sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(tmp_path / "run"),
               "--master-port", str(_free_port()), "--engine", "fsdp2"]
    proc = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert losses == pytest.approx(unsplit_losses, abs=1e-5)
    assert load_plan(tmp_path / "run" / "plan.yaml").engine == "fsdp2"  # the override is recorded


# -- what the engines refuse, in one line, before any process group exists ----------------------


def _tiny_model(**overrides):
    from trainer.model import build_model

    return build_model(ModelSpec(name="tiny", hf_config={**CONFIG, **overrides}), Layout(**UNSPLIT), seed=0)


@pytest.mark.parametrize("layout, config, message", [
    ({"tp": 4}, {"num_attention_heads": 2}, "tp=4 does not divide the 2 attention heads"),
    ({"tp": 2}, {"num_attention_heads": 4, "num_key_value_heads": 1}, "the model's 1 key/value heads"),
    ({"tp": 2}, {"intermediate_size": 63}, "does not divide the MLP width 63"),
    ({"pp": 3}, {}, "pp=3 exceeds the 2 decoder layers"),
    ({"pp": 2, "method": "lora"}, {}, "method=lora is not run by the pipeline engine"),
    ({"pp": 2}, {"tie_word_embeddings": True}, "tied input/output embeddings"),
])
def test_unsupported_splits_fail_with_one_clear_line(layout, config, message) -> None:
    from trainer.engines import make_engine

    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        make_engine(_tiny_model(**config), Layout(**{**UNSPLIT, **layout}), None, clip=1.0)
    assert "\n" not in str(error.value)


def test_backend_selection_follows_the_plan_engine_field() -> None:
    from trainer.engines import select_backend

    assert select_backend(Layout(dp=2, zero=3)) == "deepspeed"
    assert select_backend(Layout(dp=2, zero=3), "fsdp2") == "fsdp2"
    assert select_backend(Layout(dp=2, tp=2, zero=1)) == "fsdp2"  # DeepSpeed has no TP here: FSDP2
    assert select_backend(Layout(pp=2, gas=4)) == "pipeline"
    assert select_backend(Layout(dp=2)) == "plain"
    with pytest.raises(UsageError, match="engine=deepspeed runs data parallelism and ZeRO only"):
        select_backend(Layout(tp=2), "deepspeed")


def test_pipeline_stages_follow_the_plan_split_else_an_even_one() -> None:
    assert layers_per_stage(4, Layout(pp=2, stage_layers=[3, 1])) == [3, 1]
    assert layers_per_stage(7, Layout(pp=3)) == [2, 2, 3]  # the remainder goes to later stages


# -- what each rank holds: parameters, gradients and optimizer state ----------------------------

SHARDED = {**UNSPLIT, "dp": 2, "gas": 1, "zero": 3}
ZERO3_CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "steps_per_print": 1_000_000}


def _one_step_state_bytes(layout: Layout, choice: str, config: dict | None) -> tuple[dict, dict]:
    """state_bytes after one micro-batch's backward (gradients held) and after the optimizer step
    (Adam's states exist)."""
    import torch

    from trainer.engines import Engine, make_engine
    from trainer.model import build_model

    model = build_model(ModelSpec(name="tiny", hf_config=CONFIG), layout, seed=0)
    engine = make_engine(model, layout, config, clip=1.0, engine=choice)
    assert isinstance(engine, Engine)  # the declared contract, data_rank and model included
    engine.micro_step(torch.randint(0, CONFIG["vocab_size"], (1, 16)))
    after_backward = engine.state_bytes()
    engine.optimizer_step(1e-3)
    return after_backward, engine.state_bytes()


def _rank_state_bytes(rank: int, world: int, port: int, choice: str, out_dir: str) -> None:
    import json

    from profiler.ranks import finish_rank, init_rank

    init_rank(rank, world, port, distributed=True, threads=1)
    held = _one_step_state_bytes(Layout(**SHARDED), choice, ZERO3_CONFIG)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(held))
    finish_rank(True)


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["deepspeed", "fsdp2"])
def test_zero3_on_two_ranks_holds_half_of_each_model_state(tmp_path, choice) -> None:
    import json

    import deepspeed  # noqa: F401  (imported before forking: the ranks inherit it loaded)

    from profiler.ranks import free_port, launch
    from trainer.model import build_model

    # the independent count: the model's own parameter count, 4 bytes each in fp32
    n = sum(p.numel() for p in build_model(ModelSpec(name="tiny", hf_config=CONFIG), Layout(**UNSPLIT), 0).parameters())
    backward, stepped = _one_step_state_bytes(Layout(**{**UNSPLIT, "gas": 1}), "auto", None)
    tensors = len(list(build_model(ModelSpec(name="tiny", hf_config=CONFIG), Layout(**UNSPLIT), 0).parameters()))
    # one process: whole weights and gradients; Adam's two moments plus a 4-byte step per tensor
    assert (stepped["parameters"], backward["gradients"]) == (4 * n, 4 * n)
    assert stepped["optimizer"] == 8 * n + 4 * tensors
    assert stepped["gradients"] == 0  # freed by the step

    launch(_rank_state_bytes, 2, (2, free_port(), choice, str(tmp_path)))
    for rank in range(2):
        backward, stepped = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert stepped["parameters"] == 4 * n // 2
        assert backward["gradients"] == 4 * n // 2
        # Adam's moments of the local shard (in fp32 DeepSpeed's ZeRO-3 master partition is the
        # parameter partition itself) plus a step counter per local tensor or flat group
        assert stepped["optimizer"] == pytest.approx(8 * n // 2, abs=4 * tensors)
