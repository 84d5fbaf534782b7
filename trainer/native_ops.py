"""DeepSpeed's CPU communication op, compiled once per machine instead of once per fresh home.

`deepspeed.initialize` on CPU JIT-compiles `deepspeed_shm_comm` (30-45 s cold) into
TORCH_EXTENSIONS_DIR, whose default lives under the home folder. Run-time preparation
(trainer/prepare.py, which every verb that trains calls) points that variable at a
folder of the advisor's cache keyed on the CPU model (the build uses -march=native, so a folder
shared by machines with other CPUs would load code they cannot run) and the Python and torch
versions; every process started afterwards (forked ranks, torchrun workers) inherits it. Before the
first DeepSpeed run on CPU, `build_cpu_comm_op` builds the op in this process, saying so in one line
only when it is not built yet (DeepSpeed prints "built successfully" on every load, built or not:
that line goes to the run's logs).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Callable, Iterable

import torch

from profiler.extension_build import exclusive_build
from specs.errors import UsageError
from specs.engine_traits import traits
from specs.profile import cpu_model_name
from specs.core import Layout
from presets import cache_dir
from trainer.engines import select_backend

SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's ShareMemCommBuilder.NAME: the folder and .so of the build
COLD_BUILD_S = 40.0  # measured 30-45 s on 2 cores
BUILDING = f"building DeepSpeed's CPU communication op once for this machine (about {COLD_BUILD_S:.0f} s)"


def extensions_dir() -> Path:
    """This machine's folder of compiled torch extensions in the advisor's cache."""
    cpu = re.sub(r"[^A-Za-z0-9]+", "-", cpu_model_name()).strip("-").lower() or "cpu"
    version = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.split('+')[0]}"
    return cache_dir() / "torch_extensions" / f"{cpu}-{version}"


def use_persistent_extensions_dir() -> Path:
    """Point TORCH_EXTENSIONS_DIR at `extensions_dir()` unless the user chose one (an empty one is none)."""
    if not os.environ.get("TORCH_EXTENSIONS_DIR"):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir())
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def cpu_comm_op_built() -> bool:
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or extensions_dir())
    return (root / SHM_OP / f"{SHM_OP}.so").is_file()


def cold_build_s(layout: Layout, engine: str) -> float:
    """The seconds a first run of `layout` here spends building the op before it starts: about
    COLD_BUILD_S on a CPU whose op is not built yet, 0 where it is built or not needed (a GPU,
    another engine)."""
    if torch.cuda.is_available() or not _through_deepspeed(layout, engine) or cpu_comm_op_built():
        return 0.0
    return COLD_BUILD_S


def build_cpu_comm_op(layouts: Iterable[Layout], engine: str, say: Callable[[str], None]) -> None:
    """Build the op now when one of `layouts` runs through DeepSpeed on CPU and it is not built yet;
    built, clear the lock a killed load may have left (the workers' DeepSpeed loads it next)."""
    if torch.cuda.is_available() or not any(_through_deepspeed(layout, engine) for layout in layouts):
        return
    if cpu_comm_op_built():
        with exclusive_build(SHM_OP):
            return
    say(BUILDING)
    build_cpu_comm_op_now()


def build_cpu_comm_op_now() -> None:
    """Build (or load, when built) DeepSpeed's CPU communication op, a killed earlier build's lock
    cleared (profiler/extension_build.py)."""
    from deepspeed.comm.torch import build_shm_op  # deferred: imports DeepSpeed (seconds)

    with exclusive_build(SHM_OP):
        build_shm_op()


def _through_deepspeed(layout: Layout, engine: str) -> bool:
    try:
        return traits(select_backend(layout, engine)).deepspeed  # type: ignore[arg-type]
    except UsageError:  # a layout the engine refuses fails on its own, later, with this error
        return False
