"""Nothing lost, nobody in: a run directory knows its run, checkpoints survive kill -9 at any
moment of a write, a damaged checkpoint or a torn log line is passed over, a resume refuses another
run's checkpoint, and the spike guard finds its way back past a bad batch."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import trainer.launch
import trainer.loop as loop
from advisor.cli import app
from specs.errors import UsageError
from specs.plan_file import load_plan
from test_trainer import _free_port, make_plan_file, read_jsonl
from profiler.extension_build import build_directory
from profiler.tensor_memory import COUNTER_EXTENSION, load_counter
from trainer import checkpoint
from trainer.loop import TrainOptions, train
from trainer.run_identity import RUN_FILE
from trainer.stage_runner import StageRunner

QUIET = TrainOptions(show_progress=False)


class Crash(Exception):
    """Stands for a crash of the training process at a chosen step."""


def crash_after(monkeypatch, step: int) -> None:
    original = StageRunner.record

    def record(self, stage, taken):
        original(self, stage, taken)
        if self.state.global_step == step:
            raise Crash

    monkeypatch.setattr(StageRunner, "record", record)


def crashed_at_step_5(tmp_path: Path, monkeypatch):
    """A plan checkpointing every 2 steps, and its run dir after a crash at step 5 (newest: step 4)."""
    plan, run = load_plan(make_plan_file(tmp_path, checkpoint_every=2)), tmp_path / "run"
    with monkeypatch.context() as patch, pytest.raises(Crash):
        crash_after(patch, 5)
        train(plan, run, resume=False, options=QUIET)
    return plan, run


def losses(run: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["event"] == kind]


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> list[float]:
    """Per-step losses of an uninterrupted run in a clean directory (6 steps a stage, checkpoints every 2)."""
    root = tmp_path_factory.mktemp("clean")
    train(load_plan(make_plan_file(root, checkpoint_every=2)), root / "run", resume=False, options=QUIET)
    return losses(root / "run")


# -- run identity ------------------------------------------------------------------------------------

def test_a_used_directory_is_refused_and_overwrite_moves_it_aside_then_trains_like_a_clean_run(tmp_path,
                                                                                                clean) -> None:
    plan_path = make_plan_file(tmp_path, checkpoint_every=2)
    plan, run = load_plan(plan_path), tmp_path / "run"
    train(plan, run, resume=False, options=QUIET)
    first_id = json.loads((run / RUN_FILE).read_text())["run_id"]
    with pytest.raises(UsageError, match="already holds a training run"):
        train(plan, run, resume=False, options=QUIET)
    result = CliRunner().invoke(app, ["train", str(plan_path), "--out", str(run)])
    assert result.exit_code == 2 and "already holds a training run" in result.output

    train(plan, run, resume=False, options=TrainOptions(show_progress=False, overwrite=True))
    assert losses(run) == clean  # nothing of the old run leaked into the new one
    [aside] = run.glob("previous-*")
    assert len(read_jsonl(aside / "metrics.jsonl")) == len(clean)  # the old run, whole
    assert json.loads((aside / RUN_FILE).read_text())["run_id"] == first_id
    assert json.loads((run / RUN_FILE).read_text())["run_id"] != first_id
    assert [e["to"] for e in events(run, "moved_aside")] == [str(aside)]


def _changed(plan, field: str):
    plan = plan.model_copy(deep=True)
    if field == "task":
        plan.task.stages[0].lr *= 2
    elif field == "model":
        plan.model.hf_config["intermediate_size"] = 96
    elif field == "seq_len":
        plan.chosen.layout = plan.chosen.layout.model_copy(update={"seq": 16})
    elif field == "layout":  # the same global batch in another split: an OOM fallback or a re-plan may do this
        plan.chosen.layout = plan.chosen.layout.model_copy(update={"mbs": 2, "gas": 2})
    return plan


@pytest.mark.parametrize("field", ["task", "seed", "model", "seq_len"])
def test_resume_with_another_task_seed_model_or_sequence_length_is_refused_naming_it(tmp_path, field) -> None:
    plan = load_plan(make_plan_file(tmp_path, steps=2))
    train(plan, tmp_path / "run", resume=False, options=QUIET)
    seed = 1 if field == "seed" else 0
    with pytest.raises(UsageError, match=rf"another [a-z ]+ \({field}: "):
        train(_changed(plan, field), tmp_path / "run", resume=True,
              options=TrainOptions(show_progress=False, seed=seed))


def test_resume_accepts_another_layout_and_refuses_a_directory_this_trainer_did_not_write(tmp_path) -> None:
    plan_path = make_plan_file(tmp_path, steps=2)
    plan, run = load_plan(plan_path), tmp_path / "run"
    train(plan, run, resume=False, options=QUIET)
    assert train(_changed(plan, "layout"), run, resume=True, options=QUIET)["finished"]
    (run / RUN_FILE).unlink()
    with pytest.raises(UsageError, match="not trusted"):
        train(plan, run, resume=True, options=QUIET)
    result = CliRunner().invoke(app, ["train", str(plan_path), "--out", str(run), "--resume"])
    assert result.exit_code == 2 and "not trusted" in result.output


@pytest.mark.parametrize("variable", ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"])
def test_a_restart_by_torchrun_or_a_slurm_requeue_resumes(tmp_path, monkeypatch, clean, variable) -> None:
    plan, run = crashed_at_step_5(tmp_path, monkeypatch)
    monkeypatch.setenv(variable, "1")
    assert train(plan, run, resume=False, options=QUIET)["finished"]  # the same command line, restarted
    assert [e["from"] for e in events(run, "resume")] == ["step-00000004"]
    assert losses(run) == clean


# -- damaged files -----------------------------------------------------------------------------------

def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, monkeypatch, clean) -> None:
    plan, run = crashed_at_step_5(tmp_path, monkeypatch)
    engine = run / "checkpoints" / "step-00000004" / "engine.pt"
    engine.write_bytes(engine.read_bytes()[: engine.stat().st_size // 2])
    assert train(plan, run, resume=True, options=QUIET)["finished"]
    damaged = events(run, "checkpoint_damaged")
    assert [d["path"] for d in damaged] == ["step-00000004"] and "engine.pt" in damaged[0]["problem"]
    assert events(run, "resume")[-1]["from"] == "step-00000002"
    assert losses(run) == clean


def test_a_torn_last_log_line_is_skipped_and_counted(tmp_path, monkeypatch, clean) -> None:
    plan, run = crashed_at_step_5(tmp_path, monkeypatch)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 6, "stage": "langu' + b"\x00" * 64)  # a power cut during an append
    with open(run / "events.jsonl", "ab") as f:
        f.write(b"\x00" * 32)
    assert train(plan, run, resume=True, options=QUIET)["finished"]
    assert losses(run) == clean
    torn = events(run, "torn_lines")
    assert {(t["file"], t["skipped"]) for t in torn} == {("events.jsonl", 1), ("metrics.jsonl", 1)}


def _forked_rank(rank: int, world: int, port: int, plan_path: str, run_dir: str, resume: bool,
                 environment: dict[str, str]) -> None:
    """One rank as a training worker runs it (trainer/worker.py: `trainer.launch.train_rank`), forked from
    this process."""
    from profiler.ranks import init_rank

    os.environ.update(environment)
    init_rank(rank, world, port, distributed=False, threads=1)  # its environment; train_rank makes the group
    trainer.launch.train_rank(load_plan(plan_path), Path(run_dir), resume, QUIET, distributed=True)


def _train_forked(plan: Path, run: Path, resume: bool = False, **environment: str) -> None:
    """Train `plan` (2 ranks) on ranks forked from this process; a rank's exception is raised here."""
    from profiler.ranks import launch

    launch(_forked_rank, 2, (2, _free_port(), str(plan), str(run), resume, environment))


