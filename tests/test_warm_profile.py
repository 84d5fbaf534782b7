"""The profile measures warm kernels (issue 28): a device whose first call of each kernel is slow
(lazy kernel loading, cuBLAS set-up) reads the same figures as one without that first call; a CUDA
device is timed by CUDA events; an impossible figure is measured again and then kept as suspect,
not priced.

The devices here are fakes with their own clock: a GEMM of F FLOPs takes `launch_s + F / peak`
seconds of it, so every figure has an exact truth, and a loaded machine moves none of them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from presets import load_model
from profiler import hardware_bench as hb
from profiler import run_profile as rp
from profiler.inventory import take_inventory
from profiler.model_trace import architecture_dims

SLOW_FIRST = 100.0  # the first call of each kernel takes this many times as long
CHOOSE_STOPWATCH = hb.stopwatch_for


class FakeDevice:
    """A device with its own clock: GEMMs at `peak` FLOP/s after `launch_s`, copies at `copy_gbs`,
    attention at `attention_share` of the GEMM peak; the first call of each distinct kernel and shape
    takes `first_call` times as long."""

    def __init__(self, peak: float, launch_s: float, first_call: float = 1.0, copy_gbs: float = 10.0,
                 attention_share: float = 0.5) -> None:
        self.peak, self.launch_s, self.first_call = peak, launch_s, first_call
        self.copy_gbs, self.attention_share = copy_gbs, attention_share
        self.now_s = 0.0
        self.seen: set[Any] = set()
        self.slow_calls = 0

    def run(self, kernel: Any, seconds: float) -> None:
        if kernel not in self.seen:
            self.seen.add(kernel)
            if self.first_call > 1:
                seconds *= self.first_call
                self.slow_calls += 1
        self.now_s += seconds

    def gemm_s(self, m: int, k: int, n: int) -> float:
        return self.launch_s + 2.0 * m * k * n / self.peak

    def rate(self, shape: list[int]) -> float:
        """The true TFLOP/s of a warm GEMM of this shape."""
        m, k, n = shape
        return 2.0 * m * k * n / self.gemm_s(m, k, n) / 1e12

    def matmul(self, a: torch.Tensor, b: torch.Tensor) -> None:
        (m, k), n = a.shape, b.shape[1]
        self.run(("gemm", m, k, n, a.dtype), self.gemm_s(m, k, n))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        nbytes = dst.numel() * dst.element_size()
        self.run(("copy", nbytes, dst.dtype), self.launch_s + nbytes / (self.copy_gbs * 1e9))
        return dst

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        batch, heads, seq, head_dim = q.shape
        flops = hb.attention_flops(batch, heads, seq, head_dim)  # forward and backward, charged here
        self.run(("attention", tuple(q.shape)), self.launch_s + flops / (self.attention_share * self.peak))
        return q * 1.0  # something to run backward through (real, cheap, off the fake clock)


class FakeEvent:
    """torch.cuda.Event on the fake device's clock: what the GPU's own timer would read."""

    device: FakeDevice
    records: list[float] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at_s: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at_s = self.device.now_s
        FakeEvent.records.append(self.at_s)

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.at_s is not None and end.at_s is not None
        return (end.at_s - self.at_s) * 1e3  # milliseconds, as CUDA's


def on_fake_device(monkeypatch: pytest.MonkeyPatch, device: FakeDevice, stopwatch: str = "host") -> None:
    """Route GEMMs, copies and attention to `device` and time them on its clock: through the host
    stopwatch (perf_counter's seam) or the CUDA-events one (fake events)."""
    monkeypatch.delenv(hb.SLOW_RANKS_ENV, raising=False)
    monkeypatch.setattr(torch, "matmul", device.matmul)
    monkeypatch.setattr(torch.Tensor, "copy_", lambda dst, src, non_blocking=False: device.copy(dst, src))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", device.attention)
    if stopwatch == "host":
        monkeypatch.setattr(hb, "stopwatch_for", lambda d: hb.HostStopwatch(d, now=lambda: device.now_s))
    else:
        monkeypatch.setattr(FakeEvent, "device", device, raising=False)
        monkeypatch.setattr(FakeEvent, "records", [])
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: "stream")
        monkeypatch.setattr(hb, "stopwatch_for", hb.CudaEventStopwatch)


