"""Micro-benchmarks of one device and of the links between devices.

Every figure is a median over warm samples that continue until the median is stable (it moves less
than `rel_tol` when a few more samples arrive) or the time budget is spent; the repeat count is
recorded next to it. Warm: each distinct kernel and shape runs once untimed first (`warmed`): lazy
kernel loading, cuBLAS and cuDNN set-up and the allocator's first blocks are not what a training
step sees, and a cold 256^3 probe once read an H200's bf16 GEMMs at 20 TFLOP/s (issue 28). A CUDA
sample is timed with CUDA events on the device's stream, a CPU's with perf_counter (`stopwatch_for`).
A figure no healthy device produces is measured once more and, if it stays, kept as suspect
(`remeasured_once`). Each function runs inside one rank; the collectives need every rank of the
world to call them in the same order (see profiler/run_profile.py).

* GEMM throughput per dtype, over the matmul shapes the target model runs (its linear layers'
  forward, input-gradient and weight-gradient products), or square shapes without a model;
* memory bandwidth: a streaming copy (`dst.copy_(src)`, 2 bytes moved per byte copied), repeated
  back to back within a sample;
* host <-> device copies (pinned, CUDA; on CPU the host is the device: the copy above);
* the fused attention kernel's rate relative to the GEMMs', per sequence length;
* the CPU optimizer step rate: `torch.optim.AdamW` (single-tensor) parameters per second, what
  optimizer offload with DeepSpeed's `torch_adam` and plain CPU training both run;
* all-reduce, all-gather, reduce-scatter and send/recv at several sizes for each process-group
  size and scope (inside a node, across nodes), fitted to the alpha-beta model that
  planner/collectives.py uses: t = a * latency + b * bytes / bandwidth, with nccl-tests' bus
  factors a, b (Thakur, Rabenseifner and Gropp 2005, Table 1).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from profiler.gemm_shapes import GemmShape, linear_gemms, model_gemm_shapes, square_gemm_shapes  # noqa: F401 (hb.X)
from profiler.model_trace import attention_model_flops
from specs import environment
from specs.errors import UsageError

# nccl-tests' bus-bandwidth definitions: bytes through each device's link per byte of buffer,
# and latency steps of the ring, for a group of n ranks.
RING_FACTORS: dict[str, Callable[[int], tuple[float, float]]] = {
    "all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "all_gather": lambda n: (n - 1, (n - 1) / n),
    "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
    "send_recv": lambda n: (1, 1.0),
}
COLLECTIVES = tuple(RING_FACTORS)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Timing:
    """Median seconds of one sample, how many samples, and their spread."""

    median_s: float
    repeats: int
    min_s: float
    max_s: float
    stable: bool


@dataclass
class Repeater:
    """Repeat a timed sample until its median is stable.

    Stops once at least `min_repeats` samples exist and the median moved less than `rel_tol`
    over the last `window` samples, or after `budget_s` of sampling, or at `max_repeats`.
    `agree` turns a local sample into the one every rank uses (the slowest rank's), so that
    ranks stop after the same number of repeats, which collectives require.
    """

    budget_s: float = 1.0
    min_repeats: int = 5
    max_repeats: int = 200
    rel_tol: float = 0.02
    window: int = 3
    agree: Callable[[float], float] | None = None
    samples: list[float] = field(default_factory=list)

    def run(self, sample: Callable[[], float]) -> Timing:
        self.samples = []
        stable = False
        while len(self.samples) < self.max_repeats:
            seconds = sample()
            self.samples.append(self.agree(seconds) if self.agree else seconds)
            if len(self.samples) >= max(self.min_repeats, self.window + 1):
                now = statistics.median(self.samples)
                before = statistics.median(self.samples[: -self.window])
                if abs(now - before) <= self.rel_tol * now:
                    stable = True
                    break
            if sum(self.samples) >= self.budget_s:  # identical on every rank when they agree
                break
        return Timing(statistics.median(self.samples), len(self.samples), min(self.samples),
                      max(self.samples), stable)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch(Protocol):
    """Times one window of device work: `start()`, queue the work, `stop()` returns its seconds."""

    def start(self) -> None: ...
    def stop(self) -> float: ...


@dataclass
class HostStopwatch:
    """`now` (perf_counter) around the window, the device synchronized at both ends: a CPU runs its
    work as it is called, so the host's clock is the device's."""

    device: torch.device
    now: Callable[[], float] = time.perf_counter
    started: float = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self.started = self.now()

    def stop(self) -> float:
        synchronize(self.device)
        return self.now() - self.started


class CudaEventStopwatch:
    """Two CUDA events on the device's current stream around the window: the GPU's own time of the
    work queued between them, without the host's synchronize after it (perf_counter around a
    synchronize counts the host's wake-up, tens of microseconds, into every sample)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self.begin.record(torch.cuda.current_stream(self.device))

    def stop(self) -> float:
        self.end.record(torch.cuda.current_stream(self.device))
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3  # elapsed_time is in milliseconds


def stopwatch_for(device: torch.device) -> Stopwatch:
    """How a sample on `device` is timed (the seam the tests drive with a fake clock)."""
    return CudaEventStopwatch(device) if device.type == "cuda" else HostStopwatch(device)


# Test hook: "RANK=FACTOR[,RANK=FACTOR]" makes those ranks' GEMM and memory samples FACTOR times
# longer (they sleep the difference after the timed window, and count it), a straggler on demand.
SLOW_RANKS_ENV = "ADVISOR_PROFILE_SLOW_RANKS"


def slowdown_of_this_rank() -> float:
    rank = os.environ.get("RANK", "0")
    for item in environment.read(SLOW_RANKS_ENV).split(","):
        key, _, factor = item.partition("=")
        if key.strip() == rank and factor:
            try:
                return max(1.0, float(factor))
            except ValueError:
                raise UsageError(f"{SLOW_RANKS_ENV}: {item!r} is not RANK=FACTOR") from None
    return 1.0


def _timed(fn: Callable[[], Any], device: torch.device, inner: int = 1,
           slowdown: float = 1.0) -> Callable[[], float]:
    """A sample: `inner` calls of `fn`, seconds per call (`slowdown` > 1: the straggler test hook)."""
    stopwatch = stopwatch_for(device)

    def sample() -> float:
        stopwatch.start()
        for _ in range(inner):
            fn()
        seconds = stopwatch.stop()
        if slowdown > 1:  # the rank really takes that much longer, so that its peers wait for it
            time.sleep((slowdown - 1) * seconds)
            seconds *= slowdown
        return seconds / inner
    return sample


def _inner_count(fn: Callable[[], Any], device: torch.device, target_s: float) -> int:
    """Calls per sample so that one sample lasts about `target_s` (tiny kernels are noisy), sized on
    the fastest of calls of `fn` (warm already) timed one by one, back to back for about `target_s`
    and at least 3 unless they are long: on a loaded CPU a lone call may wait 10-20 ms for its
    threads to be scheduled, which sized the samples of a 20 us GEMM at one call each."""
    timed = _timed(fn, device)
    fastest = spent = timed()
    calls = 1
    while calls < 1000 and (spent < target_s or (calls < 3 and fastest < 4 * target_s)):
        seconds = timed()
        fastest, spent, calls = min(fastest, seconds), spent + seconds, calls + 1
    return _calls_within(target_s, fastest)


def _calls_within(target_s: float, per_call_s: float) -> int:
    return max(1, min(1000, int(target_s / max(per_call_s, 1e-7))))


def warmed(fn: Callable[[], Any], device: torch.device, target_s: float, slowdown: float = 1.0) -> Callable[[], float]:
    """Samples of `fn` once it is warm: one untimed call (lazy kernel loading, cuBLAS and cuDNN
    set-up, the allocator's first blocks, a pinned buffer's first touch), then as many calls per
    sample as last about `target_s`. A sample far shorter than that (sized while a loaded CPU
    held the threads back) resizes the ones after it."""
    fn()
    synchronize(device)
    inner = _inner_count(fn, device, target_s)
    timed = _timed(fn, device, inner, slowdown)

    def sample() -> float:
        nonlocal inner, timed
        seconds = timed()
        if seconds * inner < target_s / 4 and inner < 1000:
            inner = _calls_within(target_s, seconds)
            timed = _timed(fn, device, inner, slowdown)
        return seconds
    return sample


# Figures no healthy device produces. Such a figure is measured once more (`remeasured_once`); if it
# stays, the result carries `suspect` (the reason), the profile keeps it as measured, and the
# hardware does not price it (profiler.run_profile.hardware_from).
ATTENTION_FLOOR = 0.01  # the attention kernel's FLOP rate relative to the GEMMs' (H200, issue 28: 1e-5)


def impossible_gemm(result: dict[str, Any], datasheet_tflops: float | None) -> str | None:
    """A `bench_gemm` result with a shape above the device's datasheet peak: the timing missed work."""
    fastest = max(s["tflops"] for s in result["shapes"])
    if datasheet_tflops and fastest > datasheet_tflops:
        return (f"a {result['dtype']} GEMM ran at {fastest:.4g} TFLOP/s, above the datasheet's "
                f"{datasheet_tflops:g}")
    return None


def impossible_attention(result: dict[str, Any]) -> str | None:
    """A `bench_attention` result below ATTENTION_FLOOR of the GEMM rate at some sequence length:
    a kernel that fell back to an unfused path, or a cold sample."""
    low = [f"{relative:.2g} at seq {seq}" for seq, relative in zip(result["seqs"], result["relative"])
           if relative < ATTENTION_FLOOR]
    if low:
        return f"attention ran at {', '.join(low)} of the GEMM rate (below {ATTENTION_FLOOR:g})"
    return None


def remeasured_once(measure: Callable[[], dict[str, Any]],
                    impossible: Callable[[dict[str, Any]], str | None]) -> dict[str, Any]:
    """`measure()`, once more if its figure is impossible, and then still impossible: with `suspect`."""
    result = measure()
    if impossible(result) is None:
        return result
    result = measure()
    reason = impossible(result)
    return {**result, "suspect": f"{reason}, measured twice"} if reason else result


# --------------------------------------------------------------------------------------------
# GEMM


def bench_gemm(shapes: list[GemmShape], dtype: str, device: torch.device, budget_s: float,
               shrink: bool = True) -> dict[str, Any]:
    """Achieved FLOP/s per shape, and the step-weighted rate over the set: total FLOPs of one
    step's GEMMs over their total time (what a training step of the model would see). `shrink`:
    cut a shape's rows so that one call fits the budget (a slow dtype); else every shape as given."""
    per_shape = []
    total_flops = total_s = 0.0
    torch_dtype = TORCH_DTYPES[dtype]
    per_shape_s = budget_s / len(shapes)
    per_call_s = per_shape_s / 4
    rate = _probe_rate(torch_dtype, device, per_call_s) if shrink else 0.0
    for full in shapes:
        rows = _rows_that_fit(full, torch_dtype, device, per_call_s, rate) if shrink else full.m
        shape = GemmShape(rows, full.k, full.n, full.count * full.m / rows, full.name)
        a, b = _linear_operands(shape, torch_dtype, device)
        sample = warmed(lambda: torch.matmul(a, b), device, target_s=0.01, slowdown=slowdown_of_this_rank())
        # the median of warm samples, not the fastest: on a GPU the two agree; on a shared CPU the
        # median is what training's GEMMs see there, and calibration fits no GEMM factor over it
        # (planner/calibration.py: MEASURED)
        timing = Repeater(budget_s=per_shape_s).run(sample)
        per_shape.append({"shape": [shape.m, shape.k, shape.n], "name": shape.name, "count": shape.count,
                          "tflops": shape.flops / timing.median_s / 1e12, **timing.__dict__})
        total_flops += shape.count * shape.flops
        total_s += shape.count * timing.median_s
        del a, b
    return {"dtype": dtype, "tflops": total_flops / total_s / 1e12, "shapes": per_shape}


PROBE = GemmShape(256, 256, 256, name="probe")


def _probe_rate(dtype: torch.dtype, device: torch.device, per_call_s: float) -> float:
    """FLOP/s of a warm 256^3 GEMM, the fastest of 3 samples: where a shape's rows start from. A slow
    dtype (bf16 without hardware support runs ~1 GFLOP/s on some CPUs) would otherwise spend minutes
    on one call of a model's shape."""
    a = torch.ones(PROBE.m, PROBE.k, device=device, dtype=dtype)
    sample = warmed(lambda: torch.matmul(a, a), device, target_s=min(0.01, per_call_s))
    return PROBE.flops / min(sample() for _ in range(3))


def _rows_that_fit(full: GemmShape, dtype: torch.dtype, device: torch.device, per_call_s: float,
                   rate: float) -> int:
    """Rows of `full` (all of them, or at least 16) whose call lasts about `per_call_s` at `rate`,
    refined on the shape itself: a GEMM's rate grows with its size (a GPU's 256^3 runs at a few
    percent of its 8192^3), so where the probe's rate cuts rows, the cut shape is timed (warm) and
    the rows are chosen again at its own rate, until the rate holds within 10%."""
    def fitting(at_rate: float) -> int:
        return max(16, min(full.m, int(full.m * per_call_s * at_rate / full.flops)))

    rows = fitting(rate)
    for _ in range(3):
        if rows >= full.m:
            break
        shape = GemmShape(rows, full.k, full.n, name=full.name)
        a, b = _linear_operands(shape, dtype, device)
        call = lambda: torch.matmul(a, b)  # noqa: E731
        call()  # warm-up: a new shape may load a new kernel
        synchronize(device)
        measured = shape.flops / _timed(call, device)()
        if abs(measured / rate - 1) <= 0.1:
            break
        rate, before, rows = measured, rows, fitting(measured)
        if rows == before:  # at the floor of 16 rows
            break
    return rows


def _linear_operands(shape: GemmShape, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two operands as an nn.Linear lays them out (`linear_gemms`' names): the forward
    multiplies by the transposed (out x in) weight, the weight gradient by the transposed output
    gradient; the input gradient's operands are contiguous. A CPU runs a 64k-wide head's forward
    at 70 GFLOP/s this way and its input gradient at 90 (both contiguous: 60 and 90)."""
    m, k, n = shape.m, shape.k, shape.n
    a = torch.randn(k, m, device=device).to(dtype).t() if shape.name.endswith("wgrad") else \
        torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(n, k, device=device).to(dtype).t() if shape.name.endswith("fwd") else \
        torch.randn(k, n, device=device).to(dtype)
    return a, b


def head_gemm_widths(device_type: str) -> list[int]:
    """Vocabularies a device may hold, at which the LM head's GEMMs are measured."""
    return [4096, 16384, 65536] if device_type == "cpu" else [32768, 131072, 262144]


def best_tflops(result: dict[str, Any]) -> float:
    """`bench_gemm`'s step-weighted rate from each shape's fastest sample."""
    flops = sum(s["count"] * 2.0 * s["shape"][0] * s["shape"][1] * s["shape"][2] for s in result["shapes"])
    return flops / sum(s["count"] * s["min_s"] for s in result["shapes"]) / 1e12


def bench_head_gemms(hidden: int, tokens: int, widths: list[int], dtype: str, device: torch.device,
                     budget_s: float, dense: list[GemmShape]) -> dict[str, Any]:
    """The LM head's forward, input- and weight-gradient GEMMs (`linear_gemms` of hidden -> width,
    at the tokens given) at each width, as one step-weighted rate per width relative to the
    decoder's GEMMs (`dense`): a wide head's GEMMs leave the caches that a decoder layer's fit in.
    Each ratio is of fastest samples taken back to back, so that a slow spell of a shared machine
    moves both sides of it (rates from medians swung 0.65-0.9 at one width between widths)."""
    relative = []
    share = budget_s / len(widths) / 2
    for width in widths:
        head = bench_gemm(linear_gemms(tokens, hidden, width), dtype, device, share, shrink=False)
        relative.append(best_tflops(head) / best_tflops(bench_gemm(dense, dtype, device, share)))
    return {"dtype": dtype, "hidden": hidden, "tokens": tokens, "widths": widths, "relative": relative}


def dtype_supported(dtype: str, device: torch.device) -> bool:
    """Whether a small matmul runs at all in `dtype` (fp16 on some CPUs does not)."""
    try:
        a = torch.ones(8, 8, device=device, dtype=TORCH_DTYPES[dtype])
        torch.matmul(a, a)
        return True
    except RuntimeError:
        return False


# --------------------------------------------------------------------------------------------
# memory and host<->device bandwidth


def bench_memory_bandwidth(device: torch.device, nbytes: int, budget_s: float) -> dict[str, Any]:
    """Streaming copy: reads and writes `nbytes` each, so 2 * nbytes per copy; copies back to back
    for about 10 ms per sample (a GPU copies 1 GiB in well under a millisecond)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    sample = warmed(lambda: dst.copy_(src), device, target_s=0.01, slowdown=slowdown_of_this_rank())
    timing = Repeater(budget_s=budget_s).run(sample)
    return {"bytes": nbytes, "gbs": 2 * nbytes / timing.median_s / 1e9, **timing.__dict__}


def bench_host_device(device: torch.device, nbytes: int, budget_s: float) -> dict[str, Any]:
    """Pinned host -> device and device -> host copies (CUDA only), GB/s each way."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, call in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                       ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        timing = Repeater(budget_s=budget_s / 2).run(warmed(call, device, target_s=0.01))
        out[name] = {"bytes": nbytes, "gbs": nbytes / timing.median_s / 1e9, **timing.__dict__}
    return out


# --------------------------------------------------------------------------------------------
# CPU optimizer


def bench_cpu_adam(shapes: list[tuple[int, ...]], budget_s: float) -> dict[str, Any]:
    """AdamW steps (single-tensor, as our DeepSpeed configs' `torch_adam` and plain CPU training
    run it) over fp32 parameters of the given shapes, on the host. Parameters per second."""
    params = _host_parameters(shapes)
    return _optimizer_rate(params, torch.optim.AdamW(params, lr=1e-4, foreach=False), budget_s)


def bench_deepspeed_cpu_adam(shapes: list[tuple[int, ...]], budget_s: float) -> dict[str, Any]:
    """DeepSpeed's vectorised host Adam (`DeepSpeedCPUAdam`, AdamW mode), what our DeepSpeed engine
    runs on a GPU machine with optimizer offload (trainer/engines/deepspeed_zero.py: `torch_adam` only
    on a CPU), over fp32 parameters of the given shapes. Where its native op cannot be loaded or built
    (no compiler), the result is `{"error": why}`: the offload then has no measured rate. Here it ran
    10x faster than torch's single-tensor AdamW (0.53e9 against 0.054e9 params/s), so pricing an
    offloaded step at torch's rate would be far off (issue 29: an H200's offload step)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        params = _host_parameters(shapes)
        optimizer = DeepSpeedCPUAdam(params, lr=1e-4, adamw_mode=True)
    except Exception as exc:  # ImportError, a failed JIT build (CalledProcessError, RuntimeError), ...
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]}
    return _optimizer_rate(params, optimizer, budget_s)


def _host_parameters(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    """fp32 parameters of these shapes on the host, each with a gradient."""
    params = [torch.nn.Parameter(torch.randn(*s)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def _optimizer_rate(params: list[torch.nn.Parameter], optimizer: Any, budget_s: float) -> dict[str, Any]:
    """Parameters per second of `optimizer.step()` over `params`, its states created first."""
    optimizer.step()  # creates the states
    count = sum(p.numel() for p in params)
    timing = Repeater(budget_s=budget_s).run(_timed(optimizer.step, torch.device("cpu")))
    return {"params": count, "tensors": len(params), "params_per_s": count / timing.median_s,
            **timing.__dict__}


def attention_seqs(device_type: str) -> list[int]:
    """Sequence lengths at which the fused attention kernel's rate is measured."""
    return [256, 1024] if device_type == "cpu" else [1024, 4096]


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Model FLOPs of one causal attention's forward and backward as the trace counts them
    (profiler.model_trace: the two s x s matmuls, full rather than causal-halved, and twice that
    backward), from `attention_model_flops`, the trace's own count."""
    shape = (batch, heads, seq, head_dim)
    return 3.0 * attention_model_flops(shape, shape, shape)


def bench_attention(heads: int, head_dim: int, seqs: list[int], tokens: int, dtype: str, device: torch.device,
                    budget_s: float, dense: list[GemmShape]) -> dict[str, Any]:
    """The fused causal attention kernel (`scaled_dot_product_attention`, as the trainer's models
    run it), forward and backward, at each sequence length over `tokens` tokens, as its counted
    FLOPs' rate relative to the decoder's GEMMs (`dense`), fastest samples back to back as in
    `bench_head_gemms`. On a CPU its counted FLOPs run at 65% of the GEMM rate at seq 256 and 93% at
    1024, which the trace's FLOPs at the dense rate did not see (an 8-layer, 192-wide model with 32-wide
    heads at seq 512-1024 ran 20-30% slower than priced). `head_dim` is a real one (the model's, else
    128, profiler.run_profile.attention_heads): flash attention takes up to 256, and beyond it the
    kernel falls back to an unfused path no model runs."""
    import torch.nn.functional as F

    torch_dtype = TORCH_DTYPES[dtype]
    relative = []
    share = budget_s / len(seqs) / 2
    for seq in seqs:
        batch = max(1, tokens // seq)
        q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch_dtype, requires_grad=True)
                   for _ in range(3))

        def step() -> None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))
            q.grad = k.grad = v.grad = None

        timing = Repeater(budget_s=share).run(warmed(step, device, target_s=0.01))
        rate = attention_flops(batch, heads, seq, head_dim) / timing.min_s / 1e12
        relative.append(rate / best_tflops(bench_gemm(dense, dtype, device, share)))
        del q, k, v
    return {"dtype": dtype, "heads": heads, "head_dim": head_dim, "seqs": seqs, "relative": relative}


