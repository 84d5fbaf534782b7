"""Selective recomputation as torch's op-level policy: it changes no gradient, its measured peak
lies strictly between no recomputation and full recomputation, and each mode's peak matches the
cost model's prediction.

The peak is the CPU allocator's high-water mark (the counting allocator of
`bench/measure_memory.py`, the CPU analogue of `torch.cuda.max_memory_allocated`) over the second
training step of `advisor train`'s plain engine, one forked process per mode.

    PYTHONPATH=$PWD python tests/test_recompute.py   # prints the table
"""

import json
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

from specs.core import SELECTIVE_SAVED_OPS, Layout, ModelSpec
from test_trainer_parallel import unsplit_losses  # noqa: F401 (fixture)
from trainer.recompute import recomputed_layer_indices

# Small enough for a test, large enough that activations dominate the weights.
CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 2048,
          "max_position_embeddings": 512, "tie_word_embeddings": False}
SPEC = ModelSpec(name="recompute-probe", hf_config=CONFIG)
SEQ, MBS = 256, 4
MODES = ("none", "selective", "full")


def _layout(mode: str) -> Layout:
    return Layout(dtype="fp32", seq=SEQ, mbs=MBS, gas=1, recompute=mode)


def _batch() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (MBS, SEQ), generator=torch.Generator().manual_seed(0))


def _measure(rank: int, mode: str, out: str, timed: bool) -> None:
    """One process: two training steps, the allocator's peak over the second (Adam states exist);
    when `timed`, the median time of three more."""
    # deferred: the benchmark module imports DeepSpeed, needed only by this measurement
    from bench.measure_memory import load_alloc_hook
    from trainer.engines.plain import PlainEngine
    from trainer.model import build_model

    torch.set_num_threads(1)
    hook = load_alloc_hook()
    hook.install()
    engine = PlainEngine(build_model(SPEC, _layout(mode), seed=0), _layout(mode), clip=1.0)
    batch = _batch()
    peak = second_step_peak(engine, batch, hook)
    seconds = []
    for _ in range(3 if timed else 0):
        start = time.perf_counter()
        engine.micro_step(batch)
        engine.optimizer_step(1e-3)
        seconds.append(time.perf_counter() - start)
    Path(out).write_text(json.dumps({"peak": peak, "step_s": statistics.median(seconds) if seconds else None}))


def second_step_peak(engine, batch: torch.Tensor, hook) -> int:
    """The allocator's peak over a training step after a first one (Adam's states exist by then)."""
    engine.micro_step(batch)
    engine.optimizer_step(1e-3)
    hook.reset_peak()
    engine.micro_step(batch)
    engine.optimizer_step(1e-3)
    return hook.peak_bytes()


def measure(mode: str, tmp: Path, timed: bool = False) -> dict:
    from profiler.ranks import launch

    out = tmp / f"{mode}.json"
    launch(_measure, 1, (mode, str(out), timed))
    return json.loads(out.read_text())


def predicted(mode: str):
    from planner.cost_model import estimate
    from presets import load_hardware

    return estimate(SPEC, load_hardware("cpu"), _layout(mode))


def test_selective_policy_changes_no_gradient() -> None:
    from trainer.model import build_filled_model

    grads = {}
    for mode in ("none", "selective"):
        model = build_filled_model(SPEC.model_copy(update={"hf_config": {**CONFIG, "num_hidden_layers": 2}}),
                            Layout(dtype="fp32", seq=64, recompute=mode), seed=0)
        ids = _batch()[:2, :64]
        model(input_ids=ids, labels=ids).loss.backward()
        grads[mode] = [p.grad for p in model.parameters()]
    for selective, none in zip(grads["selective"], grads["none"]):
        torch.testing.assert_close(selective, none, rtol=0, atol=0)


def test_per_stage_recompute_counts_pick_each_stage_s_first_layers() -> None:
    layout = Layout(pp=2, stage_layers=[3, 2], recompute="selective", recompute_layers=[1, 2], mbs=1, gas=2)
    assert recomputed_layer_indices(5, layout) == {0, 3, 4}


def test_the_policy_names_only_aten_ops() -> None:
    assert all(hasattr(torch.ops.aten, name) for name in SELECTIVE_SAVED_OPS if "cudnn" not in name)


