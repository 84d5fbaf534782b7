"""Models built on the meta device and filled after sharding (trainer/materialize.py).

The independent truth is the unsplit model: one process fills the whole model, and every rank's
shard must hold exactly its slice of those values (a random init or `--weights` read slice by
slice); 3 fp32 steps on 2 ranks must give the 1-process losses.
"""

import json
from pathlib import Path

import pytest

from specs.core import Layout, ModelSpec

CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 272, "max_position_embeddings": 128}
ONE = {"dp": 1, "tp": 1, "pp": 1, "mbs": 1, "gas": 2, "zero": 0, "dtype": "fp32"}
TWO = {**ONE, "dp": 2, "gas": 1, "zero": 3}
DS_ZERO3 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
            "zero_optimization": {"stage": 3}, "steps_per_print": 1_000_000}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
STEPS = 3


def _batches():
    """Per step, 2 sequences: the 1-process run takes both as micro-batches, rank r of 2 takes the r-th."""
    import torch

    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, CONFIG["vocab_size"], (2, 1, 16), generator=gen) for _ in range(STEPS)]


def _losses(engine, rank: int, world: int) -> list[float]:
    import torch
    import torch.distributed as dist

    out = []
    for batch in _batches():
        mine = [batch[i] for i in range(2) if world == 1 or i == rank]
        local = sum(engine.micro_step(m) for m in mine) / len(mine)
        mean = torch.tensor(local)
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        engine.optimizer_step(1e-2)
        out.append(float(mean))
    return out


def _build(layout: Layout, weights: str | None = None):
    from trainer.model import build_model

    return build_model(ModelSpec(name="tiny", hf_config=CONFIG), layout, seed=3, weights=weights)


def _rank_run(rank: int, world: int, port: int, choice: str, out: str, weights: str | None) -> None:
    from profiler.ranks import finish_rank, init_rank
    from trainer.engines import make_engine
    from trainer.materialize import _WeightsReader

    init_rank(rank, world, port, distributed=True, threads=1)
    read: list[int] = []
    original = _WeightsReader.__call__

    def counting(self, name):  # what this rank reads from the safetensors, in elements
        sliced = original(self, name)

        def counted(index):
            value = sliced(index)
            read.append(value.numel())
            return value
        return counted

    _WeightsReader.__call__ = counting
    offload = choice.endswith("+offload")  # ZeRO-3 with parameters and optimizer states in host memory
    choice = choice.removesuffix("+offload")
    layout = Layout(**TWO, offload="optimizer+params" if offload else "none")
    config = {**DS_ZERO3, "zero_optimization": {"stage": 3, **OFFLOAD}} if offload else DS_ZERO3
    model = _build(layout, weights)
    built_on_meta = all(p.is_meta for p in model.parameters())
    engine = make_engine(model, layout, config if choice == "deepspeed" else None, clip=0.0, engine=choice)
    shards = _local_shards(engine, choice)
    losses = _losses(engine, rank, world)
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"meta": built_on_meta, "losses": losses, "shards": shards, "read": sum(read)}))
    del engine, model
    finish_rank(True)


def _local_shards(engine, choice: str) -> dict[str, list[float]]:
    """This rank's values of every parameter, flattened: a DTensor's local shard, a ZeRO-3 partition."""
    from torch.distributed.tensor import DTensor

    if choice == "deepspeed":
        return {n: p.ds_tensor.detach().reshape(-1).tolist() for n, p in engine.engine.module.named_parameters()}
    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().reshape(-1).tolist()
            for n, p in engine.module.named_parameters()}


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory):
    """The 1-process run: its whole filled model (values by name), its losses, and the model saved
    with `save_pretrained` (safetensors) for the --weights runs."""
    import deepspeed  # noqa: F401  (imported before forking: the ranks inherit it loaded)
    import torch.distributed.fsdp  # noqa: F401

    from trainer.engines import make_engine

    layout = Layout(**ONE)
    engine = make_engine(_build(layout), layout, None, clip=0.0)
    values = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    folder = tmp_path_factory.mktemp("weights")
    engine.module.save_pretrained(folder)
    return values, _losses(engine, 0, 1), folder