# Parameters per tensor at which the host AdamW rate is measured: from a decoder layer's matrices,
# whose states stay in a CPU's caches, to an embedding's, whose do not.
ADAM_TENSOR_SIZES = [1 << 16, 1 << 20, 1 << 23]


def bench_cpu_adam_by_size(sizes: list[int], budget_s: float, base_params_per_s: float) -> dict[str, Any]:
    """The AdamW rate (`bench_cpu_adam`) over tensors of each size (as many as make 2^23
    parameters, at least one), relative to `base_params_per_s`."""
    relative = []
    for size in sizes:
        count = max(1, (1 << 23) // size)
        rate = bench_cpu_adam([(size,)] * count, budget_s / len(sizes))["params_per_s"]
        relative.append(rate / base_params_per_s)
    return {"sizes": sizes, "relative": relative}


def model_param_shapes(dims: dict[str, int], layers: int) -> list[tuple[int, ...]]:
    """Parameter shapes of `layers` Llama-style decoder layers (norms included)."""
    h, inter = dims["hidden_size"], dims["intermediate_size"]
    q = dims["num_heads"] * dims["head_dim"]
    kv = dims["num_kv_heads"] * dims["head_dim"]
    one = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter), (h,), (h,)]
    return one * layers


# --------------------------------------------------------------------------------------------
# collectives