def _start_forked(plan: Path, run: Path, resume: bool, **environment: str) -> list:
    """The 2 ranks of `_train_forked`, started and not waited for (their processes)."""
    context = torch.multiprocessing.start_processes(
        _forked_rank, args=(2, _free_port(), str(plan), str(run), resume, environment), nprocs=2, join=False,
        start_method="fork")
    return context.processes


@pytest.mark.slow
def test_kill_dash_nine_during_checkpoint_writes_always_resumes_from_the_last_complete_one(tmp_path) -> None:
    """20 kills of both ranks of a 2-rank run, each at a random moment of a checkpoint write (a delay
    between its files makes the writes long enough to hit), each followed by a resume; the end, by
    `advisor train --resume` through torchrun, equals an uninterrupted run bitwise. The killed
    attempts are ranks forked from this process, which has imported torch already: a launch through
    the CLI costs about 6 s of interpreter and torch start per attempt, a fork a fraction of one."""
    kills = 20
    # the CPU allocator counter, loaded before forking (the ranks inherit it), and its folder for the
    # CLI's workers: the build this process has (the other trainer tests need it too), not one more
    load_counter()
    built = build_directory(COUNTER_EXTENSION).parent
    plan = make_plan_file(tmp_path, steps=16, checkpoint_every=1,  # DDP; 20 kills reach step 15 or so of 32
                          layout_fields={"dp": 2, "mbs": 1, "gas": 2, "zero": 0})
    _train_forked(plan, tmp_path / "whole")
    run, root, rng = tmp_path / "killed", tmp_path / "killed" / "checkpoints", random.Random(0)
    expected_from = []  # the newest complete checkpoint at each kill: where the next resume must start
    for attempt in range(kills):
        started = time.time()
        ranks = _start_forked(plan, run, resume=attempt > 0, **{checkpoint.DELAY_ENV: "0.03"})
        writes, seen = rng.randint(1, 2), set()
        while all(r.is_alive() for r in ranks) and len(seen) < writes:  # this attempt's writes, not a killed one's
            seen |= {p.name for p in root.glob(".tmp-step-*") if _mtime(p) >= started}
            time.sleep(0.005)
        assert all(r.is_alive() for r in ranks), "a rank ended before its kill"
        time.sleep(rng.uniform(0, 0.25))
        for rank in rng.sample(ranks, 2):  # both ranks, in either order, a moment apart
            os.kill(rank.pid, signal.SIGKILL)
            time.sleep(rng.uniform(0, 0.02))
        for rank in ranks:
            rank.join()
        newest = checkpoint.latest(root)  # verified here, every file: an independent check of the ranks' seal
        expected_from.append(newest.name if newest else None)  # None: killed before the first one, starts fresh
    final = subprocess.run([sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(run), "--resume",
                            "--master-port", str(_free_port())],
                           env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(built)},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=600, check=False)
    assert final.returncode == 0, final.stderr.decode()[-2000:]
    print("\nFIGURES resumed from", expected_from)
    assert len(expected_from) == kills and len(set(expected_from)) > kills // 2  # the kills moved through the run
    assert [e["from"] for e in events(run, "resume")] == expected_from
    assert losses(run) == losses(tmp_path / "whole")
    last = checkpoint.latest(tmp_path / "whole" / "checkpoints")
    assert checkpoint.latest(root).name == last.name
    a = torch.load(last / "engine.pt", weights_only=True)["model"]
    b = torch.load(root / last.name / "engine.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # renamed into place meanwhile
        return 0.0


# -- the spike guard ---------------------------------------------------------------------------------

def poison(monkeypatch, stage: int, position: int, corrupt_weights: bool = False) -> None:
    """The batch at `position` of `stage` is bad: its loss is NaN, or (`corrupt_weights`) it passes
    the guard but leaves NaN weights, so the spike shows at the next step, after a checkpoint."""
    original = StageRunner.take_step

    def take_step(self, taken):
        step = original(self, taken)
        if step is not None and (taken.index, step.position) == (stage, position):
            if not corrupt_weights:
                return dataclasses.replace(step, loss=float("nan"))
            with torch.no_grad():
                for parameter in self.recovery.engine.model.parameters():
                    parameter.fill_(float("nan"))
        return step

    monkeypatch.setattr(StageRunner, "take_step", take_step)


def test_a_poisoned_batch_right_after_a_stage_start_rolls_back_once_and_finishes(tmp_path, monkeypatch) -> None:
    # the first stage learns repetitive text to a low loss: a rollback to the second stage's start that
    # kept the first stage's loss statistics would read the second stage's normal loss as spikes
    plan = load_plan(make_plan_file(tmp_path, steps=20, checkpoint_every=100, repetitive=True))
    plan.task.stages[0].lr = 1e-2  # its loss ends near 1.6 with no spike of its own; the second stage's runs near 5
    poison(monkeypatch, stage=1, position=0)
    summary = train(plan, tmp_path / "run", resume=False,
                    options=TrainOptions(show_progress=False, spike_warmup_steps=4))
    first_stage_steps = plan.stages[0].steps
    assert [e["step"] for e in events(tmp_path / "run", "spike")] == [first_stage_steps + 1]
    [rollback] = events(tmp_path / "run", "rollback")
    assert rollback["to"] == f"step-{first_stage_steps:08d}" and rollback["steps_back"] == 0
    assert summary["finished"] and summary["rollbacks"] == 1


def test_a_poisoned_batch_before_the_newest_checkpoint_steps_back_to_an_older_one(tmp_path, monkeypatch) -> None:
    plan = load_plan(make_plan_file(tmp_path, steps=12, checkpoint_every=4))
    per_step = plan.chosen.layout.global_batch
    poison(monkeypatch, stage=0, position=7 * per_step, corrupt_weights=True)  # step 8; checkpoint 8 holds NaN
    summary = train(plan, tmp_path / "run", resume=False, options=QUIET)
    assert [e["step"] for e in events(tmp_path / "run", "spike")] == [9, 9]
    first, second = events(tmp_path / "run", "rollback")
    assert first["to"] == "step-00000008" and first["steps_back"] == 0
    assert second["to"] == "step-00000004" and second["steps_back"] == 1
    assert second["discarded"] == ["step-00000008"]
    # everything since the older checkpoint, to the end of the repeat's batch (the first rollback had
    # skipped step 9's batch, so the redone step 9 read the one after it)
    assert first["skipped"] == [8 * per_step, 9 * per_step] and second["skipped"] == [4 * per_step, 10 * per_step]
    assert summary["finished"] and summary["rollbacks"] == 2 and summary["nan"] is True
    assert all(m["loss"] == m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl"))


def test_a_rollback_with_a_damaged_stage_start_checkpoint_redoes_the_end_of_the_previous_stage(tmp_path,
                                                                                                monkeypatch) -> None:
    plan = load_plan(make_plan_file(tmp_path, steps=4, checkpoint_every=2))
    per_step = plan.chosen.layout.global_batch
    verifies = checkpoint.problem
    monkeypatch.setattr(checkpoint, "problem",
                        lambda path: "damaged by the test" if path.name == "step-00000004" else verifies(path))
    poison(monkeypatch, stage=1, position=1 * per_step)  # step 6, the second step of the second stage
    summary = train(plan, tmp_path / "run", resume=False, options=QUIET)
    [rollback] = events(tmp_path / "run", "rollback")
    assert rollback["to"] == "step-00000002" and rollback["skipped"] == [per_step, 2 * per_step]
    assert "step-00000004" in [e["path"] for e in events(tmp_path / "run", "checkpoint_damaged")]
    assert [e["stage"] for e in events(tmp_path / "run", "stage_end")] == ["language", "language", "math"]
    assert summary["finished"] and [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [
        1, 2, 3, 4, 5, 6, 7, 8]


def test_the_lowered_learning_rate_ends_with_its_stage(tmp_path, monkeypatch) -> None:
    plan = load_plan(make_plan_file(tmp_path, steps=4))
    poison(monkeypatch, stage=0, position=2 * plan.chosen.layout.global_batch)
    train(plan, tmp_path / "run", resume=False, options=QUIET)
    starts = events(tmp_path / "run", "stage_start")
    assert [s["lr"] for s in starts] == [stage.lr for stage in plan.task.stages]  # the second stage at full lr
    assert events(tmp_path / "run", "rollback")[0]["lr_scale"] == 0.5


def test_the_rollback_budget_counts_every_rollback_of_the_run_across_resumes(tmp_path, monkeypatch) -> None:
    plan, run = load_plan(make_plan_file(tmp_path, steps=4)), tmp_path / "run"
    per_step = plan.chosen.layout.global_batch
    poison(monkeypatch, stage=0, position=1 * per_step)
    original = StageRunner.take_step
    poison(monkeypatch, stage=0, position=2 * per_step)  # the batch after the skipped one is bad too
    assert StageRunner.take_step is not original
    one = TrainOptions(show_progress=False, max_rollbacks=1)
    with pytest.raises(RuntimeError, match="after 1 rollbacks"):
        train(plan, run, resume=False, options=one)
    assert len(events(run, "rollback")) == 1
    # a supervisor resuming the run: the budget is spent (the checkpoint, taken before, says 0 rollbacks)
    with pytest.raises(RuntimeError, match="after 1 rollbacks"):
        train(plan, run, resume=True, options=one)
    assert len(events(run, "rollback")) == 1
    summary = train(plan, run, resume=True, options=TrainOptions(show_progress=False, max_rollbacks=3))
    assert summary["finished"] and summary["rollbacks"] == 3


# -- distributed -------------------------------------------------------------------------------------

def test_the_process_group_gets_the_timeout_flag(tmp_path, monkeypatch) -> None:
    seen = {}

    def init_process_group(backend, **kwargs):
        seen.update(kwargs, backend=backend)
        raise Crash  # the test ends here: the group is not made

    monkeypatch.setattr(trainer.launch.dist, "init_process_group", init_process_group)
    plan = load_plan(make_plan_file(tmp_path, steps=2))
    with pytest.raises(Crash):
        trainer.launch.train_rank(plan, tmp_path / "run", False, TrainOptions(timeout_s=42.0), distributed=True)
    assert seen["timeout"].total_seconds() == 42.0 and seen["backend"] == "gloo"


FAIL_RANK_ONE = '''
import os
if os.environ.get("RANK") == "1" and "TORCHELASTIC_RUN_ID" in os.environ:  # the worker of global rank 1
    from trainer.stage_runner import StageRunner
    record = StageRunner.record
    def fail_after_step_one(self, stage, step):
        record(self, stage, step)
        raise RuntimeError("injected failure on rank 1")
    StageRunner.record = fail_after_step_one
'''


@pytest.mark.slow
def test_a_failing_rank_brings_the_other_node_down_within_the_timeout_with_its_error_printed(tmp_path) -> None:
    plan = make_plan_file(tmp_path, steps=4, layout_fields={"dp": 2, "mbs": 1, "gas": 2, "zero": 0})
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FAIL_RANK_ONE)  # rank 1's process fails after its first step
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])}
    port, timeout_s = _free_port(), 30
    nodes = [subprocess.Popen([sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(tmp_path / "run"),
                               "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                               "--master-port", str(port), "--timeout-s", str(timeout_s)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for rank in (0, 1)]
    failing_err = nodes[1].communicate(timeout=600)[1].decode()
    failed_at = time.time()
    other_err = nodes[0].communicate(timeout=timeout_s + 60)[1].decode()
    assert nodes[1].returncode != 0 and "injected failure on rank 1" in failing_err
    assert nodes[0].returncode != 0, other_err[-2000:]
    assert time.time() - failed_at < timeout_s + 30
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_a_node_that_never_joins_fails_the_rendezvous_within_timeout_s_naming_it(tmp_path) -> None:
    """Issue 31 finding 6: torchrun's static rendezvous waited its own 600 s for a missing node
    whatever --timeout-s said; now node 0 alone gives up after --timeout-s, in one line."""
    plan = make_plan_file(tmp_path, steps=2, layout_fields={"dp": 2, "mbs": 1, "gas": 2, "zero": 0})
    timeout_s, started = 4, time.time()
    alone = subprocess.run([sys.executable, "-m", "advisor.cli", "train", str(plan), "--out", str(tmp_path / "run"),
                            "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                            "--master-port", str(_free_port()), "--timeout-s", str(timeout_s)],
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2, alone.stderr[-2000:]
    assert "rendezvous timed out" in alone.stderr and "1 of 2 nodes joined" in alone.stderr
    assert "Traceback" not in alone.stderr
    assert time.time() - started < timeout_s + 40  # interpreter, torch and torchrun's start on 2 loaded cores


# -- sealed by every writer --------------------------------------------------------------------------

@pytest.mark.slow
def test_a_rank_that_cannot_fsync_leaves_no_sealed_checkpoint_and_the_run_resumes_from_the_previous_one(
        tmp_path) -> None:
    import torch.distributed.fsdp  # noqa: F401  (imported before forking)
    from torch.multiprocessing import ProcessRaisedException

    from profiler.ranks import launch
    from trainer.seal import FSYNC_FAILURE_ENV

    plan = make_plan_file(tmp_path, steps=4, checkpoint_every=2,
                          layout_fields={"dp": 2, "mbs": 1, "gas": 2, "zero": 3})  # FSDP2: each rank writes a shard
    loaded = load_plan(plan)
    loaded.engine = "fsdp2"
    loaded.write(plan)
    _train_forked(plan, tmp_path / "clean")
    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    with pytest.raises(ProcessRaisedException, match=r"step 4 is not sealed \(rank 1: fsync of \S+ failed"):
        _train_forked(plan, run, **{FSYNC_FAILURE_ENV: "rank=1,step=4"})
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-00000004", "step-00000000", "step-00000002"]
    assert not (root / ".tmp-step-00000004" / checkpoint.MANIFEST).exists()
    manifest = json.loads((root / "step-00000002" / checkpoint.MANIFEST).read_text())
    writers = {name: entry["rank"] for name, entry in manifest["files"].items()}
    # DCP names each rank's shard after it; rank 1 hashed its own shard and RNG state
    assert manifest["ranks"] == 2 and {"dcp/__1_0.distcp": 1, "rng-1.pt": 1}.items() <= writers.items()
    assert {"dcp/__0_0.distcp": 0, "dcp/.metadata": 0, "trainer.json": 0}.items() <= writers.items()

    _train_forked(plan, run, resume=True)
    assert [e["from"] for e in events(run, "resume")] == ["step-00000002"]
    assert losses(run) == losses(tmp_path / "clean")

    # verified in parallel: each rank hashes the files of its rank; rank 1 finds its damaged shard
    newest = checkpoint.latest(root)
    shard = newest / "dcp" / "__1_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped, the size kept
    launch(_verifying_rank, 2, (_free_port(), str(root), str(tmp_path)))
    rank_0, rank_1 = (json.loads((tmp_path / f"verified-{rank}.json").read_text()) for rank in (0, 1))
    assert rank_0["problem"] == rank_1["problem"] == "dcp/__1_0.distcp does not match its sha256"
    assert rank_0["good"] == rank_1["good"] != newest.name  # both passed over it, to the same older one
    assert rank_1["hashed"][0] == f"{newest.name}/dcp/__1_0.distcp"
    rank_1_files = ("/dcp/__1_0.distcp", "/rng-1.pt")
    assert all(name.endswith(rank_1_files) for name in rank_1["hashed"])
    assert rank_0["hashed"] and not any(name.endswith(rank_1_files) for name in rank_0["hashed"])


def _verifying_rank(rank: int, port: int, root: str, out: str) -> None:
    """Rank `rank` of 2 chooses the newest good checkpoint of `root`, recording the files it hashed."""
    from profiler.ranks import finish_rank, init_rank
    from trainer import seal

    init_rank(rank, 2, port, distributed=True, threads=1)
    hashed, sha256 = [], seal.sha256

    def recording(path: Path) -> str:
        hashed.append(str(path.relative_to(root)))
        return sha256(path)

    seal.sha256 = recording
    good, damaged = checkpoint.good_checkpoints(Path(root))
    Path(out, f"verified-{rank}.json").write_text(json.dumps({"good": good[0].name, "problem": damaged[0][1],
                                                              "hashed": hashed}))
    finish_rank(True)


def test_a_checkpoint_its_only_rank_cannot_fsync_gets_no_manifest_and_a_bad_injection_is_one_line(
        tmp_path, monkeypatch) -> None:
    from trainer import seal

    def save(step: int) -> Path:
        return checkpoint.save(tmp_path, step, {"global_step": step},
                               lambda d: torch.save({"w": torch.ones(2)}, d / "engine.pt"), keep=3)

    monkeypatch.setenv(seal.FSYNC_FAILURE_ENV, "rank=0,step=2")
    assert checkpoint.problem(save(1)) is None
    with pytest.raises(seal.NotSealed, match=r"step 2 is not sealed \(rank 0: fsync of engine.pt failed"):
        save(2)
    assert not (tmp_path / ".tmp-step-00000002" / checkpoint.MANIFEST).exists()
    assert checkpoint.latest(tmp_path).name == "step-00000001"
    monkeypatch.setenv(seal.FSYNC_FAILURE_ENV, "rank=one")
    with pytest.raises(UsageError, match="ADVISOR_INJECT_FSYNC_FAILURE='rank=one': expected rank=R"):
        save(3)


def _slow_sealing_rank(rank: int, port: int, root: str, timeout_s: float, out: str) -> None:
    """Rank 1 hashes slowly (the injected delay, longer than the group's timeout, before each of its
    files); the save must wait for it. Then the same wait on the training group, which times out."""
    import torch.distributed as dist

    from profiler.ranks import init_rank
    from trainer.seal import seal_timeout

    if rank == 1:
        os.environ[checkpoint.DELAY_ENV] = str(timeout_s * 1.5)
    init_rank(rank, 2, port, distributed=True, threads=1, timeout_s=timeout_s)
    checkpoint.save(Path(root), 1, {"global_step": 1}, lambda d: None, keep=1)
    sealed = checkpoint.latest(Path(root)) is not None
    started = time.time()
    try:
        time.sleep(timeout_s * 1.5 if rank == 1 else 0)
        dist.barrier()
        timed_out = False
    except RuntimeError:
        timed_out = True
    waited = time.time() - started
    Path(out, f"rank-{rank}.json").write_text(json.dumps([sealed, timed_out, waited, seal_timeout().total_seconds()]))
    os._exit(0)  # the training group is broken now: no orderly teardown


@pytest.mark.slow
def test_the_seal_waits_on_a_slow_rank_longer_than_the_process_group_timeout(tmp_path) -> None:
    from profiler.ranks import launch
    from trainer.seal import SEAL_TIMEOUT_FACTOR, SEAL_TIMEOUT_FLOOR

    timeout_s = 2.0
    launch(_slow_sealing_rank, 2, (_free_port(), str(tmp_path / "checkpoints"), timeout_s, str(tmp_path)))
    sealed, timed_out, waited, seal_timeout_s = json.loads((tmp_path / "rank-0.json").read_text())
    assert sealed and checkpoint.latest(tmp_path / "checkpoints").name == "step-00000001"
    assert timed_out and waited < timeout_s * 1.5  # the training group's own wait gave up
    # the group's timeout was read (torch's 30-minute default would give 3 hours): 6 x 2 s, raised to the floor
    assert seal_timeout_s == max(SEAL_TIMEOUT_FLOOR.total_seconds(), SEAL_TIMEOUT_FACTOR * timeout_s) == 600


# -- what a resume reads and must match (issue 31, finding 7) ------------------------------------------

@pytest.mark.parametrize("zero,bf16", [(1, False), (2, False), (2, True), (3, False)])
def test_saved_ranks_counts_the_data_parallel_ranks_deepspeed_wrote_at_every_zero_stage(tmp_path, zero,
                                                                                        bf16) -> None:
    """The files of a dp=2 checkpoint named by DeepSpeed's own naming methods: ZeRO-1/2 write one
    model-states file whatever the dp size, so counting those read 1 rank and sent every dp>1
    ZeRO-1/2 resume through the universal-checkpoint conversion."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    class Namer:  # what those methods read of an engine: ZeRO-3 partitions the weights
        checkpoint_mp_rank = 0
        _get_zero_ckpt_prefix = DeepSpeedEngine._get_zero_ckpt_prefix

        def zero_optimization_partition_weights(self) -> bool:
            return zero == 3

    namer = Namer()
    for rank in range(2):
        for name in (DeepSpeedEngine._get_ckpt_name(namer, str(tmp_path), checkpoint.ENGINE_TAG, pp_placeholder=rank),
                     DeepSpeedEngine._get_rank_zero_ckpt_name(namer, str(tmp_path), checkpoint.ENGINE_TAG, 0, rank,
                                                              bf16)):
            Path(name).parent.mkdir(exist_ok=True)
            Path(name).write_bytes(b"")
    model_states = len(list((tmp_path / checkpoint.ENGINE_TAG).glob("*_model_states.pt")))
    assert model_states == (2 if zero == 3 else 1)  # the naming this guards against
    assert checkpoint.saved_ranks(tmp_path) == 2
    assert checkpoint.saved_ranks(tmp_path / "elsewhere") is None


def test_an_oom_relaunch_request_of_another_plan_is_ignored_and_one_of_this_plan_is_followed(tmp_path,
                                                                                             monkeypatch) -> None:
    from trainer.oom import request_relaunch

    for name, stale in [("stale", True), ("this-plan", False)]:
        plan, run = crashed_at_step_5(tmp_path / name, monkeypatch)
        replacement = plan.chosen.layout.model_copy(update={"mbs": 2, "gas": 2})  # same processes and batch
        # a re-planned run (another task here) keeps the file an out-of-memory relaunch of its old plan wrote
        request_relaunch(run, _changed(plan, "task") if stale else plan, replacement, [plan.chosen.layout],
                         {"event": "oom_fallback"})
        summary = train(plan, run, resume=True, options=QUIET)
        assert summary["finished"]
        assert summary["layout_used"] == (plan.chosen.layout if stale else replacement).short()


def save_tiny_weights(folder: Path, seed: int = 0, **changes) -> Path:
    """A tiny model of the plan's config (with `changes`), initialised from `seed`, saved as an HF folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from test_trainer import CONFIG

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**CONFIG, **changes})).save_pretrained(str(folder))
    return folder


def test_weights_of_another_model_are_refused_naming_the_fields_that_differ(tmp_path) -> None:
    plan_path = make_plan_file(tmp_path, steps=2)
    plan, run = load_plan(plan_path), tmp_path / "run"
    other = save_tiny_weights(tmp_path / "other", intermediate_size=96, num_hidden_layers=1)
    with pytest.raises(UsageError, match="intermediate_size: 64 in the plan, 96 in the weights; num_hidden_layers: "
                                         "2 in the plan, 1 in the weights"):
        train(plan, run, resume=False, options=TrainOptions(show_progress=False, weights=str(other)))
    assert not (run / RUN_FILE).exists()  # refused before the run dir was claimed: the next try starts clean
    result = CliRunner().invoke(app, ["train", str(plan_path), "--out", str(run), "--weights", str(other)])
    assert result.exit_code == 2 and "intermediate_size: 64 in the plan, 96 in the weights" in result.output
    same = save_tiny_weights(tmp_path / "same")
    assert train(plan, run, resume=False, options=TrainOptions(show_progress=False, weights=str(same)))["finished"]


def test_a_resume_after_data_prepare_would_switch_to_prepared_data_and_is_refused(tmp_path, monkeypatch) -> None:
    """The default data is chosen at every start: raw files, or the task's data.out once `advisor data
    prepare` has written it. The run read raw data; its resume would read the shards."""
    from test_trainer import CONFIG
    from trainer.data.prepare import prepare
    from trainer.data.tokenizer import TOKENIZERS_DIR

    plan = load_plan(make_plan_file(tmp_path, checkpoint_every=2, config={**CONFIG, "vocab_size": 2048}))
    plan.task.data.tokenizer = str(TOKENIZERS_DIR / "demo-tiny")  # what `advisor data prepare` tokenizes with
    run = tmp_path / "run"
    with monkeypatch.context() as patch, pytest.raises(Crash):
        crash_after(patch, 3)
        train(plan, run, resume=False, options=QUIET)
    prepare(plan.task)  # into the task's data.out, fresh: the default for the next start
    with pytest.raises(UsageError, match=r"another data \(its kind or content\)"):
        train(plan, run, resume=True, options=QUIET)


def test_a_resume_whose_data_or_weights_content_changed_is_refused(tmp_path, monkeypatch) -> None:
    plan_path = make_plan_file(tmp_path, steps=2)
    plan, run = load_plan(plan_path), tmp_path / "run"
    weights = save_tiny_weights(tmp_path / "weights")
    options = TrainOptions(show_progress=False, weights=str(weights), max_steps_per_stage=1)
    train(plan, run, resume=False, options=options)
    record = json.loads((run / RUN_FILE).read_text())
    stat = (weights / "model.safetensors").stat()
    assert record["file_digests"][str((weights / "model.safetensors").resolve())][:2] == [stat.st_size,
                                                                                          stat.st_mtime_ns]
    save_tiny_weights(weights, seed=1)  # the same model, other weights: the same size
    assert (weights / "model.safetensors").stat().st_size == stat.st_size
    with pytest.raises(UsageError, match=r"another weights \(their content\)"):
        train(plan, run, resume=True, options=options)
    save_tiny_weights(weights)  # back as they were (seeded): a new file time, the same content
    train(plan, run, resume=True, options=options)
    source = Path(plan.task.base_dir) / "data" / "lang.jsonl"
    source.write_text(source.read_text().replace("cat", "cow"))
    with pytest.raises(UsageError, match=r"another data \(its kind or content\)"):
        train(plan, run, resume=True, options=options)


# -- a resume that extends (issue 32) -----------------------------------------------------------------

def one_stage_run(tmp_path: Path, run: str, *extra: str) -> list[dict]:
    """`advisor train` of a plan made without a task over a small JSON-lines file (made once), in
    process; the run's metrics."""
    plan, data = tmp_path / "plan.yaml", tmp_path / "rows.jsonl"
    if not plan.is_file():
        made = CliRunner().invoke(app, ["plan", "--model", "demo-tiny", "--hardware", "cpu", "--gpus-per-node", "1",
                                        "--seq-len", "32", "--global-batch", "2", "--top", "1", "--out", str(plan)])
        assert made.exit_code == 0, made.output
        words = "the cat sat on a mat while dogs ran in the park".split()
        data.write_text("".join(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(40))}) + "\n"
                                for i in range(40)))
    result = CliRunner().invoke(app, ["train", str(plan), "--out", str(tmp_path / run), "--data", str(data),
                                      "--no-show-progress", *extra])
    assert result.exit_code == 0, result.output
    return read_jsonl(tmp_path / run / "metrics.jsonl")


