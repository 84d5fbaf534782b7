"""What a training worker's environment carries: only what its own engine needs.

`advisor run` starts torchrun with its own environment. Nothing that the profiler, the verification
trials or DeepSpeed's CPU set-up did in that process may reach the workers: a `DS_ACCELERATOR=cpu`
left behind would put every DeepSpeed rank of a GPU machine on the CPU accelerator. Each check runs
in a fresh interpreter, whose environment has no DS_ACCELERATOR, so that what an import or a set-up
step leaves behind shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from test_trainer import make_plan_file

REPO = Path(__file__).resolve().parent.parent

# Everything `advisor run` does in its own process before it launches the training workers, then
# the launch, with torchrun replaced by a recorder of the environment it would get.
RECORD_LAUNCH_ENV = textwrap.dedent("""
    import json, os, subprocess, sys
    from pathlib import Path
    import advisor.cli.run_chain, advisor.cli.compose  # the verb's imports (the profiler, verify, timed steps)
    from specs.plan_file import load_plan
    from specs.core import Layout
    from trainer import launch
    from trainer.engines.deepspeed_zero import import_deepspeed
    from trainer.options import TrainOptions
    from trainer.timed_steps import prepare_forks

    prepare_forks([Layout(dp=2, mbs=1, seq=32, dtype="fp32"),  # what the profile's forks load (peft with
                   Layout(mbs=1, seq=32, dtype="fp32", method="lora")])  # its LoRA calibration layout)
    import_deepspeed()  # what a ZeRO verification trial loads before forking
    before = dict(os.environ)
    subprocess.run = lambda command, env, check: workers.append(env) or subprocess.CompletedProcess(command, 0)
    plan_path = Path(sys.argv[1])
    record = {"before": before}
    for device in ("cuda", "cpu"):
        launch._cuda = lambda: device == "cuda"  # the machine the launcher believes it is on
        workers = []
        launch.run(load_plan(plan_path), plan_path.parent / "run", False, TrainOptions(), None, 0, "127.0.0.1",
                   29999)
        record[device] = workers[0]
    print(json.dumps(record))
""")


@pytest.mark.slow
def test_advisor_run_hands_its_workers_nothing_their_engine_does_not_need(tmp_path) -> None:
    plan_path = make_plan_file(tmp_path, devices=2, steps=2)
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", RECORD_LAUNCH_ENV, str(plan_path)], env=env, capture_output=True,
                          text=True, check=True, timeout=300)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    before = record["before"]
    assert "DS_ACCELERATOR" not in before, "a set-up step left DS_ACCELERATOR in advisor run's environment"
    for device, added in (("cuda", set()), ("cpu", {"OMP_NUM_THREADS"})):
        worker = record[device]
        assert "DS_ACCELERATOR" not in worker
        # only the CPU's share of the cores is added, and nothing else changes
        assert set(worker) - set(before) == added, device
        assert {k: worker[k] for k in before} == before


CPU_WORKER_IMPORT = textwrap.dedent("""
    import json, os
    from trainer.engines.deepspeed_zero import import_deepspeed
    print(json.dumps({"accelerator": import_deepspeed().get_accelerator().device_name(),
                      "env": os.environ.get("DS_ACCELERATOR")}))
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_cpu_worker_runs_deepspeed_on_the_cpu_accelerator_without_leaving_the_variable_set() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", CPU_WORKER_IMPORT], env=env, capture_output=True, text=True,
                          check=True, timeout=300)
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record == {"accelerator": "cpu", "env": None}
    assert "Setting accelerator to CPU" not in done.stderr + done.stdout  # told, not guessed after a probe


def _report_session(rank: int, out_dir: str) -> None:
    from profiler.ranks import init_rank

    init_rank(rank, 2, 0, distributed=False, threads=1)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"sid": os.getsid(0), "pid": os.getpid()}))


