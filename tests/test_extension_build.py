"""A compiled extension's build killed midway no longer hangs every later run (found when a killed
`advisor train` left torch's `lock` file in the CPU memory counter's build folder: every later
launch slept on it, silently, for ever)."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from profiler.extension_build import build_directory, exclusive_build
from profiler.tensor_memory import COUNTER_EXTENSION
from trainer.native_ops import extensions_dir

ROOT = Path(__file__).resolve().parents[1]


def test_a_killed_builds_lock_does_not_hang_the_next_load_of_the_memory_counter() -> None:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir()), "PYTHONPATH": str(ROOT)}
    baton = Path(env["TORCH_EXTENSIONS_DIR"]) / COUNTER_EXTENSION / "lock"
    baton.parent.mkdir(parents=True, exist_ok=True)
    baton.touch()  # what torch's FileBaton leaves when its build is killed
    code = "from profiler.tensor_memory import load_counter\nload_counter().install()\nprint('loaded')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
    assert not baton.exists()


def test_the_build_lock_dies_with_its_holder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_directory("ext") == tmp_path / "ext"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom profiler.extension_build import exclusive_build\n"
         "with exclusive_build('ext') as folder:\n    (folder / 'lock').touch()\n    print('holding', flush=True)\n"
         "    time.sleep(600)"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with open(tmp_path / ".ext.advisor-lock", "a+") as probe:  # a live build holds it: others wait
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert (tmp_path / "ext" / "lock").exists()
        holder.send_signal(signal.SIGKILL)  # mid-build: its baton is left behind
        holder.wait()
        with exclusive_build("ext") as folder:  # the kernel released its lock; the dead baton is cleared
            assert not (folder / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


def test_the_memory_counter_built_cold_counts_every_threads_tensor_bytes_exactly(tmp_path: Path) -> None:
    """A fresh folder: the counter is built (c10's allocator header only, called through ctypes) and
    counts the bytes of tensors that four threads allocate, their peak, and their release."""
    code = """
import threading, torch
from profiler.tensor_memory import load_counter
counter = load_counter()
counter.install()
base = counter.live_bytes()
counter.reset_peak()
held = []
def allocate(size):
    held.append(torch.empty(size, dtype=torch.float32))
threads = [threading.Thread(target=allocate, args=(1000 * (i + 1),)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(counter.live_bytes() - base, counter.peak_bytes() - base)
held.clear()
print(counter.live_bytes() - base, counter.peak_bytes() - base)
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    allocated = 4 * (1000 + 2000 + 3000 + 4000)  # float32 bytes of the four tensors
    assert done.stdout.split() == [str(allocated), str(allocated), "0", str(allocated)]
    assert (tmp_path / COUNTER_EXTENSION / f"{COUNTER_EXTENSION}.so").exists()
