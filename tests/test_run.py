"""`advisor run`: verification trials of the top plans and the feedback of measured steps into the
profile (profiler/feedback.py, trainer/verify.py, advisor/cli/run_chain.py)."""

from __future__ import annotations

import datetime as dt
import json
import random

import pytest

from specs.capabilities import config_shape, runnable_problem
from advisor.cli.run_chain import TRAINER_SPACE, RunOptions, run_chain, trainable_plan
from specs.errors import UsageError
from specs.plan_file import load_plan
from specs.core import Layout
from presets import load_task
from planner.plan import PlanOptions, make_plan
from planner.search import SearchSpace
from presets import load_hardware, load_model
from planner.feedback import (feed_back, observation, predict_step, refit, refit_checked,
                               relative_errors, rms, with_efficiency)
from specs.profile import Feedback, HardwareProfile, HostFingerprint, Inventory, load_profile
from specs.run_dir import EVENTS_FILE, VERIFY_FILE, JsonLines
from trainer.verify import Trial, Verification, apply, choose, verify, write_verification

from test_trainer import make_plan_file  # the tiny model's plan file, shared with the trainer's tests

MODEL = load_model("demo-tiny")
# the "real machine" the synthetic steps come from
# gemm stays at the profile's measured rate (planner.calibration.MEASURED): the refit does not move it
TRUE = {"gemm": 1.0, "memory_bandwidth": 0.2, "adapter_gemm": 0.3, "micro_batch_overhead_s": 0.08}

RUN_1 = [Layout(mbs=m, gas=g, seq=256, dtype="fp32", recompute=r)
         for m, g, r in ((1, 16, "none"), (4, 4, "none"), (16, 1, "none"), (4, 4, "full"))]
RUN_2 = [Layout(mbs=m, gas=g, seq=256, dtype="fp32", method=meth)
         for m, g, meth in ((2, 8, "full"), (8, 2, "full"), (4, 4, "lora"), (2, 8, "lora"))]


def _cpu():
    return with_efficiency(load_hardware("cpu"), {"gemm": 1.0, "memory_bandwidth": 1.0})


def _observed(layouts: list[Layout], noise: float, seed: int, source: str = "verify"):
    """Steps of `layouts` as the TRUE machine would time them, with multiplicative noise."""
    rng = random.Random(seed)
    truth = with_efficiency(_cpu(), TRUE)
    out = []
    for layout in layouts:
        obs = observation(source, MODEL, layout, step_s=1.0, predicted_step_s=0.0, threads=1)
        measured = predict_step(obs, truth) * (1 + rng.uniform(-noise, noise))
        out.append(obs.model_copy(update={"step_s": measured}))
    return out


def test_refit_recovers_the_factors_that_generated_the_steps() -> None:
    observations = _observed(RUN_1 + RUN_2, noise=0.0, seed=0)
    factors = refit(observations, _cpu())
    for name, value in TRUE.items():
        assert factors[name] == pytest.approx(value, rel=1e-6), name
    # and predictions with them match every step
    assert max(map(abs, relative_errors(observations, with_efficiency(_cpu(), factors)))) < 1e-9


def test_adding_a_second_run_never_makes_the_combined_error_worse() -> None:
    hardware = _cpu()
    first = _observed(RUN_1, noise=0.08, seed=1)
    after_first = with_efficiency(hardware, refit(first, hardware))
    combined = first + _observed(RUN_2, noise=0.08, seed=2)
    result = refit_checked(combined, after_first)
    # the factors of the first run's fit are a feasible point of the combined problem: least
    # squares over the combined set can only match or beat them
    assert result.error_before == pytest.approx(rms(relative_errors(combined, after_first)))
    assert result.error_after <= result.error_before + 1e-12
    assert not result.kept_old
    # the uncalibrated machine (factors 1, 1) predicts far worse than either
    assert rms(relative_errors(combined, hardware)) > 3 * result.error_before
    # with 8% noise the refit predicts the noise-free truth within the noise (the two factors
    # themselves trade off: these layouts' memory-bound time is a near-constant share of the GEMMs')
    truth = _observed(RUN_1 + RUN_2, noise=0.0, seed=0)
    fitted = with_efficiency(hardware, result.factors_after)
    assert max(map(abs, relative_errors(truth, fitted))) < 0.08