def demo_gemms() -> list[hb.GemmShape]:
    """demo-tiny's decoder GEMMs at 256 tokens, as the quick CPU profile measures them."""
    return hb.model_gemm_shapes(architecture_dims(load_model("demo-tiny").hf_config), 256, head=False)


CPU = torch.device("cpu")

# A CPU-like device, whose shapes all fit their budget, and a slow dtype's (bf16 without hardware
# support), whose shapes the bench cuts so that a call fits its budget.
FAST = dict(peak=100e9, launch_s=20e-6)
SLOW = dict(peak=1e9, launch_s=50e-6)


@pytest.mark.parametrize("stopwatch", ["host", "cuda events"])
@pytest.mark.parametrize("kind,budget_s", [(FAST, 3.0), (SLOW, 0.5)], ids=["fast", "slow dtype"])
def test_a_slow_first_call_leaves_the_gemm_shapes_and_rates_as_without_it(monkeypatch, kind, budget_s,
                                                                           stopwatch) -> None:
    shapes = demo_gemms()
    results, devices = [], []
    for first_call in (1.0, SLOW_FIRST):
        device = FakeDevice(**kind, first_call=first_call)
        on_fake_device(monkeypatch, device, stopwatch)
        results.append(hb.bench_gemm(shapes, "fp32", CPU, budget_s))
        devices.append(device)
    plain, cold = results
    assert devices[1].slow_calls >= len(shapes)  # the slow first calls happened: the bench ran past them
    assert [s["shape"] for s in cold["shapes"]] == [s["shape"] for s in plain["shapes"]]
    for s, t in zip(cold["shapes"], plain["shapes"]):
        assert s["tflops"] == pytest.approx(t["tflops"], rel=0.05)
        assert s["tflops"] == pytest.approx(devices[1].rate(s["shape"]), rel=0.05)  # the device's truth
        assert s["max_s"] <= 1.05 * s["min_s"]  # no sample holds a first call
    assert cold["tflops"] == pytest.approx(plain["tflops"], rel=0.05)

    # a shape whose call fits its share of the budget runs whole; any other is cut to rows whose call
    # fits and is not far below it (the cold probe cut every shape to 16 rows)
    per_call_s = budget_s / len(shapes) / 4
    for s, full in zip(cold["shapes"], shapes):
        if devices[1].gemm_s(full.m, full.k, full.n) <= per_call_s:
            assert s["shape"] == [full.m, full.k, full.n]
        else:
            assert 0.5 * per_call_s <= devices[1].gemm_s(*s["shape"]) <= 1.1 * per_call_s, s["shape"]
            assert s["count"] * s["shape"][0] == pytest.approx(full.count * full.m)  # the same FLOPs a step
    cut = sum(s["shape"][0] < full.m for s, full in zip(cold["shapes"], shapes))
    assert cut == (0 if kind is FAST else 4)  # of the slow dtype: all but the three 128-wide k/v ones


def test_a_gpus_large_gemm_runs_whole_though_a_small_probe_runs_far_below_its_rate(monkeypatch) -> None:
    """A launch-bound 256^3 probe reads a GPU at ~1% of its big GEMMs' rate; the shape is timed at the
    rows that rate allows and, running far faster there, taken whole (a cold probe had cut an H200's
    shapes to 16 rows)."""
    device = FakeDevice(peak=400e12, launch_s=10e-6, first_call=SLOW_FIRST)
    on_fake_device(monkeypatch, device, stopwatch="cuda events")
    full = hb.GemmShape(8192, 1024, 1024, name="fwd")
    assert device.rate([256, 256, 256]) < 0.02 * device.rate([8192, 1024, 1024])
    result = hb.bench_gemm([full], "bf16", CPU, budget_s=4e-3)  # 1 ms a call: the whole shape takes 53 us
    assert result["shapes"][0]["shape"] == [8192, 1024, 1024]
    assert result["tflops"] == pytest.approx(device.rate([8192, 1024, 1024]), rel=0.05)