def test_forked_ranks_run_in_sessions_of_their_own_as_torchruns_workers_do(tmp_path) -> None:
    """Kernel autogroup scheduling shares a busy CPU per session: ranks timed in their parent's
    session got a fraction of what torchrun's workers (start_new_session) get, and the calibration
    fitted to them priced training 1.2-3x too slow under load."""
    from profiler.ranks import launch

    launch(_report_session, 2, (str(tmp_path),))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["sid"] == r["pid"] for r in ranks)  # each leads its own session
    assert os.getsid(0) not in {r["sid"] for r in ranks}


def _launched_threads(tmp_path: Path, monkeypatch, devices: int, threads_per_device: int | None) -> int:
    """The CPU threads one rank of a `devices`-rank plan trains with, on hardware whose device is
    `threads_per_device` threads (a profile) or undefined (a preset), with OMP_NUM_THREADS=7 set by
    the user: the in-process rank's torch threads, or the launched ranks' OMP_NUM_THREADS."""
    from specs.plan_file import load_plan
    from trainer import launch
    from trainer.options import TrainOptions

    plan_path = make_plan_file(tmp_path, devices=devices, steps=2)
    plan = load_plan(plan_path)
    plan.hardware = plan.hardware.model_copy(update={"threads_per_device": threads_per_device, "cpu_cores": 2})
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setattr(launch, "_cuda", lambda: False)
    seen: list[int] = []
    monkeypatch.setattr(launch, "train_rank", lambda *args, **kwargs: seen.append(torch.get_num_threads()) or {})
    monkeypatch.setattr(subprocess, "run", lambda command, env, check: seen.append(int(env["OMP_NUM_THREADS"]))
                        or subprocess.CompletedProcess(command, 0))
    before = torch.get_num_threads()
    launch.run(plan, tmp_path / "run", False, TrainOptions(show_progress=False), None, 0, "127.0.0.1", 29999)
    assert torch.get_num_threads() == before  # the in-process run gives the caller its threads back
    return seen[0]


def test_ranks_train_with_the_threads_their_device_was_priced_with(tmp_path, monkeypatch) -> None:
    # a profile made one thread a device: a 1-rank run uses one thread, 2 ranks one each, whatever
    # the user's OMP_NUM_THREADS says (the plan's step times are for that device)
    assert _launched_threads(tmp_path / "a", monkeypatch, 1, threads_per_device=1) == 1
    assert _launched_threads(tmp_path / "b", monkeypatch, 2, threads_per_device=1) == 1
    # a preset defines no device: the process keeps its threads, launched ranks the user's setting
    assert _launched_threads(tmp_path / "c", monkeypatch, 1, threads_per_device=None) == torch.get_num_threads()
    assert _launched_threads(tmp_path / "d", monkeypatch, 2, threads_per_device=None) == 7


# A fresh interpreter prepares the forks as the timed steps do, then forks a child that builds the
# model a calibration rank builds and reports the transformers modules the build imported.
FORKED_BUILD_IMPORTS = textwrap.dedent("""
    import json, multiprocessing, sys
    from presets import load_model
    from specs.core import Layout
    from profiler.calibration_steps import calibration_model
    from trainer.timed_steps import prepare_forks

    model, layout = calibration_model(load_model("demo-tiny")), Layout(mbs=1, seq=32, dtype="fp32")
    prepare_forks([layout], "auto", model if sys.argv[1] == "model" else None)

    def build(queue):
        from trainer.model import build_model
        before = set(sys.modules)
        build_model(model, layout, seed=0)
        queue.put(sorted(m for m in set(sys.modules) - before if m.startswith("transformers.")))

    queue = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(target=build, args=(queue,))
    child.start()
    print(json.dumps(queue.get(timeout=120)))
    child.join()
""")


def _imported_by_forked_build(prepared_with: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", FORKED_BUILD_IMPORTS, prepared_with], env=env, capture_output=True,
                          text=True, check=True, timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_forked_ranks_inherit_the_models_family_imported_by_their_parent() -> None:
    """transformers imports a model family lazily, on first use: a forked calibration rank or
    verification trial paid that import itself (2.5 s each, 14 times in a fresh `advisor run`)."""
    assert "transformers.models.llama.modeling_llama" in _imported_by_forked_build("no-model")  # the cost shows
    assert _imported_by_forked_build("model") == []
