"""Measure the peak tensor memory of real training steps of ``demo-tiny`` on the CPU.

The numbers are ground truth for the cost model: each layout trains a randomly initialised
fp32 Llama for a few optimizer steps, and we report (max over ranks, in bytes)

* ``static_bytes``: tensor bytes live right before the forward of step 2, i.e. the model states
  (weights, optimizer states, anything the back-end keeps between steps);
* ``peak_bytes``: the peak over the steady-state steps 2..N (optimizer states already exist);
* ``peak_all_steps_bytes``: the peak over steps 1..N (step 1 also creates the Adam states);
* ``peak_with_setup_bytes``: the peak since the process started, model and engine construction
  included (ZeRO-3 without ``zero.Init`` first builds the full model on every rank);
* ``phase_peak_bytes``: the steady-state peak inside forward, backward and the optimizer step.

How the memory is measured (``method="alloc_hook"``, the default)
-----------------------------------------------------------------
CPU has no ``torch.cuda.max_memory_allocated``; this is its analogue. Every CPU tensor storage,
DeepSpeed's flat buffers, partitions and bucket buffers included, is allocated through
``c10::GetCPUAllocator()``. A small C++ library (profiler/tensor_memory.py, built once into
TORCH_EXTENSIONS_DIR, about 2 s cold) wraps that allocator and keeps an atomic count of live
bytes and their peak, in every thread of the process. It is installed in each rank before the
model is built, so every training tensor is counted; each layout runs in freshly forked ranks.
Like the CUDA counter it counts requested bytes (no allocator rounding) and sees nothing that is
not a tensor (gloo's and DeepSpeed shm_comm's own buffers, Python objects).

Two other methods stay available as cross-checks (``--cross-check``):

* ``profiler``: ``torch.profiler`` with ``profile_memory=True`` reads c10's CPU memory reporter
  ("Total Allocated"). It agrees with the hook to the byte at world 1, but the reporter is
  thread-local: tensors that gloo's worker threads free are never subtracted, so under DDP and
  DeepSpeed its running total drifts upwards (by up to 12 MB per rank with ZeRO-3 here).
* ``memtracker``: real-mode ``torch.distributed._tools.mem_tracker.MemTracker`` (world 1, full
  fine-tuning only: it cannot wrap DDP/DeepSpeed and fails on LoRA's frozen weights). It only
  sees tensors returned by dispatched ops, so it misses a few KB of scratch under recomputation.

Rerun: ``python -m bench.measure_memory`` (table + ``bench/measured_memory.json``; each layout
runs 3 times and keeps the highest peak, since ZeRO-2/3 peaks vary by up to ~1 MB from run to run);
``python -m bench.measure_memory --cross-check`` compares the three methods.
"""

from __future__ import annotations

import os

# DeepSpeed probes for a GPU at import unless told the accelerator; it must be set before import.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import argparse
import bisect
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol

import deepspeed  # noqa: F401  (imported before forking: the ranks inherit it loaded)
import torch
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The engines and steps are `advisor train`'s (trainer/timed_steps.py), as for `advisor profile`
# and the step-time bench.
from bench.layout_dicts import (  # noqa: E402,F401
    DDP_SETTINGS,
    LAYOUT_DEFAULTS,
    MODEL,
    normalize_layout,
    trainer_layout,
    uses_deepspeed,
)
from planner.export import model_deepspeed_config  # noqa: E402
from profiler.ranks import finish_rank, free_port, init_rank  # noqa: E402
from trainer import timed_steps as _steps  # noqa: E402

Layout = dict[str, Any]


DEFAULT_LAYOUTS: list[Layout] = [
    {"world": 1, "zero": 0, "mbs": 1, "seq": 256},
    {"world": 1, "zero": 0, "mbs": 4, "seq": 256},
    {"world": 1, "zero": 0, "mbs": 2, "seq": 512},
    {"world": 1, "zero": 0, "mbs": 4, "seq": 256, "recompute": "full"},
    {"world": 1, "zero": 0, "mbs": 4, "seq": 256, "method": "lora"},
    {"world": 1, "zero": 0, "mbs": 4, "seq": 512, "recompute": "full", "method": "lora"},
    {"world": 2, "zero": 0, "mbs": 2, "seq": 256},
    {"world": 2, "zero": 1, "mbs": 2, "seq": 256},
    {"world": 2, "zero": 2, "mbs": 2, "seq": 256},
    {"world": 2, "zero": 3, "mbs": 2, "seq": 256},
    {"world": 1, "zero": 0, "mbs": 2, "seq": 256, "gas": 2},
]