def _expected_shard(full, rank: int, world: int, choice: str) -> list[float]:
    """The slice of the unsplit value each engine puts on `rank`: FSDP2 a chunk of rows, ZeRO-3 a
    chunk of the flattened tensor padded to a multiple of the ranks."""
    import torch

    if choice == "fsdp2":
        return torch.chunk(full, world, dim=0)[rank].reshape(-1).tolist()
    # DeepSpeed, offloaded or not
    flat = full.reshape(-1)
    size = -(-flat.numel() // world)
    padded = torch.cat([flat, flat.new_zeros(size * world - flat.numel())])
    return padded[rank * size:(rank + 1) * size].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("weights", [False, True], ids=["seeded-init", "weights"])
@pytest.mark.parametrize("choice", ["fsdp2", "deepspeed", "deepspeed+offload"])
def test_zero3_on_two_ranks_holds_slices_of_the_unsplit_model_and_trains_like_it(
        tmp_path, unsplit, choice, weights) -> None:
    from profiler.ranks import free_port, launch

    values, losses, folder = unsplit
    launch(_rank_run, 2, (2, free_port(), choice, str(tmp_path), str(folder) if weights else None))
    ranks = [json.loads(Path(tmp_path, f"rank{r}.json").read_text()) for r in range(2)]
    total = sum(v.numel() for v in values.values())
    for rank, held in enumerate(ranks):
        assert held["meta"]
        assert held["losses"] == pytest.approx(losses, abs=1e-5)
        assert held["shards"].keys() == values.keys()
        for name, full in values.items():
            assert held["shards"][name] == pytest.approx(_expected_shard(full, rank, 2, choice), abs=0), name
        if weights:  # slices only: its half of every tensor, plus the rows a ZeRO-3 cut runs into
            assert total / 2 <= held["read"] <= total / 2 + 2 * CONFIG["intermediate_size"] * len(values)
        else:
            assert held["read"] == 0


def test_seeded_init_does_not_depend_on_which_modules_a_rank_fills() -> None:
    """A pipeline stage fills only its own modules; its values are those of the whole model."""
    import torch

    from trainer.engines.pipeline import cut_chunks
    from trainer.materialize import materialize, pending_init

    layout = Layout(**ONE)
    whole = _build(layout)
    materialize(whole, pending_init(whole), torch.device("cpu"))
    part = _build(layout)
    (stage,) = cut_chunks(part, Layout(**{**ONE, "pp": 2, "stage_layers": [1, 1]}), 1)  # layer 1, final norm, LM head
    materialize(stage, pending_init(part), torch.device("cpu"))
    names = [name for name, _ in stage.named_parameters()]
    assert "model.layers.1.self_attn.q_proj.weight" in names and "lm_head.weight" in names
    for name, p in stage.named_parameters():
        assert torch.equal(p, whole.get_parameter(name)), name
    norms = [p for n, p in whole.named_parameters() if "norm" in n]
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms)  # HF's own init (RMSNorm ones)
    std = whole.model.layers[0].mlp.up_proj.weight.std().item()
    assert std == pytest.approx(whole.config.initializer_range, rel=0.05)  # HF's normal(0, 0.02)


# -- models larger than a rank: start-up memory ----------------------------------------------------

# ~110 M parameters (441 MB in fp32) in many small tensors: one rank of 4 holds ~110 MB, and the
# largest tensor drawn whole while filling (an MLP projection, 2.9 MB) stays well inside 10% of it.
LARGE = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 34,
         "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 1024, "max_position_embeddings": 256}
LARGE_RANKS = 4


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rank_start(rank: int, world: int, port: int, choice: str, out: str) -> None:
    """Start the engine's model on this rank and report its peak resident memory above the
    baseline (the method is in the report): glibc returns large frees to the OS (mmap threshold
    64 KiB, NOTES "Memory measurement"); the same start-up runs first on a tiny model, so that
    the code pages a forked rank faults in on first use belong to the baseline; the baseline is
    VmRSS then, the kernel's high-water mark is reset (clear_refs 5) and read back (VmHWM)."""
    import ctypes
    import gc

    import deepspeed

    from profiler.ranks import finish_rank, init_rank

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    init_rank(rank, world, port, distributed=True, threads=1)
    if choice == "deepspeed":
        deepspeed.init_distributed()  # its communication set-up (shm_comm), as much a part of the process as gloo's
    _start(CONFIG, choice, world)
    gc.collect()
    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    held = _start(LARGE, choice, world)
    peak = _status_kib("VmHWM") - baseline
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak_kib": peak, "held": held}))
    finish_rank(True)


