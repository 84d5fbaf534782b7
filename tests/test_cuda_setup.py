"""Every rank takes the GPU of its place on its node and joins a process group bound to it.

A job of 2 nodes x 2 GPUs, faked on the CPU: ranks 0-3 with LOCAL_RANK 0, 1, 0, 1. Whichever way a
rank starts (`advisor train`'s torchrun worker, the profiler's forked or torchrun ranks, the timed
steps of calibration and verification), it must make cuda:LOCAL_RANK its current device (global
rank 3 sits on GPU 1 of node 1, not on a GPU 3 that node may not have) and pass that device to
`init_process_group` as ``device_id`` (without it NCCL guesses the device from the global rank and
warns that this can hang). fp32 matmuls may use TF32 on a GPU that has it (sm80 and later), and
only there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from specs.core import Layout
from profiler import run_profile
from trainer import launch, timed_steps
from trainer.options import TrainOptions

TWO_NODES = [(0, 0), (1, 1), (2, 0), (3, 1)]  # (RANK, LOCAL_RANK) of 2 nodes x 2 GPUs
WORLD = 4
RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def cuda(index: int) -> torch.device:
    return torch.device("cuda", index)


@dataclass
class FakeMachine:
    """What the code under test asked of CUDA and of torch.distributed."""

    current_devices: list[torch.device] = field(default_factory=list)  # torch.cuda.set_device, in order
    groups: list[dict] = field(default_factory=list)  # init_process_group's arguments, one per call


def fake_machine(monkeypatch, has_cuda: bool = True, capability: tuple[int, int] = (8, 0)) -> FakeMachine:
    """CUDA (or none) of the given compute capability, and a torch.distributed that records the
    groups it is asked for; the TF32 flags start off, and everything is restored afterwards."""
    machine = FakeMachine()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: machine.current_devices.append(
        cuda(d) if isinstance(d, int) else torch.device(d)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(dist, "init_process_group", lambda backend=None, **kwargs: machine.groups.append(
        {"backend": backend, **kwargs}))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: int(os.environ["RANK"]))
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: None)
    monkeypatch.setattr(os, "setsid", lambda: None)  # a forked rank's own session: not pytest's
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    for key in RANK_ENV:  # restored afterwards, whatever the rank set-up writes
        monkeypatch.setenv(key, os.environ.get(key, "0"))
    return machine


@pytest.fixture(autouse=True)
def _keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def as_torchrun_rank(monkeypatch, rank: int, local_rank: int) -> None:
    """The environment torchrun gives rank `rank` of the 2 x 2 job."""
    for key, value in (("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29513"), ("RANK", str(rank)),
                       ("LOCAL_RANK", str(local_rank)), ("WORLD_SIZE", str(WORLD)), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)


def assert_bound_to_local_gpus(machine: FakeMachine, ranks: list[tuple[int, int]], timeout_s: float) -> None:
    """Rank by rank: cuda:LOCAL_RANK made current, then an nccl group of the whole job bound to it."""
    assert machine.current_devices == [cuda(local) for _, local in ranks]
    assert [g.get("device_id") for g in machine.groups] == [cuda(local) for _, local in ranks]
    for group, (rank, _) in zip(machine.groups, ranks):
        assert group["backend"] == "nccl"
        assert group.get("rank", rank) == rank and group.get("world_size", WORLD) == WORLD
        assert group["timeout"] == timedelta(seconds=timeout_s)


def launched_training_rank(monkeypatch, tmp_path, rank: int, local_rank: int) -> None:
    """A training worker (trainer/worker.py) as torchrun starts it on one rank, up to the training loop."""
    as_torchrun_rank(monkeypatch, rank, local_rank)
    monkeypatch.setattr(launch, "train", lambda plan, out, resume, options: {})
    launch.train_rank(None, tmp_path, False, TrainOptions(show_progress=False), distributed=True)


def test_training_workers_of_two_nodes_take_their_local_gpu_and_bind_their_group_to_it(monkeypatch, tmp_path):
    machine = fake_machine(monkeypatch)
    for rank, local_rank in TWO_NODES:
        launched_training_rank(monkeypatch, tmp_path, rank, local_rank)
    assert_bound_to_local_gpus(machine, TWO_NODES, TrainOptions().timeout_s)


def test_profiler_ranks_under_torchrun_take_their_local_gpu_and_bind_their_group_to_it(monkeypatch):
    machine = fake_machine(monkeypatch)
    setups = []
    monkeypatch.setattr(run_profile, "rank_work", lambda rank, setup, report: setups.append((rank, setup)))
    for rank, local_rank in TWO_NODES:
        as_torchrun_rank(monkeypatch, rank, local_rank)
        run_profile._run_torchrun_rank(run_profile.ProfileOptions(quick=True), "cuda", None,
                                       run_profile.NoProgress(), 0.0)
    assert_bound_to_local_gpus(machine, TWO_NODES, 600.0)
    assert [(rank, setup.node, rank - setup.first_rank) for rank, setup in setups] == [
        (rank, rank // 2, local) for rank, local in TWO_NODES]


def test_profiler_ranks_forked_on_each_node_take_their_local_gpu_and_bind_their_group_to_it(monkeypatch, tmp_path):
    """`advisor profile --nnodes 2` on CUDA: each node spawns its 2 ranks (profiler.ranks.init_rank)."""
    machine = fake_machine(monkeypatch)
    monkeypatch.setattr(run_profile, "rank_work", lambda rank, setup, report: None)
    monkeypatch.setattr(run_profile, "finish_rank", lambda distributed: None)
    for node in (0, 1):
        setup = run_profile.RankSetup(world=WORLD, local_world=2, node=node, nodes=2, first_rank=2 * node,
                                      port=29513, master_addr="10.0.0.1", timeout_s=30.0, device_type="cuda",
                                      threads=1, quick=True, dims=None)
        for local_rank in (0, 1):
            run_profile._forked_rank(local_rank, setup, None, str(tmp_path))
            assert (os.environ["RANK"], os.environ["LOCAL_RANK"]) == (str(2 * node + local_rank), str(local_rank))
    assert_bound_to_local_gpus(machine, TWO_NODES, 30.0)


class Stop(Exception):
    """Ends a rank's benchmarks at the first GPU they ask about."""