METHODS = ("alloc_hook", "profiler", "memtracker")  # the first is the default
PHASES = ("forward", "backward", "optimizer")


# --------------------------------------------------------------------------------------------
# Meters: three ways to follow live tensor bytes across step boundaries.
# --------------------------------------------------------------------------------------------


@dataclass
class Region:
    """One measured region of one step: live bytes when it began and ended, peak inside it."""

    step: int
    phase: str  # "forward" | "backward" | "optimizer"
    start_live: int = 0
    peak: int = 0
    end_live: int = 0


@dataclass
class Reading:
    """What one rank measured: the peak before step 1 (construction) and every region."""

    setup_peak: int = 0
    regions: list[Region] = field(default_factory=list)


class Meter(_steps.Meter, Protocol):
    """Follows live tensor bytes; regions are entered and left in order, never nested."""

    def start(self) -> None: ...  # before anything is built
    def finish(self) -> Reading: ...


class ProfilerMeter:
    """Reads c10's profiled CPU memory reporter through ``torch.profiler``.

    Exact only when every allocation and free happens on the profiled thread (world 1).
    """

    def __init__(self) -> None:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._open: record_function | None = None
        self._count = 0

    def start(self) -> None:
        self._prof.__enter__()

    def attach(self, model: torch.nn.Module, optimizer: Any) -> None:
        pass

    def begin(self, step: int, phase: str) -> None:
        self._open = record_function(f"bench_region/{self._count}/{step}/{phase}")
        self._open.__enter__()
        self._count += 1

    def end(self) -> None:
        assert self._open is not None
        self._open.__exit__(None, None, None)
        self._open = None

    def finish(self) -> Reading:
        self._prof.__exit__(None, None, None)
        from torch._C._profiler import _EventType

        events: list[tuple[int, int, int]] = []  # (time, bytes +alloc/-free, running total after)
        windows: dict[int, tuple[int, str, int, int]] = {}  # index -> (step, phase, t0, t1)
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            if node.tag == _EventType.Allocation:
                extra = node.extra_fields
                events.append((node.start_time_ns, extra.alloc_size, extra.total_allocated))
            elif node.name.startswith("bench_region/"):
                _, index, step, phase = node.name.split("/")
                windows[int(index)] = (int(step), phase, node.start_time_ns, node.end_time_ns)
        events.sort()
        # The reporter's total is process-global; count from what it held when we started.
        base = events[0][2] - events[0][1] if events else 0
        times = [t for t, _, _ in events]
        totals = [total - base for _, _, total in events]

        def live_before(t: int) -> int:
            i = bisect.bisect_left(times, t)
            return totals[i - 1] if i > 0 else 0

        def peak_within(t0: int, t1: int) -> int:
            lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
            return max([live_before(t0), *totals[lo:hi]])

        ordered = [windows[i] for i in sorted(windows)]
        reading = Reading(setup_peak=peak_within(0, ordered[0][2]) if ordered else 0)
        for step, phase, t0, t1 in ordered:
            end_live = live_before(t1 + 1)
            reading.regions.append(Region(step, phase, live_before(t0), peak_within(t0, t1), end_live))
        return reading


# The counting wrapper around the CPU allocator lives with the trainer's own memory reading.
from profiler.tensor_memory import load_counter as load_alloc_hook  # noqa: E402


class AllocHookMeter:
    """Counts live bytes and their peak in a wrapper around the CPU allocator (every thread)."""

    def __init__(self) -> None:
        self._hook = load_alloc_hook()  # already imported by the parent: no build here
        self._reading = Reading()

    def start(self) -> None:
        self._hook.install()  # per process: only tensors allocated from now on are counted

    def attach(self, model: torch.nn.Module, optimizer: Any) -> None:
        pass

    def begin(self, step: int, phase: str) -> None:
        if not self._reading.regions:
            self._reading.setup_peak = self._hook.peak_bytes()
        self._reading.regions.append(Region(step, phase, start_live=self._hook.live_bytes()))
        self._hook.reset_peak()

    def end(self) -> None:
        self._reading.regions[-1].peak = self._hook.peak_bytes()
        self._reading.regions[-1].end_live = self._hook.live_bytes()

    def finish(self) -> Reading:
        return self._reading


