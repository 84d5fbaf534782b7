"""Conformance: what `advisor plan` chooses, `advisor train` runs, and it computes what the unsplit
model computes.

Hypothesis draws a model of one of three families (Llama with full multi-head attention, Qwen2
with grouped key/value heads and tied embeddings, Mistral with grouped heads), 1-4 CPU ranks, a
global batch and random `--fix` constraints. The planner chooses under those constraints; the
chosen layout trains 3 optimizer steps on forked ranks running the real loop
(`trainer.loop.train`, as torchrun's workers do), and its fp32 losses must equal a 1-process
unsplit run of the same model within 1e-5. Pinned examples make sure every feature the
declaration (`specs/capabilities.py`) allows is covered whatever Hypothesis draws.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specs.capabilities import ENGINES, config_shape, runnable_problem
from specs.errors import UsageError
from specs.plan_file import Plan, load_plan
from specs.core import Layout, ModelSpec
from specs.task import TaskSpec
from planner.plan import PlanOptions, make_plan
from presets import load_hardware

STEPS = 3
SEQ = 32
BASE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 272,
        "max_position_embeddings": 128}
FAMILIES = {
    "llama": {**BASE, "model_type": "llama", "num_key_value_heads": 4, "tie_word_embeddings": False},
    "qwen2": {**BASE, "model_type": "qwen2", "num_key_value_heads": 2, "tie_word_embeddings": True},
    "mistral": {**BASE, "model_type": "mistral", "num_key_value_heads": 2, "tie_word_embeddings": False,
                "sliding_window": None},
}
WORDS = "the cat sat on a mat and dog ran to big red house with green tree".split()


def model_spec(family: str, layers: int) -> ModelSpec:
    return ModelSpec(name=f"{family}-{layers}", hf_config={**FAMILIES[family], "num_hidden_layers": layers})


@functools.lru_cache(maxsize=None)
def _data_dir() -> Path:
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="conformance-data-"))
    rng = random.Random(0)
    with open(root / "text.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(40))}) + "\n")
    return root


def task(global_batch: int) -> TaskSpec:
    return TaskSpec.model_validate({
        "name": "conformance", "seq_len": SEQ, "global_batch": global_batch, "base_dir": str(_data_dir()),
        "stages": [{"name": "only", "sources": [{"path": "text.jsonl"}], "steps": STEPS, "lr": 3e-3,
                    "warmup_steps": 1}]})


def choose(model: ModelSpec, ranks: int, batch: int, fixed: dict, method: str = "full") -> Plan:
    """The planner's choice for `ranks` CPU devices under the `--fix` constraints."""
    return make_plan(PlanOptions(model=model, hardware=load_hardware("cpu"), gpus_per_node=ranks, task=task(batch),
                                 method=method, min_compute_fraction=0.0, fix=dict(fixed)))


def pinned(model: ModelSpec, layout: Layout, engine: str = "auto") -> Plan:
    """A plan whose every stage runs exactly `layout` (the pinned coverage examples)."""
    plan = make_plan(PlanOptions(model=model, hardware=load_hardware("cpu"), gpus_per_node=layout.devices,
                                 task=task(layout.global_batch), min_compute_fraction=0.0))
    plan.engine = engine  # type: ignore[assignment]
    plan.chosen.layout = layout
    for stage in plan.stages:
        stage.layout = layout
    return plan


def _rank_train(rank: int, world: int, port: int, plan_path: str, run_dir: str) -> None:
    from profiler.ranks import finish_rank, init_rank
    from trainer.loop import TrainOptions, train

    init_rank(rank, world, port, distributed=world > 1, threads=1)
    train(load_plan(plan_path), Path(run_dir), False, TrainOptions(show_progress=False))
    finish_rank(world > 1)


def train_losses(plan: Plan, root: Path) -> list[float]:
    from profiler.ranks import free_port, launch

    root.mkdir(parents=True, exist_ok=True)
    plan.write(root / "plan.yaml")
    world = plan.chosen.layout.devices
    launch(_rank_train, world, (world, free_port(), str(root / "plan.yaml"), str(root / "run")))
    return [json.loads(line)["loss"] for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]


def unsplit(layout: Layout) -> Layout:
    """The same step on one process: every sequence of the global batch as one micro-batch each."""
    return Layout(dp=1, tp=1, pp=1, mbs=1, gas=layout.global_batch, zero=0, recompute="none",
                  method=layout.method, lora_rank=layout.lora_rank, dtype=layout.dtype, seq=layout.seq)


_REFERENCES: dict[tuple, list[float]] = {}


