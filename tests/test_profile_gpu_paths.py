"""The profile's GPU-only parts, driven on a CPU (issue 28): the host's time per launched op, DeepSpeed's
own host Adam where the trainer offloads to it, and calibration steps on CUDA (bf16, out-of-memory
layouts left out, the fit on a GPU's cost model). Each figure is checked against a truth the test
plants: an injected host delay per op, a fake DeepSpeedCPUAdam of known rate, step times made by the
cost model at known factors."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specs.core import ModelSpec
from planner.calibration import fit_to_steps, with_factors
from planner.cost_model import estimate_from_trace
from presets import load_hardware
from profiler import hardware_bench as hb
from profiler import host_ops
from profiler import run_profile as rp
from profiler.calibration_steps import calibration_model, measure_calibration_steps
from profiler.inventory import take_inventory
from profiler.model_trace import trace_model

CPU = torch.device("cpu")
INJECTED_S = 1e-3  # host time added to every op: far above this CPU's own ~20 us per op


class _SlowHost(TorchDispatchMode):
    """A slower host: every non-view op it dispatches costs `seconds` more (Python, dispatch, launch), on
    a clock of its own that the bench's stopwatch reads (real time plus what the host added), so the
    planted cost is exact whatever else this machine runs."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.delayed, self.added_s = seconds, 0, 0.0

    def now(self) -> float:
        return time.perf_counter() + self.added_s

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.delayed += 1
            self.added_s += self.seconds
        return func(*args, **(kwargs or {}))


def _bench_on_host(monkeypatch, host: _SlowHost) -> dict:
    """`bench_host_op` with every step run on `host`, timed on its clock."""
    build = host_ops.training_step

    def step_on_host(model, device):
        step = build(model, device)

        def run() -> None:
            with host:
                step()
        return run

    monkeypatch.setattr(host_ops, "training_step", step_on_host)
    monkeypatch.setattr(hb, "stopwatch_for", lambda device: hb.HostStopwatch(device, now=host.now))
    return host_ops.bench_host_op(CPU, budget_s=0.3)


def test_the_host_time_per_op_is_what_the_host_adds_to_each_op(monkeypatch) -> None:
    """A host that spends 1 ms more on each op reads that much more per op (over the ops the trace
    counts: a step's non-view ops include a few views' worth the count leaves out) within 10%; and the
    ops counted are the trace's own for that model."""
    plain = _bench_on_host(monkeypatch, _SlowHost(0.0))  # the dispatch mode's own cost on both sides
    slowed = _bench_on_host(monkeypatch, _SlowHost(INJECTED_S))
    per_step, warm_step = _SlowHost(0.0), host_ops.training_step(host_ops.tiny_decoder(CPU), CPU)
    warm_step()  # a first step dispatches more (set-up) than the warm ones the bench times
    with per_step:
        warm_step()
    expected = INJECTED_S * per_step.delayed / slowed["ops"]
    assert slowed["host_op_s"] - plain["host_op_s"] == pytest.approx(expected, rel=0.10)

    trace = trace_model(ModelSpec(name="host-op", hf_config=host_ops.HOST_OP_CONFIG), host_ops.HOST_OP_SEQ,
                        dtype="fp32", device_type="cpu", use_disk_cache=False)
    traced = (host_ops.HOST_OP_CONFIG["num_hidden_layers"] * (trace.layer.fwd_ops + trace.layer.bwd_ops)
              + trace.head.fwd_ops + trace.head.bwd_ops + trace.embedding.fwd_ops + trace.embedding.bwd_ops)
    assert plain["ops"] == pytest.approx(traced, rel=0.05)  # the embedding's and the loss's few left aside


class _FakeDeepSpeedCPUAdam(torch.optim.Optimizer):
    """DeepSpeed's host Adam as a stand-in of known speed: `RATE` parameters per second."""

    RATE = 2.0e8
    built_with: dict = {}

    def __init__(self, params, lr: float = 1e-3, adamw_mode: bool = True) -> None:
        super().__init__(params, {"lr": lr})
        type(self).built_with = {"adamw_mode": adamw_mode}

    def step(self, closure=None):
        count = sum(p.numel() for group in self.param_groups for p in group["params"])
        until = time.perf_counter() + count / self.RATE
        while time.perf_counter() < until:
            pass


def _with_fake_deepspeed(monkeypatch, optimizer: type | None) -> None:
    adam = types.ModuleType("deepspeed.ops.adam")
    if optimizer is not None:
        adam.DeepSpeedCPUAdam = optimizer
    ops = types.ModuleType("deepspeed.ops")
    ops.adam = adam
    monkeypatch.setitem(sys.modules, "deepspeed.ops", ops)
    monkeypatch.setitem(sys.modules, "deepspeed.ops.adam", adam)


def test_deepspeeds_host_adam_is_timed_in_adamw_mode_at_its_own_rate(monkeypatch) -> None:
    _with_fake_deepspeed(monkeypatch, _FakeDeepSpeedCPUAdam)
    result = hb.bench_deepspeed_cpu_adam([(1 << 20,), (1 << 19,)], budget_s=0.3)
    assert result["params_per_s"] == pytest.approx(_FakeDeepSpeedCPUAdam.RATE, rel=0.1)
    assert _FakeDeepSpeedCPUAdam.built_with == {"adamw_mode": True}  # what our engine's AdamW config runs
    _with_fake_deepspeed(monkeypatch, None)  # the op does not load: said, not raised
    assert "ImportError" in hb.bench_deepspeed_cpu_adam([(1 << 10,)], budget_s=0.1)["error"]