@dataclass
class LinkFit:
    """Alpha-beta fit of one collective: t = a * latency_s + b * bytes / (bandwidth_gbs * 1e9)."""

    bandwidth_gbs: float
    latency_us: float
    residual: float  # worst relative error of the fit over the measured sizes


def fit_alpha_beta(op: str, ranks: int, points: list[tuple[int, float]]) -> LinkFit:
    """The line t = a * L + b * B / bw through the smallest and the largest size (bytes B, seconds t),
    with nccl-tests' bus factors (a, b) of `op`: latency read where nearly all is latency, bandwidth
    where nearly all is transfer, as nccl-tests' small- and large-message columns are read. The
    residual is the worst relative error over every size.

    Not least squares over all sizes: on a loaded host the small sizes take milliseconds of
    scheduling, and a least-squares compromise then moves the bandwidth that large gradient buckets
    see (measured on the 2-core CI machine: 1.9 GB/s against a direct 1.2-1.5 GB/s for 32 MiB)."""
    a, b = RING_FACTORS[op](ranks)
    ordered = sorted(points)
    (small, t_small), (large, t_large) = ordered[0], ordered[-1]
    inv_bw = (t_large - t_small) / (b * (large - small)) if large > small else 0.0
    latency = (t_small - b * small * inv_bw) / a
    if inv_bw <= 0 or latency < 0:  # not a rising line (noise, or latency-bound): all time is transfer
        inv_bw, latency = max(t_large, 1e-12) / (b * large), 0.0
    worst = max(abs((a * latency + b * size * inv_bw) / seconds - 1) for size, seconds in ordered)
    return LinkFit(1 / inv_bw / 1e9, latency * 1e6, worst)