class MemTrackerMeter:
    """Real-mode ``MemTracker``; only for plain full fine-tuning at world 1 (see method_applies)."""

    def __init__(self) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        self._tracker = MemTracker()
        self._reading = Reading()

    def start(self) -> None:
        pass

    def attach(self, model: torch.nn.Module, optimizer: Any) -> None:
        self._tracker.track_external(model, optimizer)
        self._tracker.__enter__()

    def _total(self, kind: str) -> int:
        snapshot = self._tracker.get_tracker_snapshot(kind)
        return sum(dev_snap["Total"] for dev_snap in snapshot.values())

    def begin(self, step: int, phase: str) -> None:
        if phase == "forward":  # it refuses a second forward of a module without a reset
            self._tracker.reset_mod_stats()
        live = self._total("current")
        if not self._reading.regions:
            self._reading.setup_peak = live  # construction happened before it was attached
        self._reading.regions.append(Region(step, phase, start_live=live))
        # MemTracker has no public peak reset; restart its running peak at the current state.
        self._tracker._peak_mem_snap = self._tracker.get_tracker_snapshot("current")
        self._tracker._peak_mem = {
            dev: snap["Total"] for dev, snap in self._tracker._peak_mem_snap.items()
        }

    def end(self) -> None:
        self._reading.regions[-1].peak = self._total("peak")
        self._reading.regions[-1].end_live = self._total("current")

    def finish(self) -> Reading:
        self._tracker.__exit__(None, None, None)
        return self._reading


def method_applies(method: str, layout: Layout) -> bool:
    """MemTracker cannot wrap DDP/DeepSpeed, and it hooks every parameter's gradient, which
    fails on LoRA's frozen base weights."""
    if method != "memtracker":
        return True
    return layout["world"] == 1 and not uses_deepspeed(layout) and layout["method"] == "full"


def make_meter(method: str) -> Meter:
    """The meter for ``method`` (one of ``METHODS``)."""
    if method == "profiler":
        return ProfilerMeter()
    if method == "alloc_hook":
        return AllocHookMeter()
    if method == "memtracker":
        return MemTrackerMeter()
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


# --------------------------------------------------------------------------------------------
# Training: model, back-end, steps.
# --------------------------------------------------------------------------------------------



def run_steps(layout: Layout, steps: int, rank: int, meter: Meter) -> None:
    """Build the back-end for ``layout`` and run ``steps`` optimizer steps under ``meter``."""
    _steps.run_steps(MODEL, trainer_layout(layout), steps, rank, meter)



def _worker(rank: int, layout: Layout, steps: int, method: str, port: int, out_dir: str) -> None:
    """One rank: set up the process group, train under the meter, write its reading."""
    distributed = layout["world"] > 1 or uses_deepspeed(layout)
    init_rank(rank, layout["world"], port, distributed)
    meter = make_meter(method)
    start = time.perf_counter()
    meter.start()
    run_steps(layout, steps, rank, meter)
    reading = meter.finish()
    seconds = time.perf_counter() - start
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({**asdict(reading), "seconds": seconds}))
    finish_rank(distributed)


_free_port = free_port


def _prepare_parent(layout: Layout, method: str) -> None:
    """Build/load native extensions once in the parent, so forked ranks inherit them loaded."""
    if method == "alloc_hook":
        load_alloc_hook()
    _steps.prepare_forks([trainer_layout(layout)])


def summarize(reading: Reading) -> dict[str, Any]:
    """One rank's figures; steps 2.. are the steady state (Adam states exist from step 1 on)."""
    steady = [r for r in reading.regions if r.step >= 2]
    steps = sorted({r.step for r in reading.regions})
    return {
        "static_bytes": steady[0].start_live,
        "peak_bytes": max(r.peak for r in steady),
        "peak_all_steps_bytes": max(r.peak for r in reading.regions),
        "peak_with_setup_bytes": max(reading.setup_peak, *(r.peak for r in reading.regions)),
        "phase_peak_bytes": {p: max(r.peak for r in steady if r.phase == p) for p in PHASES},
        "step_peak_bytes": [max(r.peak for r in reading.regions if r.step == s) for s in steps],
        "regions": [asdict(r) for r in reading.regions],
    }


def _measure_once(layout: Layout, steps: int, method: str) -> tuple[list[dict[str, Any]], float]:
    """One run in freshly forked ranks: each rank's summary, and the slowest rank's seconds."""
    with tempfile.TemporaryDirectory(prefix="measure_memory_") as out_dir:
        mp.start_processes(
            _worker,
            args=(layout, steps, method, _free_port(), out_dir),
            nprocs=layout["world"],
            join=True,
            start_method="fork",  # the parent already imported torch/transformers/deepspeed
        )
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(layout["world"])]
    readings = [Reading(r["setup_peak"], [Region(**x) for x in r["regions"]]) for r in ranks]
    return [summarize(reading) for reading in readings], max(r["seconds"] for r in ranks)