def _raw(host_op_s: float, deepspeed_adam: dict | None) -> dict:
    timing = {"median_s": 0.01, "repeats": 5, "stable": True, "min_s": 0.01, "max_s": 0.01}
    raw = {"gemm": {"bf16": {"tflops": 700.0, "shapes": [{"tflops": 700.0, "repeats": 5, "stable": True}]}},
           "rss_gib": 0.5, "memory": {"bytes": 1 << 30, "gbs": 4000.0, **timing},
           "adam": {"params_per_s": 5e7, "params": 1, "tensors": 1, **timing},
           "adam_by_size": {"sizes": [1 << 16, 1 << 23], "relative": [1.0, 0.4]},
           "host_op": {"ops": 249, "step_s": 249 * host_op_s, "host_op_s": host_op_s, **timing}}
    if deepspeed_adam is not None:
        raw["deepspeed_adam"] = deepspeed_adam
    return raw


def test_a_gpu_profile_prices_its_measured_host_time_and_deepspeeds_adam_and_a_cpu_profile_neither() -> None:
    ds = {"params_per_s": 1.6e9, "params": 1, "tensors": 1, "median_s": 0.01, "repeats": 5, "stable": True}
    gpu = take_inventory("cpu", 1, 1, 1, reserved_gib=0.5).model_copy(
        update={"device_type": "cuda", "device_name": "NVIDIA H200", "device_memory_gib": 140.0})
    hardware = rp.hardware_from(_raw(25e-6, ds), gpu, name="profile:h200")
    assert hardware.efficiency.host_op_s == 25e-6
    assert hardware.cpu_adam_params_per_s == 1.6e9 and hardware.cpu_adam_by_tensor is None
    names = {m.name: m.value for m in rp.measurements_of(_raw(25e-6, ds))}
    assert names["host_op"] == pytest.approx(25.0) and names["deepspeed_cpu_adam"] == 1.6e9
    # DeepSpeed's op did not load: torch's AdamW rate and curve, and the note says why
    failed = _raw(25e-6, {"error": "ImportError: no compiler"})
    assert rp.hardware_from(failed, gpu, name="p").cpu_adam_params_per_s == 5e7
    assert any("DeepSpeed's CPU Adam did not load" in note for note in rp.suspect_notes(failed))
    cpu = rp.hardware_from(_raw(25e-6, None), take_inventory("cpu", 1, 1, 1, reserved_gib=0.5), name="profile:cpu")
    assert cpu.efficiency.host_op_s == 0.0  # the host is the device: its calibrated rates hold that time
    assert cpu.cpu_adam_params_per_s == 5e7 and cpu.cpu_adam_by_tensor is not None


def test_calibration_on_a_gpu_runs_bf16_steps_and_leaves_out_those_out_of_memory() -> None:
    seen = []

    def runner(model, layout, *, steps, threads, warmup):
        seen.append(layout)
        return None if layout.mbs == 8 else 0.01 * layout.mbs

    tiny = ModelSpec(name="gqa", hf_config={**host_ops.HOST_OP_CONFIG, "max_position_embeddings": 4096})
    steps = measure_calibration_steps(tiny, 1, 1, False, runner, device_type="cuda")
    assert {lay.dtype for lay in seen} == {"bf16"} and seen[0].seq == 1024  # twice the CPU's 512
    assert [lay.mbs for lay in steps.out_of_memory] == [8] and all(lay.mbs != 8 for lay in steps.layouts)
    assert steps.measured_s == [0.01 * lay.mbs for lay in steps.layouts]
    assert "left out: " in rp.calibration_notes(steps)[0]
    cpu = measure_calibration_steps(tiny, 1, 1, False, lambda m, lay, **kw: 0.01)
    assert {lay.dtype for lay in cpu.layouts} == {"fp32"} and cpu.layouts[0].seq == 512


def test_the_fit_recovers_a_gpus_factors_from_bf16_steps_above_its_host_floor() -> None:
    """Steps made by the H200's cost model (host floor on) at a known memory factor: the fit finds it
    within 3% and then prices every step within 1% (the floor's kinks make the model piecewise linear,
    which the fit's secants cross: exact on a CPU's affine model, not here); the CPU's own effects are
    not fitted on a GPU (planner.calibration.NOT_FITTED_ON_GPU)."""
    from bench.gpu_check import LLAMA_1B

    hardware = load_hardware("h200-141g").model_copy(update={"devices_per_node": 1})
    model = calibration_model(ModelSpec(name="llama-1b", hf_config=LLAMA_1B))
    steps = measure_calibration_steps(model, 1, 1, False, lambda m, lay, **kw: 1.0, device_type="cuda")
    cases = [(trace_model(model, lay.seq, dtype=lay.dtype, method=lay.method, lora_rank=lay.lora_rank,
                          device_type="cuda"), lay) for lay in steps.layouts]
    made = with_factors(hardware, gemm=1.0, memory_bandwidth=0.6)
    measured = [estimate_from_trace(trace, lay, made).time.step_s for trace, lay in cases]
    fit = fit_to_steps(cases, measured, hardware)
    assert set(fit) == {"gemm", "memory_bandwidth"}
    assert fit["memory_bandwidth"] == pytest.approx(0.6, rel=0.03)
    fitted = with_factors(hardware, **fit)
    for (trace, lay), seconds in zip(cases, measured):
        assert estimate_from_trace(trace, lay, fitted).time.step_s == pytest.approx(seconds, rel=0.01), lay.short()