def collective_groups(world: int, local_world: int) -> list[tuple[int, str, list[list[int]]]]:
    """Every (group size, scope, partition of the world into groups) a layout could use.

    Inside a node: consecutive ranks (Megatron places TP, then DP innermost), for every size
    that divides the node. Across nodes: one rank per node (stride `local_world`), for every
    size that divides the node count; these are the links a DP or PP group crossing nodes uses.
    """
    out = []
    for size in range(2, local_world + 1):
        if local_world % size == 0:
            out.append((size, "intra", [list(range(s, s + size)) for s in range(0, world, size)]))
    nodes = world // local_world
    for size in range(2, nodes + 1):
        if nodes % size == 0:
            groups = []
            for base in range(0, world, local_world * size):
                for local in range(local_world):
                    groups.append([base + local + i * local_world for i in range(size)])
            out.append((size, "inter", groups))
    return out


def bench_collectives(
    rank: int, world: int, local_world: int, device: torch.device, sizes: list[int], budget_s: float,
    progress: Callable[[str], None] | None = None, timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """Time every collective for every group size and scope; all groups of a partition run at
    once (every DP group of a job communicates together). A sample is the slowest rank's time.
    Every rank must call this with the same arguments. `timeout_s` bounds each group's set-up
    (new_group otherwise waits torch's default 30 minutes for a peer that died)."""
    import datetime

    import torch.distributed as dist

    timeout = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    results = []
    for size, scope, partition in collective_groups(world, local_world):
        mine = None
        for members in partition:  # new_group is collective: every rank creates every group
            group = dist.new_group(members, **timeout)
            if rank in members:
                mine, my_members = group, members
        assert mine is not None
        index = my_members.index(rank)
        for op in COLLECTIVES:
            points = []
            for nbytes in sizes:
                call = _collective_call(op, nbytes, size, index, my_members, mine, device)
                call()  # warm-up (gloo sets up pairs lazily)
                # Back-to-back calls per sample amortise the ranks' skew leaving the barrier;
                # every rank must make the same number of calls (so one sizing call each).
                inner = int(slowest(_calls_within(0.005, _timed(call, device)())))
                timed = _timed(call, device, inner)
                repeater = Repeater(budget_s=budget_s / len(sizes), min_repeats=3, agree=slowest)

                def sample() -> float:
                    dist.barrier(group=mine)
                    return timed()

                timing = repeater.run(sample)
                points.append((nbytes, timing.median_s))
                results.append({"op": op, "ranks": size, "scope": scope, "bytes": nbytes, **timing.__dict__})
            fit = fit_alpha_beta(op, size, points)
            results.append({"op": op, "ranks": size, "scope": scope, "fit": fit.__dict__})
            if progress:
                progress(f"{op} x{size} {scope}")
        dist.barrier()
    return results


def _collective_call(op: str, nbytes: int, size: int, index: int, members: list[int], group: Any,
                     device: torch.device) -> Callable[[], Any]:
    """One collective on a buffer of `nbytes` (the full buffer: all-reduce's, all-gather's
    output, reduce-scatter's input; send/recv moves it whole between ranks 2i and 2i+1)."""
    import torch.distributed as dist

    elems = max(size, nbytes // 4 // size * size)
    full = torch.ones(elems, dtype=torch.float32, device=device)
    shard = torch.ones(elems // size, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, shard, group=group)
    if op == "reduce_scatter":
        if device.type == "cpu":  # gloo has no reduce_scatter_tensor: reduce, keep one shard
            pieces = list(full.chunk(size))
            return lambda: dist.reduce_scatter(shard, pieces, group=group)
        return lambda: dist.reduce_scatter_tensor(shard, full, group=group)
    peer_index = index + 1 if index % 2 == 0 else index - 1
    if peer_index >= size:  # odd group size: the last rank idles
        return lambda: None
    peer = members[peer_index]
    if index % 2 == 0:
        return lambda: dist.send(full, dst=peer, group=group)
    return lambda: dist.recv(full, src=peer, group=group)