def _profile(path, hardware, history: list | None = None) -> None:
    """A profile of a 2-core CPU (one thread per device) at `hardware`, holding `history` if given."""
    inventory = Inventory(device_type="cpu", backend="gloo", device_name="test cpu", devices_per_node=2,
                          device_memory_gib=8, device_reserved_gib=0.3, cpu_cores=2, threads_per_device=1,
                          host_memory_gib=16, host_memory_available_gib=12, intra_node_link="shared memory",
                          inter_node_link="none")
    fingerprint = HostFingerprint(hostname="test", cpu_model="test cpu", torch_version="x")
    feedback = Feedback(observations=history) if history is not None else None
    HardwareProfile(created=dt.datetime.now(dt.timezone.utc), fingerprint=fingerprint, inventory=inventory,
                    hardware=hardware, feedback=feedback).write(path)


def test_two_runs_the_second_predicts_no_worse_and_the_profile_keeps_the_history(tmp_path, monkeypatch) -> None:
    path = tmp_path / "profile.json"
    _profile(path, _cpu())
    said: list[str] = []
    first = feed_back(path, _observed(RUN_1, noise=0.05, seed=3), "run1", said.append)
    second = feed_back(path, _observed(RUN_2, noise=0.05, seed=4), "run2", said.append)
    assert first is not None and second is not None
    # run 1 was predicted with the uncalibrated factors, run 2 with those fitted to run 1
    assert second.new_error_before <= first.new_error_before
    assert first.new_error_before > 0.3 and second.new_error_before < 0.1
    assert second.error_after <= second.error_before
    profile = load_profile(path)
    assert [r.run_dir for r in profile.feedback.rounds] == ["run1", "run2"]
    assert len(profile.feedback.observations) == len(RUN_1) + len(RUN_2)
    assert profile.hardware.efficiency.gemm == pytest.approx(second.factors_after["gemm"])
    assert any("->" in line and "error" in line for line in said)
    # the history is bounded: the oldest observations go first
    monkeypatch.setattr("planner.feedback.MAX_OBSERVATIONS", 10)
    third = _observed(RUN_1, noise=0.05, seed=5)
    feed_back(path, third, "run3", said.append)
    kept = load_profile(path).feedback.observations
    assert len(kept) == 10 and [o.step_s for o in kept[-4:]] == [o.step_s for o in third]


def test_observations_at_another_thread_count_are_recorded_not_fitted(tmp_path) -> None:
    path = tmp_path / "profile.json"
    _profile(path, _cpu())
    other = [o.model_copy(update={"threads": 2}) for o in _observed(RUN_1, noise=0.0, seed=0)]
    said: list[str] = []
    assert feed_back(path, other, "run", said.append) is None
    profile = load_profile(path)
    assert profile.hardware.efficiency.gemm == 1.0 and len(profile.feedback.observations) == len(RUN_1)
    assert "another thread count" in said[0]


def test_refit_without_observations_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        refit([], _cpu())


def test_profile_json_round_trips_the_feedback_record(tmp_path) -> None:
    path = tmp_path / "profile.json"
    _profile(path, _cpu())
    feed_back(path, _observed(RUN_1[:2], noise=0.0, seed=0), "run", lambda _: None)
    data = json.loads(path.read_text())
    assert set(data["feedback"]) >= {"observations", "rounds"}
    assert data["feedback"]["rounds"][0]["error_after"] < data["feedback"]["rounds"][0]["error_before"]


# --------------------------------------------------------------------------------------------
# verification: which candidate to train, and what the harnesses run