def test_profiler_benchmarks_measure_the_local_gpu(monkeypatch):
    """The benchmarks of global rank 3 (node 1) run on cuda:1, the GPU its set-up made current: the
    first thing they ask of the GPU, its free memory, is asked of cuda:1."""
    fake_machine(monkeypatch)
    as_torchrun_rank(monkeypatch, 3, 1)
    asked = []

    def free_memory(device=None):
        asked.append(device)
        raise Stop

    monkeypatch.setattr(torch.cuda, "mem_get_info", free_memory)
    with pytest.raises(Stop):
        run_profile.rank_benchmarks(3, WORLD, 2, "cuda", 1, True, None, lambda what: None)
    assert asked == [cuda(1)]


def test_timed_steps_ranks_take_their_gpu_and_bind_their_group_to_it(monkeypatch, tmp_path):
    """Calibration and verification fork every rank of a layout on this machine: their local rank
    is their rank, and their group is bound to it as the trainer's are, with its timeout."""
    machine = fake_machine(monkeypatch)
    monkeypatch.setattr(timed_steps, "run_steps", lambda model, layout, steps, rank, meter, engine: ([0.1], [1.0]))
    monkeypatch.setattr(timed_steps, "finish_rank", lambda distributed: None)
    layout = Layout(dp=WORLD, mbs=1, seq=32, dtype="fp32")
    for rank in range(WORLD):
        timed_steps._rank(rank, None, layout, 2, 29513, str(tmp_path), 1, "auto", None)
        assert os.environ["LOCAL_RANK"] == str(rank)
    assert_bound_to_local_gpus(machine, [(rank, rank) for rank in range(WORLD)], TrainOptions().timeout_s)


def test_an_ampere_gpu_runs_fp32_matmuls_in_tf32_and_the_cpu_keeps_fp32(monkeypatch, tmp_path):
    cpu_matmul = torch.backends.mkldnn.matmul.fp32_precision
    fake_machine(monkeypatch, capability=(8, 0))
    launched_training_rank(monkeypatch, tmp_path, 3, 1)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.mkldnn.matmul.fp32_precision == cpu_matmul  # the CPU's oneDNN matmuls untouched


def test_a_gpu_before_ampere_keeps_fp32_matmuls_in_fp32(monkeypatch, tmp_path):
    machine = fake_machine(monkeypatch, capability=(7, 5))
    launched_training_rank(monkeypatch, tmp_path, 3, 1)
    assert machine.current_devices == [cuda(1)]
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_a_single_gpu_run_in_process_gets_tf32_without_a_group(monkeypatch, tmp_path):
    """One device and no ZeRO: `advisor train` trains in its own process, with no process group."""
    machine = fake_machine(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(launch, "train", lambda plan, out, resume, options: {})
    launch.train_rank(None, tmp_path, False, TrainOptions(show_progress=False), distributed=False)
    assert machine.current_devices == [cuda(0)] and machine.groups == []
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


def test_cpu_ranks_join_gloo_with_no_device_and_leave_tf32_alone(monkeypatch, tmp_path):
    machine = fake_machine(monkeypatch, has_cuda=False)
    for rank, local_rank in TWO_NODES:
        launched_training_rank(monkeypatch, tmp_path, rank, local_rank)
    assert machine.current_devices == []
    assert [g["backend"] for g in machine.groups] == ["gloo"] * WORLD
    assert all("device_id" not in g for g in machine.groups)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