def measure_peak(
    layout: Layout, steps: int = 4, method: str = "alloc_hook", repeats: int = 1
) -> dict[str, Any]:
    """Train ``layout`` for ``steps`` optimizer steps in forked ranks; return its memory figures.

    Byte figures are the max over ranks. With ``repeats`` > 1 the run with the highest steady
    peak is kept (gloo's worker threads free some DeepSpeed tensors with a timing-dependent
    delay, which moves ZeRO-2/3 peaks by up to ~1 MB) and ``peak_bytes_runs`` lists every run.
    """
    if steps < 2:
        raise ValueError("need at least 2 steps to see a steady-state step")
    layout = normalize_layout(layout)
    if not method_applies(method, layout):
        raise ValueError(f"{method} cannot measure {layout_name(layout)}")
    _prepare_parent(layout, method)
    runs = [_measure_once(layout, steps, method) for _ in range(repeats)]
    peaks = [max(rank["peak_bytes"] for rank in per_rank) for per_rank, _ in runs]
    per_rank, seconds = runs[peaks.index(max(peaks))]
    result: dict[str, Any] = dict(layout)
    for key in ("peak_bytes", "peak_all_steps_bytes", "static_bytes", "peak_with_setup_bytes"):
        result[key] = max(rank[key] for rank in per_rank)
    result["phase_peak_bytes"] = {
        phase: max(rank["phase_peak_bytes"][phase] for rank in per_rank) for phase in PHASES
    }
    result.update(
        steps=steps,
        # `method` is already the layout's training method (full | lora).
        measure_method=method,
        seconds=round(seconds, 2),
        peak_bytes_runs=peaks,
        per_rank=per_rank,
        settings={"ddp": DDP_SETTINGS} if not uses_deepspeed(layout) else {
            "zero": model_deepspeed_config(MODEL, "cpu", trainer_layout(layout))["zero_optimization"]},
    )
    return result


# --------------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------------


def layout_name(layout: Layout) -> str:
    full = normalize_layout(layout)
    return (
        f"w{full['world']} z{full['zero']} mbs{full['mbs']} seq{full['seq']} gas{full['gas']} "
        f"rc={full['recompute']} {full['method']}"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f}"


def _print_table(results: list[dict[str, Any]]) -> None:
    """MiB columns: static, steady peak, peak over all steps, with setup, then per phase."""
    columns = ("static", "peak", "all-steps", "w/setup", "fwd", "bwd", "opt")
    print(f"{'layout (MiB)':40}" + "".join(f"{c:>10}" for c in columns) + f"{'s':>7}")
    for r in results:
        figures = [r["static_bytes"], r["peak_bytes"], r["peak_all_steps_bytes"], r["peak_with_setup_bytes"]]
        figures += [r["phase_peak_bytes"][p] for p in PHASES]
        print(f"{layout_name(r):40}" + "".join(f"{_mib(n):>10}" for n in figures) + f"{r['seconds']:7.1f}")


def _cross_check(layouts: list[Layout], steps: int) -> None:
    """Measure each layout with every applicable method and print the byte differences."""
    keys = ("static_bytes", "peak_bytes", "peak_all_steps_bytes")
    for layout in layouts:
        full = normalize_layout(layout)
        methods = [m for m in METHODS if method_applies(m, full)]
        results = {m: measure_peak(layout, steps, m) for m in methods}
        print(layout_name(layout))
        for m, r in results.items():
            diffs = "  ".join(f"{k}={r[k]} ({r[k] - results[METHODS[0]][k]:+d})" for k in keys)
            print(f"    {m:11} {diffs}")


def _iter_layouts(indices: str | None) -> Iterator[Layout]:
    chosen = range(len(DEFAULT_LAYOUTS)) if not indices else [int(i) - 1 for i in indices.split(",")]
    for i in chosen:
        yield DEFAULT_LAYOUTS[i]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs per layout; the highest peak is kept")
    parser.add_argument("--method", choices=METHODS, default=METHODS[0])
    parser.add_argument("--only", help="comma-separated 1-based indices into the default layouts")
    parser.add_argument("--cross-check", action="store_true", help="compare all methods; writes nothing")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("measured_memory.json"))
    args = parser.parse_args()
    layouts = list(_iter_layouts(args.only))
    if args.cross_check:
        _cross_check(layouts, args.steps)
        return
    results = []
    for i, layout in enumerate(layouts, 1):
        results.append(measure_peak(layout, args.steps, args.method, args.repeats))
        print(f"[{i}/{len(layouts)}] {layout_name(layout)}: {results[-1]['seconds']} s", flush=True)
    _print_table(results)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