def _start(config: dict, choice: str, world: int) -> int:
    """Build `config` on the meta device and shard it as the engine does; the parameter bytes this
    rank then holds. DeepSpeed: the engine's own first step (`deepspeed.initialize` then adds its
    fp32 partitions and gradient buffer, the optimizer's share, not the model's)."""
    from trainer.engines import make_engine
    from trainer.engines.base import local_bytes
    from trainer.materialize import materialize_zero3, pending_init
    from trainer.model import build_model

    layout = Layout(**{**ONE, "dp": world, "gas": 1, "zero": 3})
    model = build_model(ModelSpec(name="large", hf_config=config), layout, seed=0)
    if choice == "deepspeed":
        materialize_zero3(model, pending_init(model), {**DS_ZERO3, "train_batch_size": world})
        return local_bytes(p.ds_tensor for p in model.parameters())
    return make_engine(model, layout, None, clip=0.0, engine="fsdp2").state_bytes()["parameters"]


def launch_large(choice: str, out: str) -> None:
    """The 4 ranks' start-up, forked from a fresh interpreter: a long-lived parent (a test session)
    hands its forks resident heap pages that new allocations reuse without raising RSS, which
    would hide part of what the model costs."""
    import deepspeed  # noqa: F401  (imported before forking: the ranks inherit it loaded)
    import torch
    import torch.distributed.fsdp  # noqa: F401

    from profiler.ranks import free_port, launch
    from trainer.materialize import materialize, pending_init

    tiny = _build(Layout(**ONE))  # what building imports on first use is part of the baseline, not of the model
    materialize(tiny, pending_init(tiny), torch.device("cpu"))
    launch(_rank_start, LARGE_RANKS, (LARGE_RANKS, free_port(), choice, out))


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["deepspeed", "fsdp2"])
def test_a_model_four_times_a_ranks_share_starts_within_that_share(tmp_path, choice) -> None:
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(here)!r}); import test_materialize; " \
           f"test_materialize.launch_large({choice!r}, {str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=here.parent, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    h, i, v, layers = (LARGE[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"))
    fp32_bytes = 4 * (2 * v * h + h + layers * (4 * h * h + 3 * h * i + 2 * h))  # the formula, not the model
    share = fp32_bytes / LARGE_RANKS
    for rank in range(LARGE_RANKS):
        held = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert held["held"] == pytest.approx(share, rel=0.01)  # sharded: a quarter each
        assert share * 0.9 <= held["peak_kib"] * 1024 <= share * 1.10, (rank, held["peak_kib"] * 1024 / share)


def _rank_dp_tp(rank: int, world: int, port: int, out: str, weights: str) -> None:
    """DP x TP 2 x 2 (FSDP2 sharding TP-local rows: strided shards), filled by the seeded init and
    by --weights: every parameter gathered whole."""
    from torch.distributed.tensor import DTensor

    from profiler.ranks import finish_rank, init_rank
    from trainer.engines import make_engine

    init_rank(rank, world, port, distributed=True, threads=1)
    layout = Layout(**{**TWO, "tp": 2})
    whole = {}
    for source in (None, weights):
        engine = make_engine(_build(layout, source), layout, None, clip=0.0, engine="fsdp2")
        whole[str(source is not None)] = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).tolist()
            for n, p in engine.module.named_parameters()}
        engine = None
    if rank == 0:
        Path(out, "whole.json").write_text(json.dumps(whole))
    finish_rank(True)


@pytest.mark.slow
def test_dp_x_tp_shards_reassemble_the_unsplit_model(tmp_path, unsplit) -> None:
    from profiler.ranks import free_port, launch

    values, _, folder = unsplit
    launch(_rank_dp_tp, 4, (4, free_port(), str(tmp_path), str(folder)))
    whole = json.loads(Path(tmp_path, "whole.json").read_text())
    for filled in whole.values():
        assert filled.keys() == values.keys()
        for name, full in values.items():
            assert filled[name] == full.reshape(-1).tolist(), name
