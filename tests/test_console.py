"""The quiet console: our lines on the terminal, every third-party line in RUN_DIR/logs/."""

from __future__ import annotations

import importlib
import io
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from trainer import native_ops
from advisor.cli.progress import RunProgress, last_record
from specs.profile import cpu_model_name
from specs.core import Layout

ROOT = Path(__file__).resolve().parents[1]

# Output from every source the routing has to catch: a Python warning, a library's logger, a library's
# print, native code writing to the descriptors, a forked child, a launched process.
SOURCES = textwrap.dedent("""
    import logging, os, subprocess, sys, warnings
    from pathlib import Path
    from advisor.cli.common import console, err_console
    from advisor.cli.quiet import quiet_console

    with quiet_console(Path(sys.argv[1]), verbose=sys.argv[2] == "1") as terminal:
        console.print("ours: a line")
        err_console.print("ours: an error line")
        warnings.warn("a-python-warning", FutureWarning)
        logging.getLogger("somelib").warning("a-library-log-record")
        print("a-library-print")
        os.write(2, b"native-stderr\\n")
        os.write(1, b"native-stdout\\n")
        pid = os.fork()
        if pid == 0:
            os.write(2, b"forked-rank\\n")
            os._exit(0)
        os.waitpid(pid, 0)
        subprocess.run([sys.executable, "-c", "import sys; print('worker-stdout'); print('worker-stderr', file=sys.stderr)"])
        print('{"json": 1}', file=terminal)
    print("ours: after the block")
""")
THIRD_PARTY = ("a-python-warning", "a-library-log-record", "a-library-print", "native-stderr", "native-stdout",
               "forked-rank", "worker-stdout", "worker-stderr")


def _route(tmp_path: Path, verbose: bool) -> tuple[str, str, str]:
    run = subprocess.run([sys.executable, "-c", SOURCES, str(tmp_path / "run"), "1" if verbose else "0"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout, run.stderr, (tmp_path / "run" / "logs" / "output.log").read_text()


def test_third_party_output_goes_to_the_log_and_ours_to_the_terminal(tmp_path):
    out, err, log = _route(tmp_path, verbose=False)
    assert out.splitlines() == ["ours: a line", '{"json": 1}', "ours: after the block"]
    assert err.splitlines() == ["ours: an error line"]
    for line in THIRD_PARTY:
        assert line in log
    assert "ours" not in log
    assert re.search(r"WARNING py\.warnings: .*FutureWarning: a-python-warning", log)  # through logging


def test_verbose_shows_third_party_output_on_stderr_and_keeps_stdout_ours(tmp_path):
    out, err, log = _route(tmp_path, verbose=True)
    assert out.splitlines() == ["ours: a line", '{"json": 1}', "ours: after the block"]
    for line in THIRD_PARTY:
        assert line in err
    assert "a-python-warning" in log and "a-library-log-record" in log  # Python's records are still logged


def test_progress_reads_the_last_whole_metrics_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert last_record(path) is None
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # the last line is being written
    assert last_record(path) == {"step": 2}


def test_time_left_scales_the_estimate_by_the_time_the_done_share_took():
    display = RunProgress(Console(file=io.StringIO()), enabled=False, title="run")
    display.expect(100.0)  # estimated seconds
    display.clock = time.perf_counter() - 50.0  # 25 estimated seconds took 50 real ones: 2x slower
    display._show_run(25.0)
    assert display.bars.tasks[0].fields["detail"] == "about 2:30 left"  # 75 ahead x 2
    # inside a part with 10 estimated seconds ahead that measure 30: those at their measured time
    display._show_run(25.0, (10.0, 30.0))
    assert display.bars.tasks[0].fields["detail"] == "about 2:40 left"  # 65 x 2 + 30


@pytest.mark.slow
def test_advisor_run_console_holds_only_our_lines(tmp_path):
    """A shortened `advisor run` on a fresh home: exit 0, no warning, traceback or third-party log
    line on the console, and the run's logs/ holds them. DeepSpeed's CPU op comes from this
    machine's persistent build folder (building it is not what this test is about)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path), "ADVISOR_CACHE": str(tmp_path / "cache"),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or str(native_ops.extensions_dir())}
    run = subprocess.run([sys.executable, "-m", "advisor.cli", "run", "--hardware", "cpu", "--max-steps-per-stage",
                          "1", "--verify", "1", "--verify-steps", "3", "--no-feedback", "--out", "run"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    console = run.stdout + run.stderr
    assert run.returncode == 0, console
    console = console.replace(native_ops.BUILDING, "")  # ours, on a machine without the build
    for noise in ("Warning:", "Traceback", "DeepSpeed", "torch.distributed", "[INFO", "[WARNING", "built successfully"):
        assert noise not in console, noise
    assert "advisor run: plan:" in console and "done in" in console
    log = (tmp_path / "run" / "logs" / "output.log").read_text()
    assert "Warning" in log and "DeepSpeed" in log


def test_deepspeed_cpu_op_folder_is_per_cpu_model_and_said_only_when_built(tmp_path, monkeypatch):
    # deferred: imports DeepSpeed (seconds); by name, as the attribute `deepspeed.comm.torch` is torch itself
    shm = importlib.import_module("deepspeed.comm.torch")
    monkeypatch.setenv("ADVISOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")  # set but empty: not a choice
    folder = native_ops.use_persistent_extensions_dir()
    assert folder.parent == tmp_path / "cache" / "torch_extensions"
    assert re.sub(r"[^a-z0-9]", "", cpu_model_name().lower()) in folder.name.replace("-", "")
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(folder)
    monkeypatch.setattr(native_ops.torch.cuda, "is_available", lambda: False)
    builds: list[str] = []
    monkeypatch.setattr(shm, "build_shm_op", lambda: builds.append("built"))
    said: list[str] = []
    native_ops.build_cpu_comm_op([Layout(dp=2, zero=0)], "auto", said.append)  # plain DDP: no DeepSpeed
    assert said == [] and builds == []
    native_ops.build_cpu_comm_op([Layout(dp=2, zero=0), Layout(dp=2, zero=1)], "auto", said.append)
    assert said == [native_ops.BUILDING] and builds == ["built"]
    (folder / native_ops.SHM_OP).mkdir(parents=True, exist_ok=True)  # made by the build's lock (extension_build)
    (folder / native_ops.SHM_OP / f"{native_ops.SHM_OP}.so").write_bytes(b"")
    native_ops.build_cpu_comm_op([Layout(dp=2, zero=1)], "auto", said.append)  # built: not a word
    assert said == [native_ops.BUILDING] and builds == ["built"]
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))  # the user's choice stands
    assert native_ops.use_persistent_extensions_dir() == tmp_path / "mine"