def reference_losses(model: ModelSpec, layout: Layout, root: Path) -> list[float]:
    key = (json.dumps(model.hf_config, sort_keys=True), unsplit(layout).short())
    if key not in _REFERENCES:
        _REFERENCES[key] = train_losses(pinned(model, unsplit(layout)), root / "reference")
    return _REFERENCES[key]


def assert_conforms(plan: Plan, root: Path) -> None:
    layout = plan.chosen.layout
    shape = config_shape(plan.model.hf_config)
    assert runnable_problem(layout, shape, "cpu", plan.engine) is None  # the planner chose what runs
    losses = train_losses(plan, root / "split")
    expected = reference_losses(plan.model, layout, root)
    assert len(losses) == len(expected) == STEPS
    tolerance = 1e-5 if layout.dtype == "fp32" else 2e-2  # QLoRA computes in bf16: same layout on 1 process
    assert losses == pytest.approx(expected, abs=tolerance), layout.short()


@pytest.fixture(scope="module", autouse=True)
def _warm_parent():
    """Import and build the model code once in this process; forked ranks inherit it."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401

    from trainer.model import build_model

    build_model(model_spec("llama", 2), Layout(dtype="fp32", seq=SEQ), seed=0)


# -- pinned examples: every feature the declaration allows ------------------------------------------

PINNED = [
    ("dp2-ddp", "llama", 2, {"dp": 2, "gas": 2}, "auto"),
    ("zero1-deepspeed", "llama", 2, {"dp": 2, "gas": 2, "zero": 1}, "auto"),
    ("zero2-deepspeed", "qwen2", 2, {"dp": 2, "gas": 2, "zero": 2}, "auto"),
    ("zero3-deepspeed", "mistral", 2, {"dp": 2, "gas": 2, "zero": 3}, "auto"),
    ("zero1-fsdp2", "llama", 2, {"dp": 2, "gas": 2, "zero": 1}, "fsdp2"),
    ("zero2-fsdp2", "mistral", 2, {"dp": 2, "gas": 2, "zero": 2}, "fsdp2"),
    ("zero3-fsdp2", "qwen2", 2, {"dp": 2, "gas": 2, "zero": 3}, "fsdp2"),
    ("offload", "llama", 2, {"dp": 2, "gas": 2, "zero": 2, "offload": "optimizer"}, "auto"),
    ("tp2-sp", "mistral", 2, {"tp": 2, "sp": True, "gas": 4}, "auto"),
    ("dp2-tp2", "llama", 2, {"dp": 2, "tp": 2, "gas": 2, "zero": 1}, "auto"),
    ("dp2-pp2", "mistral", 3, {"dp": 2, "pp": 2, "gas": 2, "zero": 1, "stage_layers": [2, 1]}, "auto"),
    ("dp2-pp2-zero3", "llama", 4, {"dp": 2, "pp": 2, "gas": 2, "zero": 3, "stage_layers": [3, 1]}, "auto"),
    ("pp2-tp2", "llama", 2, {"pp": 2, "tp": 2, "gas": 4}, "auto"),
    ("pp2-vpp2-uneven", "llama", 5, {"pp": 2, "vpp": 2, "gas": 4, "stage_layers": [3, 2]}, "auto"),
    ("selective", "qwen2", 2, {"gas": 4, "recompute": "selective"}, "auto"),
    ("per-stage-recompute", "llama", 4, {"pp": 2, "gas": 4, "recompute": "full", "recompute_layers": [1, 2]}, "auto"),
    ("lora", "llama", 2, {"dp": 2, "gas": 2, "method": "lora", "lora_rank": 4}, "auto"),
    ("qlora", "llama", 2, {"dp": 2, "gas": 2, "method": "qlora", "lora_rank": 4, "dtype": "bf16"}, "auto"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, family, layers, fields, engine", PINNED, ids=[p[0] for p in PINNED])
def test_pinned_layout_runs_and_matches_the_unsplit_model(tmp_path, name, family, layers, fields, engine) -> None:
    model = model_spec(family, layers)
    layout = Layout(**{"dtype": "fp32", "seq": SEQ, "mbs": 1, **fields})
    problem = runnable_problem(layout, config_shape(model.hf_config), "cpu", engine)
    # a pinned feature the declaration stops allowing fails here: remove its example on purpose, never quietly
    assert problem is None, f"{name}: the declaration no longer runs a pinned feature: {problem}"
    assert_conforms(pinned(model, layout, engine), tmp_path)


# -- drawn: the planner chooses under random constraints --------------------------------------------

@st.composite
def requests(draw):
    family = draw(st.sampled_from(sorted(FAMILIES)))
    layers = draw(st.integers(2, 5))
    ranks = draw(st.sampled_from([1, 2, 4]))
    batch = draw(st.sampled_from([4, 8]))
    fixed: dict = {}
    if ranks > 1:
        tp = draw(st.sampled_from([1, 2]))
        pp = draw(st.sampled_from([1, 2])) if ranks // tp > 1 else 1
        if draw(st.booleans()):
            fixed.update(tp=tp, pp=pp)
        if draw(st.booleans()):
            fixed["zero"] = draw(st.sampled_from([0, 1, 2, 3]))
    if draw(st.booleans()):
        fixed["mbs"] = draw(st.sampled_from([1, 2]))
    if ranks > 1 and draw(st.booleans()):
        fixed["sp"] = draw(st.booleans())
    return family, layers, ranks, batch, fixed


@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=requests())
def test_the_planners_choice_under_random_fixes_runs_and_matches_the_unsplit_model(tmp_path_factory, request) -> None:
    family, layers, ranks, batch, fixed = request
    model = model_spec(family, layers)
    try:
        plan = choose(model, ranks, batch, fixed)
    except UsageError as refusal:  # a fix the trainer cannot run is refused with its reason
        assert "\n" not in str(refusal)
        return
    for key, value in fixed.items():
        assert getattr(plan.chosen.layout, key) == value, (key, plan.chosen.layout.short())
    assert_conforms(plan, tmp_path_factory.mktemp("drawn"))


def test_the_declaration_names_an_engine_for_every_feature_the_pinned_examples_cover() -> None:
    """The pinned list above is the coverage of issue 13; a feature the declaration allows but no
    pinned example exercises would be allowed untested."""
    allowed = {"sp": any(e.sequence_parallel for e in ENGINES.values()),
               "vpp": any(e.max_vpp > 1 for e in ENGINES.values()),
               "selective": any("selective" in e.recompute for e in ENGINES.values()),
               "qlora": any(e.qlora_devices for e in ENGINES.values())}
    covered = {"sp": "tp2-sp", "vpp": "pp2-vpp2-uneven", "selective": "selective", "qlora": "qlora"}
    names = {p[0] for p in PINNED}
    assert all(covered[f] in names for f, on in allowed.items() if on)


# -- a stage with its own sequence length (issue 18): its own layout, planned and run --------------

def _stages_with_their_own_seq(global_batch: int) -> TaskSpec:
    """Short sequences first, then the task's: the planner gives the first stage its own layout."""
    only = task(global_batch).stages[0]
    return task(global_batch).model_copy(update={"stages": [
        only.model_copy(update={"name": "short", "seq_len": SEQ // 2}), only.model_copy(update={"name": "long"})]})


def _cli_train_losses(plan: Plan, root: Path) -> list[tuple[str, float]]:
    """`advisor train` itself: a plan of several segments runs them one launch each (trainer/launch.py)."""
    import os
    import subprocess
    import sys

    root.mkdir(parents=True, exist_ok=True)
    plan.write(root / "plan.yaml")
    done = subprocess.run([sys.executable, "-m", "advisor.cli", "train", str(root / "plan.yaml"), "--out",
                           str(root / "run")], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [(m["stage"], m["loss"]) for m in map(json.loads, (root / "run" / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_a_stage_with_its_own_sequence_length_runs_as_planned_and_matches_the_unsplit_model(tmp_path) -> None:
    plan = make_plan(PlanOptions(model=model_spec("llama", 2), hardware=load_hardware("cpu"), gpus_per_node=2,
                                 task=_stages_with_their_own_seq(4), min_compute_fraction=0.0))
    short, long = (stage.layout for stage in plan.stages)
    assert (short.seq, long.seq) == (SEQ // 2, SEQ)
    assert short.global_batch * short.seq == long.global_batch * long.seq  # the task's tokens per step
    assert short.devices == long.devices == 2  # split, so the unsplit run below is another computation
    for stage in plan.stages:
        assert runnable_problem(stage.layout, config_shape(plan.model.hf_config), "cpu", plan.engine) is None

    reference = plan.model_copy(deep=True)  # the same stages, each on one process, unsplit
    reference.chosen.layout = unsplit(plan.chosen.layout)
    for stage in reference.stages:
        stage.layout, stage.devices = unsplit(stage.layout), 1
    measured = _cli_train_losses(plan, tmp_path / "split")
    expected = _cli_train_losses(reference, tmp_path / "reference")
    assert [s for s, _ in measured] == [s for s, _ in expected] == ["short"] * STEPS + ["long"] * STEPS
    assert [v for _, v in measured] == pytest.approx([v for _, v in expected], abs=1e-5)