def _trial(rank: int, step_s: float | None):
    return Trial(rank=rank, layout=f"#{rank}", predicted_step_s=1.0, predicted_tokens_per_s=4096.0,
                 predicted_peak_bytes=0, measured_step_s=step_s,
                 measured_tokens_per_s=4096 / step_s if step_s else None)


def test_verification_trains_the_fastest_measured_beyond_the_noise_margin() -> None:
    assert choose([_trial(1, 2.0), _trial(2, 1.0), _trial(3, 1.5)])[0] == 2
    assert choose([_trial(1, 1.0), _trial(2, 0.99)])[0] == 1  # 1% faster: noise, the planner's choice stands
    assert choose([_trial(1, None), _trial(2, 3.0), _trial(3, 2.0)])[0] == 3  # the choice failed its trial
    assert choose([_trial(1, None), _trial(2, None)])[0] == 1
    # 10% faster, but the trials' own steps spread by 30%: noise, the planner's choice stands
    noisy = [_trial(1, 2.2), _trial(2, 2.0)]
    noisy[0].steps_s, noisy[1].steps_s = [9.0, 9.0, 2.0, 2.6], [9.0, 9.0, 2.0, 2.0]
    assert choose(noisy)[0] == 1


def test_a_cpu_trial_times_enough_steps_to_see_that_two_layouts_tie() -> None:
    """Measured on 2 shared cores (ms a step, the first 2 warming up): the demo's dp=2 mbs=2 and its
    mbs=1 gas=2 train at the same speed (257 and 254 ms a step over 705 steps). Timed for 2 steps,
    gas=2 measured 10.6% faster and was trained, so that two fresh `advisor run`s trained different
    layouts and printed different tables; over a CPU trial's default 8 timed steps the steps' own
    spread shows the tie, and the planner's choice stands."""
    from trainer.verify import CPU_TRIAL_STEPS, trial_harness

    def trial(rank: int, steps_ms: list[float]) -> Trial:
        t = _trial(rank, sorted(steps_ms[2:])[len(steps_ms[2:]) // 2] / 1000)
        t.steps_s = [ms / 1000 for ms in steps_ms]
        return t

    two_timed = [trial(1, [275, 262, 257, 245]), trial(2, [310, 245, 226, 228])]
    assert choose(two_timed)[0] == 2
    mbs2 = [341, 348, 282, 266, 252, 269, 289, 338, 346, 319]
    gas2 = [345, 331, 274, 269, 269, 277, 266, 248, 254, 284]
    assert choose([trial(1, mbs2), trial(2, gas2)])[0] == 1
    assert choose([trial(1, gas2), trial(2, mbs2)])[0] == 1
    layout = Layout(dp=2, mbs=2, seq=256, dtype="fp32")
    assert trial_harness(layout, "cpu") == ("fork", CPU_TRIAL_STEPS) == ("fork", 10)
    assert trial_harness(layout, "cuda") == ("loop", 4)  # GPUs keep their 4 steps
    assert trial_harness(layout, "cpu", 5) == ("fork", 5)  # --verify-steps still decides


def test_a_trial_is_written_whole_and_its_ints_stay_ints(tmp_path) -> None:
    """verify.json lists every field of a trial, the unfilled ones too, then its step error; its
    events.jsonl line carries the same fields after `event` (Trial is the typed VerifyEvent)."""
    fields = ["rank", "layout", "predicted_step_s", "predicted_tokens_per_s", "predicted_peak_bytes", "harness",
              "threads", "steps", "measured_step_s", "measured_tokens_per_s", "steps_s", "peak_bytes",
              "peak_source", "seconds", "error"]
    trial = Trial(rank=2, layout="tp=2", predicted_step_s=3, predicted_tokens_per_s=4096.0, predicted_peak_bytes=7)
    trial.measured_step_s = 2
    write_verification(tmp_path, Verification(trials=[trial], chosen_rank=1, seconds=1.0, steps=4, reason="r"))
    written = json.loads((tmp_path / VERIFY_FILE).read_text())["trials"][0]
    assert list(written) == fields + ["step_error"]
    assert written["step_error"] == 0.5  # 3 s predicted / 2 s measured - 1
    JsonLines(tmp_path / EVENTS_FILE).write(trial)
    line = (tmp_path / EVENTS_FILE).read_text()
    assert line.startswith('{"event": "verify", "rank": 2, "layout": "tp=2", "predicted_step_s": 3, '
                           '"predicted_tokens_per_s": 4096.0, "predicted_peak_bytes": 7, "harness": "", ')
    assert list(json.loads(line)) == ["event", *fields]
    assert '"measured_step_s": 2, "measured_tokens_per_s": null' in line


def test_a_verified_candidate_becomes_the_plan_with_its_stages_resized() -> None:
    task = load_task("demo")
    plan = make_plan(PlanOptions(model=MODEL, hardware=load_hardware("cpu"), gpus_per_node=2, task=task,
                                 top_k=3, space=SearchSpace(tp_degrees=(1,), pp_degrees=(1,))))
    second = plan.alternatives[0]
    trials = [Trial(rank=r, layout=p.layout.short(), predicted_step_s=1.0, predicted_tokens_per_s=1.0,
                    predicted_peak_bytes=0) for r, p in enumerate([plan.chosen, second], 1)]
    trained = apply(plan, Verification(trials=trials, chosen_rank=2, seconds=1.0, steps=4, reason="#2 measured faster"))
    assert trained.chosen.layout == second.layout
    assert plan.chosen.layout in [p.layout for p in trained.alternatives]
    assert all(s.layout == second.layout and s.step_s == second.estimate.time.step_s for s in trained.stages)
    assert [s.steps for s in trained.stages] == [s.steps for s in plan.stages]  # same global batch
    assert "measured faster" in trained.notes[-1]


def _with_alternatives(plan, layouts: list[Layout], training_s: float):
    """`plan` with `layouts` as its ranked alternatives and its stages predicted to train `training_s`."""
    template = plan.alternatives[0]
    stages = [s.model_copy(update={"hours": training_s / 3600 / len(plan.stages)}) for s in plan.stages]
    return plan.model_copy(update={"alternatives": [template.model_copy(update={"layout": layout})
                                                    for layout in layouts], "stages": stages})


def test_verification_passes_over_a_trial_whose_cold_build_outweighs_the_training() -> None:
    """A fresh `advisor run` of the demo (3 minutes of training) spent 40 s building DeepSpeed's CPU
    op to time two ZeRO candidates predicted slower than its choice: the next candidates that need no
    build are timed instead. An hour's training pays for the build: every top candidate is timed."""
    from trainer.verify import trial_candidates

    plan = make_plan(PlanOptions(model=MODEL, hardware=load_hardware("cpu"), gpus_per_node=2, task=load_task("demo"),
                                 top_k=3, space=SearchSpace(tp_degrees=(1,), pp_degrees=(1,))))
    zero1, zero2 = (Layout(dp=2, zero=z, mbs=2, seq=256, dtype="fp32") for z in (1, 2))
    gas2, pp2 = Layout(dp=2, mbs=1, gas=2, seq=256, dtype="fp32"), Layout(pp=2, mbs=1, gas=4, seq=256, dtype="fp32")
    build_s = lambda layout: 40.0 if layout.zero else 0.0  # noqa: E731  the op is not built yet

    plain = Layout(dp=2, mbs=2, seq=256, dtype="fp32")

    def kept(training_s: float, choice: Layout = plain):
        ranked = _with_alternatives(plan, [zero1, zero2, gas2, pp2], training_s)
        ranked = ranked.model_copy(update={"chosen": ranked.chosen.model_copy(update={"layout": choice})})
        candidates, passed = trial_candidates(ranked, 3, build_s)
        return [p.layout for p in candidates], [p.layout for p in passed]

    assert kept(200.0) == ([plain, gas2, pp2], [zero1, zero2])  # 40 s > 10% of 200 s
    assert kept(3600.0) == ([plain, zero1, zero2], [])  # 40 s < 10% of an hour
    assert kept(400.0) == ([plain, zero1, zero2], [])  # exactly 10%: still worth it
    # the choice itself trains through DeepSpeed: the build is paid whatever the trials, so none is passed over
    assert kept(200.0, choice=Layout(dp=2, zero=3, mbs=2, seq=256, dtype="fp32")) == (
        [Layout(dp=2, zero=3, mbs=2, seq=256, dtype="fp32"), zero1, zero2], [])


def test_a_cold_build_is_priced_only_on_a_cpu_whose_deepspeed_op_is_not_built(monkeypatch) -> None:
    from trainer import native_ops

    zero1, plain = Layout(dp=2, zero=1, mbs=2, seq=256, dtype="fp32"), Layout(dp=2, mbs=2, seq=256, dtype="fp32")
    monkeypatch.setattr(native_ops.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(native_ops, "cpu_comm_op_built", lambda: False)
    assert native_ops.cold_build_s(zero1, "auto") == native_ops.COLD_BUILD_S == 40.0
    assert native_ops.cold_build_s(plain, "auto") == 0.0  # the plain engine builds nothing
    monkeypatch.setattr(native_ops, "cpu_comm_op_built", lambda: True)
    assert native_ops.cold_build_s(zero1, "auto") == 0.0
    monkeypatch.setattr(native_ops, "cpu_comm_op_built", lambda: False)
    monkeypatch.setattr(native_ops.torch.cuda, "is_available", lambda: True)  # a GPU's DeepSpeed builds no CPU op
    assert native_ops.cold_build_s(zero1, "auto") == 0.0


@pytest.mark.slow
def test_verification_trials_time_what_the_trainer_runs() -> None:
    """Verification trials and calibration time the trainer's own engines (trainer/timed_steps.py):
    two forked ZeRO-1 ranks of a planned layout give, step by step, the losses of one process
    stepping the trainer's plain engine over the same four micro-batches (same seed, learning rate
    and recomputation): data parallelism equals accumulation. (At this learning rate weight decay
    and clipping move the losses by less than the tolerance; that the steps run the trainer's
    engines, `build_engine`, is what carries them.)"""
    import statistics

    from test_trainer import CONFIG
    from specs.core import ModelSpec
    from trainer.engines import make_engine
    from trainer.loop import TrainOptions
    from trainer.model import build_model
    from trainer.timed_steps import LEARNING_RATE, SEED, random_batch, time_layout
    from trainer.verify import trial_harness

    steps, vocab = 3, CONFIG["vocab_size"]
    model = ModelSpec(name="tiny", hf_config=CONFIG)
    planned = Layout(dp=2, zero=1, mbs=1, gas=2, seq=32, dtype="fp32", recompute="selective")
    timed = time_layout(model, planned, steps=steps, warmup=1, threads=1)
    assert len(timed.steps_s) == steps and timed.step_s > 0

    single = Layout(dp=1, zero=0, mbs=1, gas=4, seq=32, dtype="fp32", recompute="full")
    engine = make_engine(build_model(model, single, SEED), single, None, TrainOptions().clip)
    trainer = []
    for step in range(1, steps + 1):
        batches = [random_batch(planned, vocab, rank, step, micro) for rank in range(2) for micro in range(2)]
        trainer.append(statistics.fmean(engine.micro_step(ids) for ids in batches))
        engine.optimizer_step(LEARNING_RATE)
    assert timed.losses == pytest.approx(trainer, abs=1e-5)
    assert abs(timed.losses[0] - timed.losses[1]) > 100 * 1e-5  # each step moves the loss by far more than the tolerance

    assert trial_harness(Layout(tp=2, seq=256, dtype="fp32"), "cpu", 4) == ("fork", 4)
    assert trial_harness(Layout(dp=2, seq=256, dtype="fp32"), "cuda", 3) == ("loop", 4)


def test_bad_verify_options_are_one_line_usage_errors(tmp_path) -> None:
    with pytest.raises(UsageError, match="--verify"):
        run_chain(RunOptions(out=tmp_path, verify=-1), say=lambda _: None)
    with pytest.raises(UsageError, match="--verify-steps"):
        run_chain(RunOptions(out=tmp_path, verify_steps=2), say=lambda _: None)


def test_run_trains_only_layouts_the_trainer_runs() -> None:
    """`run` plans over every engine (TP, PP, ZeRO, FSDP2) and then drops what an engine refuses for
    this model: here a LoRA plan split by tensor parallelism and one with more stages than layers."""
    plan = make_plan(PlanOptions(model=MODEL, hardware=load_hardware("cpu"), gpus_per_node=2, task=load_task("demo"),
                                 top_k=3, space=TRAINER_SPACE))
    lora_tp = plan.chosen.model_copy(update={"layout": plan.chosen.layout.model_copy(
        update={"dp": 1, "tp": 2, "method": "lora"})})
    deep_pp = plan.chosen.model_copy(update={"layout": plan.chosen.layout.model_copy(update={"dp": 1, "pp": 8})})
    shape = config_shape(MODEL.hf_config)
    assert "LoRA adapters are not split" in runnable_problem(lora_tp.layout, shape, "cpu")
    assert "pp=8 exceeds the 4 decoder layers" in runnable_problem(deep_pp.layout, shape, "cpu")
    broken = plan.model_copy(update={"chosen": lora_tp, "alternatives": [deep_pp, plan.chosen, *plan.alternatives]})
    said: list[str] = []
    fixed = trainable_plan(broken, said.append)
    assert fixed.chosen.layout == plan.chosen.layout
    assert [p.layout for p in fixed.alternatives] == [p.layout for p in plan.alternatives]
    assert "not runnable here" in said[0]
    with pytest.raises(UsageError, match="runs none of the planned layouts"):
        trainable_plan(plan.model_copy(update={"chosen": lora_tp, "alternatives": [deep_pp]}), said.append)


@pytest.mark.slow
def test_verification_times_a_pipeline_candidate_through_the_trainers_pipeline_engine(tmp_path) -> None:
    """A pp=2 candidate on CPU: forked ranks step the trainer's pipeline engine. On GPUs (which
    forked children cannot use) the real loop under torchrun times it on the task's first stage, for
    a few steps, and the trial directory loses its checkpoints: run here directly."""
    from trainer.verify import _loop_trial

    fields = {"dp": 1, "tp": 1, "pp": 2, "zero": 0, "mbs": 1, "gas": 4, "seq": 32, "dtype": "fp32",
              "recompute": "none", "method": "full", "offload": "none", "sp": False, "vpp": 1,
              "stage_layers": None, "recompute_layers": None}
    plan = load_plan(make_plan_file(tmp_path, devices=2, steps=6, layout_fields=fields))
    said: list[str] = []
    result = verify(plan, 1, tmp_path / "run", steps=4, say=said.append)
    trial = result.trials[0]
    assert trial.harness == "fork" and trial.error is None, (trial.error, said)
    assert trial.measured_step_s and trial.measured_step_s > 0 and len(trial.steps_s) == 4
    assert trial.measured_tokens_per_s == pytest.approx(4 * 32 / trial.measured_step_s)

    looped = _loop_trial(plan, plan.chosen, 4, tmp_path / "run" / "verify" / "1", tmp_path / "run")
    assert looped["step_s"] > 0 and len(looped["steps_s"]) == 4
    assert not (tmp_path / "run" / "verify" / "1" / "checkpoints").exists()