def test_a_cuda_device_is_timed_by_its_events_and_the_warm_up_is_not_counted(monkeypatch) -> None:
    cuda = torch.device("cuda", 0)
    device = FakeDevice(peak=1e12, launch_s=0.0)
    on_fake_device(monkeypatch, device, stopwatch="cuda events")
    monkeypatch.setattr(hb, "stopwatch_for", CHOOSE_STOPWATCH)  # the device picks it, as in a profile
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert isinstance(hb.stopwatch_for(cuda), hb.CudaEventStopwatch)
    assert isinstance(hb.stopwatch_for(CPU), hb.HostStopwatch)
    calls: list[float] = []

    def kernel() -> None:  # 2 ms of the GPU's clock and none of the host's; the first call 200 ms
        calls.append(device.now_s)
        device.now_s += 0.2 if len(calls) == 1 else 0.002

    timing = hb.Repeater(budget_s=0.2).run(hb.warmed(kernel, cuda, target_s=0.01))
    assert timing.min_s == timing.max_s == pytest.approx(0.002)  # the events' time, not perf_counter's
    assert min(FakeEvent.records) >= 0.2  # every timed window opened after the warm-up call ended
    assert len(calls) > timing.repeats  # samples of several calls each, besides the warm-up


def test_copies_and_attention_are_measured_warm(monkeypatch) -> None:
    device = FakeDevice(peak=100e9, launch_s=20e-6, first_call=SLOW_FIRST, copy_gbs=8.0, attention_share=0.25)
    on_fake_device(monkeypatch, device)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    nbytes = 4 << 20
    memory = hb.bench_memory_bandwidth(CPU, nbytes, 0.2)
    assert memory["gbs"] == pytest.approx(2 * nbytes / (20e-6 + nbytes / 8e9) / 1e9, rel=0.01)
    assert device.slow_calls == 1  # the first copy was slow, and no sample held it
    copies = hb.bench_host_device(CPU, nbytes, 0.2)
    for way in ("h2d", "d2h"):
        assert copies[way]["gbs"] == pytest.approx(nbytes / (20e-6 + nbytes / 8e9) / 1e9, rel=0.01)
        assert copies[way]["max_s"] <= 1.01 * copies[way]["min_s"]
    assert device.slow_calls == 2  # one slow first copy of each size (h2d and d2h share the kernel here)

    dense = [hb.GemmShape(256, 256, 256, name="fwd")]
    attention = hb.bench_attention(2, 32, [64, 128], 256, "fp32", CPU, 0.4, dense)
    gemm_s = device.gemm_s(256, 256, 256)
    for seq, relative in zip(attention["seqs"], attention["relative"]):
        flops = hb.attention_flops(256 // seq, 2, seq, 32)
        truth = flops / (20e-6 + flops / 25e9) / (dense[0].flops / gemm_s)
        assert relative == pytest.approx(truth, rel=0.05), seq


def test_the_attention_bench_runs_a_head_dim_flash_attention_takes() -> None:
    assert rp.attention_heads(None, 4096) == (32, 128)  # not 8 heads of 512 (beyond flash's 256)
    assert rp.attention_heads(None, 1024) == (8, 128)
    dims = architecture_dims(load_model("demo-tiny").hf_config)
    assert rp.attention_heads(dims, dims["hidden_size"]) == (dims["num_heads"], dims["head_dim"])


def test_gpu_copies_are_large_and_cpu_ones_stay_small() -> None:
    for quick in (True, False):
        assert rp.Budget.of(quick, "cuda").copy_bytes >= 1 << 30
        assert rp.Budget.of(quick, "cpu").copy_bytes <= 256 << 20


# ------------------------------------------------------------------------------------------------
# impossible figures


def test_an_impossible_figure_is_measured_once_more_and_kept_as_suspect_only_if_it_stays() -> None:
    def measures(*figures: float):
        taken = list(figures)
        return lambda: {"dtype": "bf16", "shapes": [{"tflops": taken.pop(0)}]}, taken

    once_wrong, left = measures(2000.0, 700.0)
    result = hb.remeasured_once(once_wrong, lambda r: hb.impossible_gemm(r, 989.4))
    assert not left and "suspect" not in result and result["shapes"][0]["tflops"] == 700.0
    twice_wrong, left = measures(2000.0, 1800.0, 700.0)
    result = hb.remeasured_once(twice_wrong, lambda r: hb.impossible_gemm(r, 989.4))
    assert left == [700.0]  # measured twice, not more
    assert "1800 TFLOP/s" in result["suspect"] and "989.4" in result["suspect"]
    assert hb.impossible_gemm({"dtype": "bf16", "shapes": [{"tflops": 2000.0}]}, None) is None  # no datasheet
    assert hb.impossible_attention({"seqs": [1024, 4096], "relative": [0.4, 0.5]}) is None
    assert "seq 1024" in hb.impossible_attention({"seqs": [1024, 4096], "relative": [5e-6, 0.5]})


def test_a_known_gpus_ceiling_is_its_datasheet_and_fp32s_only_without_tf32(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    cuda = torch.device("cuda", 0)
    assert rp.datasheet_tflops(cuda) == {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}  # presets/hardware/h200
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    assert rp.datasheet_tflops(cuda) == {"bf16": 989.4, "fp16": 989.4, "fp32": 494.7}  # TF32's tensor cores
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert "fp32" not in rp.datasheet_tflops(cuda)  # a preset without TF32's figure: no fp32 ceiling
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert rp.datasheet_tflops(cuda) == {}  # unknown: nothing is impossible
    assert rp.datasheet_tflops(CPU) == {}


def test_a_suspect_figure_is_recorded_in_the_profile_and_not_priced_as_measured(monkeypatch) -> None:
    device = FakeDevice(peak=100e9, launch_s=20e-6)
    on_fake_device(monkeypatch, device)
    shapes = [hb.GemmShape(256, 256, 256, name="fwd")]
    ceiling = 0.05  # TFLOP/s: a datasheet the fake device's 0.09 exceeds
    gemm = rp.measured_gemm(shapes, "fp32", CPU, 0.2, ceiling)
    assert gemm["suspect"] and gemm["datasheet_tflops"] == ceiling
    assert rp.priced_tflops(gemm) == ceiling
    assert rp.priced_tflops(rp.measured_gemm(shapes, "fp32", CPU, 0.2, 1.0)) == pytest.approx(device.rate(
        [256, 256, 256]), rel=0.05)
    attention = hb.remeasured_once(lambda: {"dtype": "fp32", "heads": 2, "head_dim": 32, "seqs": [256],
                                            "relative": [1e-5]}, hb.impossible_attention)
    raw = {"gemm": {"fp32": gemm}, "attention": attention, "rss_gib": 0.5,
           "memory": {"bytes": 1 << 20, "gbs": 10.0, "median_s": 1e-4, "repeats": 5, "stable": True},
           "adam": {"params_per_s": 1e8, "median_s": 0.01, "repeats": 5, "stable": True, "params": 1, "tensors": 1}}
    measurements = {m.name: m for m in rp.measurements_of(raw)}
    assert measurements["gemm/fp32"].suspect == gemm["suspect"]
    assert measurements["gemm/fp32"].value == gemm["tflops"]  # kept as measured
    assert measurements["attention/fp32/256"].suspect
    inventory = take_inventory("cpu", 1, 1, 1, reserved_gib=0.5)
    hardware = rp.hardware_from(raw, inventory, name="profile:cpu")
    assert hardware.peak_tflops["fp32"] == ceiling  # priced at no more than the datasheet
    assert hardware.attention is None  # attention priced at the GEMM rate, not at 1e-5 of it
    notes = rp.suspect_notes(raw)
    assert len(notes) == 2 and "gemm/fp32" in notes[0] and "attention" in notes[1]
