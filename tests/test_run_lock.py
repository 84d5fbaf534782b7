"""One launch per run dir, and no worker outlives its launcher (issue 31, finding 3): a second
`advisor train` on a run dir in use exits 2 within 5 s naming the first launch's pid; killing the
first CLI (kill -9: no handler runs) leaves no worker alive within 10 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_trainer import _free_port, make_plan_file
from trainer.launch_file import launch_file_path
from trainer.run_lock import RunDirLock, lock_path


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds `text` (the run dir: the CLI, torchrun's agent, workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = next((line for line in (entry / "status").read_text().splitlines()
                              if line.startswith("State:")), "")
            except OSError:
                continue
            if text in cmdline and "zombie" not in state:
                found.append(int(entry.name))
    return found


def test_a_second_launch_is_refused_and_killing_the_first_leaves_no_worker(tmp_path: Path) -> None:
    plan = make_plan_file(tmp_path, devices=2, steps=400)  # long enough to be running when it is killed
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def launch() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(run),
                                 "--master-port", str(_free_port())], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    first = launch()
    try:
        deadline = time.time() + 120
        while len(_processes_naming(f"trainer.worker {launch_file_path(run)}")) < 2 and time.time() < deadline:
            assert first.poll() is None, first.stdout.read()
            time.sleep(0.2)
        workers = _processes_naming(f"trainer.worker {launch_file_path(run)}")
        assert len(workers) >= 2, "the two workers never started"
        started = time.time()
        second = launch()
        output, _ = second.communicate(timeout=60)
        assert second.returncode == 2 and time.time() - started < 5, output
        assert f"pid {first.pid}" in output and "in use" in output
        assert first.poll() is None  # the refusal touched nothing of the running launch
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    deadline = time.time() + 10
    while _processes_naming(str(run)) and time.time() < deadline:
        time.sleep(0.2)
    assert not _processes_naming(str(run)), "a worker outlived its launcher"


def test_the_lock_is_the_kernels_and_each_node_holds_its_own(tmp_path: Path) -> None:
    held = RunDirLock.take(tmp_path, node_rank=0)
    other_node = RunDirLock.take(tmp_path, node_rank=1)  # a shared run dir: every node's launcher holds one
    assert lock_path(tmp_path, 0) != lock_path(tmp_path, 1)
    held.release()
    again = RunDirLock.take(tmp_path, node_rank=0)  # released: free again, no stale file to clean
    again.release()
    other_node.release()


def test_advisor_run_takes_the_same_lock(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from advisor.cli import app

    held = RunDirLock.take(tmp_path / "run")
    try:
        done = CliRunner().invoke(app, ["run", "--out", str(tmp_path / "run"), "--verify", "0"])
    finally:
        held.release()
    assert done.exit_code == 2 and f"pid {os.getpid()}" in done.output, done.output


def test_train_checks_the_nodes_flags_as_profile_does(tmp_path: Path) -> None:
    """Multi-node flags are checked before anything starts (issue 31, finding 6): one line, exit 2."""
    from typer.testing import CliRunner

    from advisor.cli import app

    plan = make_plan_file(tmp_path)
    for flags, said in ((["--nnodes", "2", "--node-rank", "5"], "--node-rank must be within 0-1"),
                        (["--master-port", "70000"], "--master-port must be within")):
        done = CliRunner().invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), *flags])
        assert done.exit_code == 2 and said in done.output, done.output
        assert not (tmp_path / "run").exists()  # refused before the run dir is made