@pytest.mark.slow
def test_selective_peak_lies_between_none_and_full_and_matches_the_prediction(tmp_path) -> None:
    measured = {mode: measure(mode, tmp_path)["peak"] for mode in MODES}
    assert measured["full"] < measured["selective"] < measured["none"]
    for mode in MODES:
        assert predicted(mode).memory.peak == pytest.approx(measured[mode], rel=0.10), mode


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    with tempfile.TemporaryDirectory() as tmp:
        print("mode       peak measured  predicted  pred/meas | step measured  predicted (uncalibrated cpu preset)")
        for mode in MODES:
            got, want = measure(mode, Path(tmp), timed=True), predicted(mode)
            print(f"{mode:9s} {got['peak'] / 2**20:9.2f} MiB {want.memory.peak / 2**20:7.2f} MiB "
                  f"{want.memory.peak / got['peak']:8.3f} | {got['step_s']:9.3f} s {want.time.step_s:9.3f} s")


# Selective recomputation on every engine against the unsplit model without recomputation:
# pipeline stages (per-stage counts: only the first stage's layer), DeepSpeed ZeRO-3, TP with sp.
ENGINE_LAYOUTS = {
    "pipeline": ({"pp": 2, "stage_layers": [1, 1], "recompute_layers": [1, 0]}, "auto"),
    "deepspeed": ({"dp": 2, "gas": 2, "zero": 3}, "deepspeed"),
    "fsdp2": ({"tp": 2, "sp": True}, "auto"),
}


@pytest.mark.slow
@pytest.mark.parametrize("engine", list(ENGINE_LAYOUTS))
def test_selective_recompute_matches_the_unsplit_model_on_every_engine(tmp_path, unsplit_losses,  # noqa: F811
                                                                       engine) -> None:
    from test_trainer_parallel import _plan, _train_forked

    fields, choice = ENGINE_LAYOUTS[engine]
    losses = _train_forked(_plan(tmp_path, {**fields, "recompute": "selective"}, engine=choice), tmp_path / "run")
    assert losses == pytest.approx(unsplit_losses, abs=1e-5)


@pytest.mark.parametrize("transformers_api", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_recompute_runs_on_both_transformers_names(transformers_api, monkeypatch) -> None:
    # transformers 5.23 renamed gradient_checkpointing_enable; our floor (5.0) has only the old name.
    from transformers import PreTrainedModel

    from trainer.model import build_filled_model

    # Each branch runs on whichever transformers is installed: the other name is simulated.
    new_name = hasattr(PreTrainedModel, "activation_checkpointing_enable")
    if transformers_api == "gradient_checkpointing_enable" and new_name:  # transformers < 5.23, our floor
        renamed = PreTrainedModel.activation_checkpointing_enable
        monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable")
        monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable",
                            lambda self, gradient_checkpointing_kwargs=None:
                            renamed(self, activation_checkpointing_kwargs=gradient_checkpointing_kwargs))
    elif transformers_api == "activation_checkpointing_enable" and not new_name:  # 5.23 and later
        old = PreTrainedModel.gradient_checkpointing_enable
        monkeypatch.setattr(PreTrainedModel, "activation_checkpointing_enable",
                            lambda self, activation_checkpointing_kwargs=None:
                            old(self, gradient_checkpointing_kwargs=activation_checkpointing_kwargs),
                            raising=False)
    spec = SPEC.model_copy(update={"hf_config": {**CONFIG, "num_hidden_layers": 2}})
    layout = Layout(dtype="fp32", seq=64, recompute="full", recompute_layers=[1])
    model = build_filled_model(spec, layout, seed=0).train()
    layers = [m for m in model.modules() if m.__class__.__name__.endswith("DecoderLayer")]
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    runs = []  # (layer, its activation function's calls); module hooks do not fire in a recompute
    for index, layer in enumerate(layers):
        act = layer.mlp.act_fn.forward
        layer.mlp.act_fn.forward = lambda x, act=act, index=index: (runs.append(index), act(x))[1]
    ids = _batch()[:2, :64]
    model(input_ids=ids, labels=ids).loss.backward()
    assert sorted(runs) == [0, 0, 1]  # backward re-ran the checkpointed layer, and only it