def test_resume_with_more_steps_extends_a_finished_constant_rate_run_bitwise_as_if_asked_from_the_start(
        tmp_path) -> None:
    from safetensors.torch import load_file

    whole = one_stage_run(tmp_path, "whole", "--steps", "6", "--lr-schedule", "constant")
    first = one_stage_run(tmp_path, "extended", "--steps", "3", "--lr-schedule", "constant")
    assert len(first) == 3 and json.loads((tmp_path / "extended" / "summary.json").read_text())["finished"]
    extended = one_stage_run(tmp_path, "extended", "--resume", "--steps", "6", "--lr-schedule", "constant")
    assert [(m["step"], m["loss"], m["lr"]) for m in extended] == [(m["step"], m["loss"], m["lr"]) for m in whole]
    a, b = (load_file(tmp_path / run / "model" / "model.safetensors") for run in ("whole", "extended"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    [changed] = events(tmp_path / "extended", "length_changed")
    assert changed["was"] == [3] and changed["stage_steps"] == [6] and changed["step"] == 3
    assert json.loads((tmp_path / "extended" / "summary.json").read_text())["steps"] == 6
    # the run's length is now 6: resuming it as it is trains nothing more
    assert one_stage_run(tmp_path, "extended", "--resume", "--steps", "6", "--lr-schedule", "constant") == extended


def test_resume_with_more_steps_is_refused_where_the_schedule_decays_over_the_runs_length(tmp_path) -> None:
    one_stage_run(tmp_path, "run", "--steps", "3")  # the default schedule: warm-up and cosine over the run's steps
    plan = tmp_path / "plan.yaml"
    result = CliRunner().invoke(app, ["train", str(plan), "--out", str(tmp_path / "run"), "--data",
                                      str(tmp_path / "rows.jsonl"), "--resume", "--steps", "6"])
    assert result.exit_code == 2
    # warm-up of 20 steps, clamped to the stage's: step 1 had peak/3, with 6 steps peak/6 (peak 3e-4)
    assert "step 1, already trained, had learning rate 0.0001 and would have 5e-05" in " ".join(result.output.split())
    with pytest.raises(UsageError, match="stage 'train' ran 3 steps, the new length gives it 2"):
        train(load_plan(tmp_path / "run" / "plan.yaml"), tmp_path / "run", resume=True,
              options=TrainOptions(show_progress=False, max_steps_per_stage=2))


def test_a_run_json_of_an_older_trainer_is_compared_on_the_fields_it_holds(tmp_path) -> None:
    from trainer.file_digests import FileDigests
    from trainer.run_identity import fingerprint, mismatch

    plan = load_plan(make_plan_file(tmp_path, steps=2))
    current = fingerprint(plan, plan.chosen.layout, QUIET, None, None, FileDigests())
    # before data_source, weights, tokenizer and length: its task digest counted the stages' lengths
    older = {key: current[key] for key in ("seed", "model", "seq_len", "global_batch", "engine")}
    assert mismatch({**older, "task": current["task_sized"], "data": "mtimes"}, current) is None
    assert mismatch({**older, "task": current["task"]}, current).startswith("task (task: ")
    relearnt = fingerprint(_changed(plan, "task"), plan.chosen.layout, QUIET, None, None, FileDigests())
    assert mismatch(current, relearnt).startswith("task (task: ")  # a stage's lr is not its length
    longer = plan.model_copy(deep=True)
    longer.task.stages[0].tokens *= 2
    longer.stages[0].steps *= 2
    resized = fingerprint(longer, plan.chosen.layout, QUIET, None, None, FileDigests())
    assert mismatch(current, resized) is None and resized["length"] != current["length"]  # the loop judges it
