"""Ranks on this machine: fork launching, per-rank set-up and the exit-crash-safe teardown.

Ranks are forked from a parent that has already imported torch, transformers and DeepSpeed, on gloo
with a free port: 0.4 s for 2 ranks instead of ~6 s with torchrun (docs/notes-cpu-stack.md, "Time").
The profiler's collective benchmarks and the trainer's timed steps both start ranks this way.

Every rank, however it was started (forked here, or by torchrun for `advisor train` and the
profiler's CUDA runs), takes its device and joins its process group through one function,
`init_device_and_group`.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import socket
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def local_device(device_type: str | None = None) -> torch.device:
    """This rank's device: on CUDA the GPU of its place on its node (LOCAL_RANK, as torchrun and
    `init_rank` number it; the global RANK is wrong on every node but the first), else the CPU.
    `device_type` "cuda" or "cpu"; None: CUDA where it is available."""
    if (device_type or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_device_and_group(device_type: str | None = None, *, distributed: bool = True,
                          timeout_s: float | None = None) -> torch.device:
    """Set up this rank from its launcher's environment (LOCAL_RANK, RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) and return its device (`local_device`).

    On CUDA: the GPU LOCAL_RANK becomes the current device, fp32 matmuls may use TF32 where the GPU
    has it (`allow_tf32`), and the process group (if ``distributed``) is nccl bound to that GPU:
    without ``device_id`` NCCL guesses the device from the global rank and warns that this can hang.
    On the CPU: a gloo group, no device and nothing else changed."""
    device = local_device(device_type)
    if device.type == "cuda":
        torch.cuda.set_device(device.index)
        allow_tf32(device)
    if distributed:
        timeout = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        bound = {"device_id": device} if device.type == "cuda" else {}
        # rank and world size from the launcher's environment (env://), as torchrun sets them
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **timeout, **bound)
    return device


def allow_tf32(device: torch.device) -> None:
    """Let fp32 matmuls and convolutions run in TF32 on a GPU that has it (compute capability 8.0,
    Ampere, and later): the parts a mixed-precision step keeps in fp32 (QLoRA's up-cast LM head,
    an fp32 plan) then use the tensor cores. Only the CUDA flags: `set_float32_matmul_precision`
    would switch the CPU's oneDNN matmuls too. The legacy flags, not the `fp32_precision` settings:
    torch 2.13 raises when the legacy flags are read after those were set, and accelerate reads
    and sets the legacy ones."""
    if torch.cuda.get_device_capability(device) >= (8, 0):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def init_rank(rank: int, world: int, port: int, distributed: bool, threads: int | None = None, *,
              master_addr: str = "127.0.0.1", local_rank: int | None = None, local_world: int | None = None,
              device_type: str = "cpu", timeout_s: float | None = None) -> None:
    """Environment, thread count, device and (if ``distributed``) process group of one forked rank
    (`init_device_and_group`; on the CPU and gloo by default); ranks of several nodes pass where
    their master is and their place within the node."""
    # A session of its own, as torchrun starts `advisor train`'s workers (start_new_session): with the
    # kernel's autogroup scheduling, a busy machine shares CPU time per session, so ranks left in
    # their parent's session ran 2-3x slower than the trainer's under load, and calibration priced that.
    with contextlib.suppress(OSError):  # already a session or group leader (not a forked rank)
        os.setsid()
    local_world = local_world or world
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank if local_rank is None else local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(local_world),
    )
    # Share the cores: 2 ranks on 2 cores with 2 threads each run about 8x slower.
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # transformers 5 deprecates gradient_checkpointing_enable (now activation_checkpointing_*).
    warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated", category=FutureWarning)
    # DeepSpeed and our collective benchmarks call all_gather_into_tensor, which c10d deprecates.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated", category=FutureWarning)
    init_device_and_group(device_type, distributed=distributed, timeout_s=timeout_s)


def finish_rank(distributed: bool) -> None:
    """gloo can crash at exit when a worker thread frees a finished collective while Python
    finalizes (NOTES, "The exit crash", fix A): the caller has dropped every owner; collect,
    barrier, then destroy."""
    if distributed:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def launch(worker: Callable[..., None], nprocs: int, args: tuple = (), start_method: str = "fork") -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` forked ranks and wait for them (``spawn`` where the
    parent may have initialised CUDA, which forked children cannot use)."""
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method=start_method)
