"""`advisor profile`: inventory, micro-benchmarks in every rank, calibration, profile.json.

How it runs
-----------
* Plain invocation on CPU: `nproc` gloo ranks are forked (each pinned to `cores // nproc` threads,
  so that every device benchmarks while the others are busy too, as in data-parallel training).
* Plain invocation with `--nproc N` on CUDA: it re-launches itself under
  `torchrun --nproc-per-node N -m profiler.run_profile ...` (CUDA must not be forked).
* Under torchrun (WORLD_SIZE is set, also multi-node): every process runs its rank's benchmarks;
  rank 0 builds the profile and `main` (the torchrun entry point) writes it.

Calibration steps (CPU, with --model) run through the step runner the caller hands in; the caller
(the CLI, the composition root) then fits the factors to them (planner.calibration.calibrate) and
writes the profile. Nothing here decides or trains.

Rank 0 reports progress through a queue (forked ranks) or directly (torchrun) to a `Progress`
(the CLI draws a rich progress bar with it).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from advisor.errors import UsageError
from advisor.profile import HardwareProfile, Inventory, Measurement
from advisor.specs import Efficiency, HardwareSpec, ModelSpec
from presets import load_hardware, load_model
from profiler import hardware_bench as hb
from profiler.calibration_steps import CalibrationSteps, StepRunner, fit_layouts, measure_calibration_steps
from profiler.inventory import cpu_cores, process_rss_gib, resolve_device, take_inventory, this_host
from profiler.model_trace import architecture_dims
from profiler.ranks import finish_rank, free_port, init_rank


class Progress(Protocol):
    """Where progress goes (the CLI draws a rich progress bar)."""

    def total(self, units: int) -> None: ...
    def step(self, what: str) -> None: ...  # one unit done; `what` is the next thing shown


class NoProgress:
    def total(self, units: int) -> None:
        pass

    def step(self, what: str) -> None:
        pass


@dataclass
class ProfileOptions:
    out: Path | None = Path("profile.json")
    quick: bool = False
    model: ModelSpec | None = None
    nproc: int | None = None
    device: str = "auto"
    calibrate: bool = True


@dataclass
class MeasuredProfile:
    """The profile as measured (efficiency factors 1.0 of the measured rates) and, when they ran,
    the calibration steps whose fit (planner.calibration.calibrate) completes it."""

    profile: HardwareProfile
    calibration_steps: CalibrationSteps | None = None


@dataclass
class Budget:
    """Seconds of sampling per benchmark (the quick budgets keep `--quick` within 60 s here)."""

    gemm_s: float
    memory_s: float
    adam_s: float
    collective_s: float
    copy_bytes: int
    collective_sizes: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, quick: bool, device_type: str) -> "Budget":
        if quick:
            sizes = [4 << 10, 256 << 10, 4 << 20, 32 << 20]
            return cls(3.0, 0.6, 0.6, 1.0, 64 << 20, sizes)
        sizes = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20, 128 << 20]
        copy = (1 << 30) if device_type == "cuda" else (256 << 20)
        return cls(12.0, 2.0, 2.0, 3.0, copy, sizes)


# Work units of the progress bar, per part.
def progress_total(dtypes: int, collectives: int, calibration: int) -> int:
    return 1 + dtypes + 2 + collectives + calibration + 1


def gemm_dtypes(device_type: str) -> list[str]:
    return ["fp32", "bf16", "fp16"] if device_type == "cuda" else ["fp32", "bf16"]


def gemm_tokens(model: ModelSpec | None, quick: bool, device_type: str) -> int:
    if device_type == "cuda":
        return 4096 if quick else 8192
    return 256 if quick else 1024


# --------------------------------------------------------------------------------------------
# one rank


def rank_benchmarks(rank: int, world: int, local_world: int, device_type: str, threads: int, quick: bool,
                    dims: dict[str, int] | None, report: Callable[[str], None]) -> dict[str, Any]:
    """Every micro-benchmark of one rank; collectives need every rank to call this together."""
    import torch

    torch.set_num_threads(threads)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if device_type == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    budget = Budget.of(quick, device_type)
    out: dict[str, Any] = {"rss_gib": process_rss_gib()}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out["reserved_gib"] = (total - free) / 2**30
    tokens = gemm_tokens(None, quick, device_type)
    shapes = hb.model_gemm_shapes(dims, tokens) if dims else hb.square_gemm_shapes(device_type)
    out["gemm"] = {}
    for dtype in gemm_dtypes(device_type):
        if hb.dtype_supported(dtype, device):
            budget_s = budget.gemm_s if dtype == "fp32" else budget.gemm_s / 2
            out["gemm"][dtype] = hb.bench_gemm(shapes, dtype, device, budget_s)
        report(f"GEMM {dtype}")
    out["memory"] = hb.bench_memory_bandwidth(device, budget.copy_bytes, budget.memory_s)
    if device.type == "cuda":
        out["host_device"] = hb.bench_host_device(device, 256 << 20, budget.memory_s)
    report("memory bandwidth")
    adam_shapes = hb.model_param_shapes(dims, 2) if dims else [(4_000_000,)]
    out["adam"] = hb.bench_cpu_adam(adam_shapes, budget.adam_s)
    report("CPU optimizer step")
    if world > 1:
        out["collectives"] = hb.bench_collectives(rank, world, local_world, device, budget.collective_sizes,
                                                  budget.collective_s, progress=report)
    return out


def _forked_rank(rank: int, world: int, port: int, device_type: str, threads: int, quick: bool,
                 dims: dict[str, int] | None, queue: Any, out_dir: str) -> None:
    init_rank(rank, world, port, distributed=world > 1, threads=threads)
    report = (lambda what: queue.put(what)) if rank == 0 else (lambda what: None)
    result = rank_benchmarks(rank, world, world, device_type, threads, quick, dims, report)
    if rank == 0:
        Path(out_dir, "rank0.json").write_text(json.dumps(result))
    finish_rank(distributed=world > 1)


def _run_forked(nproc: int, device_type: str, threads: int, quick: bool, dims: dict[str, int] | None,
                progress: Progress) -> dict[str, Any]:
    import torch.multiprocessing as mp

    queue = mp.get_context("fork").SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="advisor_profile_") as out_dir:
        context = mp.start_processes(
            _forked_rank, args=(nproc, free_port(), device_type, threads, quick, dims, queue, out_dir),
            nprocs=nproc, join=False, start_method="fork",
        )
        while not context.join(timeout=0.1):
            while not queue.empty():
                progress.step(queue.get())
        while not queue.empty():
            progress.step(queue.get())
        return json.loads(Path(out_dir, "rank0.json").read_text())


# --------------------------------------------------------------------------------------------
# from measurements to a HardwareSpec


def _collective_fit(raw: dict[str, Any], op: str, scope: str) -> dict[str, Any] | None:
    fits = [r for r in raw.get("collectives", []) if "fit" in r and r["op"] == op and r["scope"] == scope]
    return max(fits, key=lambda r: r["ranks"]) if fits else None


def measurements_of(raw: dict[str, Any]) -> list[Measurement]:
    out = []
    for dtype, g in raw["gemm"].items():
        repeats = sum(s["repeats"] for s in g["shapes"])
        out.append(Measurement(name=f"gemm/{dtype}", value=g["tflops"], unit="TFLOP/s", repeats=repeats,
                               stable=all(s["stable"] for s in g["shapes"]), shapes=g["shapes"]))
    m = raw["memory"]
    out.append(Measurement(name="memory_bandwidth", value=m["gbs"], unit="GB/s", median_s=m["median_s"],
                           repeats=m["repeats"], stable=m["stable"], bytes=m["bytes"]))
    for way, h in raw.get("host_device", {}).items():
        out.append(Measurement(name=f"host_device/{way}", value=h["gbs"], unit="GB/s", median_s=h["median_s"],
                               repeats=h["repeats"], stable=h["stable"], bytes=h["bytes"]))
    a = raw["adam"]
    out.append(Measurement(name="cpu_adam", value=a["params_per_s"], unit="params/s", median_s=a["median_s"],
                           repeats=a["repeats"], stable=a["stable"], params=a["params"], tensors=a["tensors"]))
    for r in raw.get("collectives", []):
        key = f"{r['op']}/{r['ranks']}/{r['scope']}"
        if "fit" in r:
            f = r["fit"]
            out.append(Measurement(name=f"{key}/bandwidth", value=f["bandwidth_gbs"], unit="GB/s (bus)",
                                   latency_us=f["latency_us"], fit_residual=f["residual"]))
        else:
            a_factor, b_factor = hb.RING_FACTORS[r["op"]](r["ranks"])
            out.append(Measurement(name=f"{key}/{r['bytes']}", value=b_factor * r["bytes"] / r["median_s"] / 1e9,
                                   unit="GB/s (bus)", median_s=r["median_s"], repeats=r["repeats"],
                                   stable=r["stable"], bytes=r["bytes"], min_s=r["min_s"], max_s=r["max_s"]))
    return out


@dataclass(frozen=True)
class InterNodeStandIn:
    """Inter-node figures for a profile that measured none (one node): the matching preset's,
    as achieved rates (datasheet bandwidth x its efficiency), never the intra-node ones."""

    preset: str
    achieved_gbs: float
    latency_us: float

    def assumed(self) -> dict[str, str]:
        return {"inter_node_bandwidth_gbs": f"assumed from preset {self.preset}, not measured",
                "inter_node_latency_us": f"assumed from preset {self.preset}, not measured"}


# Device names to the preset whose network stands in for an unmeasured one; an unknown GPU gets the
# middle of the range (200 Gb/s HDR InfiniBand per GPU) rather than the fastest.
_NETWORK_PRESETS = (("h200", "h200-141g"), ("h100", "h100-80g"), ("a100", "a100-40g"), ("l40s", "l40s-48g"),
                    ("4090", "rtx4090-24g"))


def inter_node_stand_in(inventory: Inventory) -> InterNodeStandIn:
    name = inventory.device_name.lower()
    preset = "cpu" if inventory.device_type == "cpu" else next(
        (p for key, p in _NETWORK_PRESETS if key in name), "a100-40g")
    spec = load_hardware(preset)
    return InterNodeStandIn(preset, spec.inter_node_bandwidth_gbs * spec.efficiency.inter_node_collective,
                            spec.inter_node_latency_us)


def hardware_from(raw: dict[str, Any], inventory: Inventory, name: str) -> HardwareSpec:
    """Measured figures are achieved rates, so every efficiency starts at 1.0; calibration then
    fits gemm and memory_bandwidth to real steps. comm_overlap stays at 0 on CPU (gloo competes
    with compute for the same cores) and the preset's 0.5 on CUDA."""
    peaks = {d: 0.0 for d in ("bf16", "fp16", "fp32")}
    peaks.update({d: g["tflops"] for d, g in raw["gemm"].items()})
    bandwidth = raw["memory"]["gbs"]
    intra = _collective_fit(raw, "all_reduce", "intra")
    inter = _collective_fit(raw, "all_reduce", "inter")
    unmeasured = None if inter else inter_node_stand_in(inventory)
    h2d = raw.get("host_device", {}).get("h2d", {}).get("gbs", bandwidth)
    cuda = inventory.device_type == "cuda"
    return HardwareSpec(
        name=name,
        description=f"measured by advisor profile: {inventory.devices_per_node} x {inventory.device_name}"
                    + ("" if cuda else f", {inventory.threads_per_device} thread(s) per device"),
        device_type=inventory.device_type,
        memory_gib=inventory.device_memory_gib,
        reserved_gib=inventory.device_reserved_gib,
        peak_tflops=peaks,
        memory_bandwidth_gbs=bandwidth,
        intra_node_bandwidth_gbs=intra["fit"]["bandwidth_gbs"] if intra else bandwidth,
        inter_node_bandwidth_gbs=inter["fit"]["bandwidth_gbs"] if inter else unmeasured.achieved_gbs,
        intra_node_latency_us=intra["fit"]["latency_us"] if intra else 0.0,
        inter_node_latency_us=inter["fit"]["latency_us"] if inter else unmeasured.latency_us,
        assumed=unmeasured.assumed() if unmeasured else {},
        devices_per_node=inventory.devices_per_node,
        host_memory_gib=inventory.host_memory_gib,
        host_to_device_gbs=h2d,
        cpu_adam_params_per_s=raw["adam"]["params_per_s"],
        efficiency=Efficiency(gemm=1.0, intra_node_collective=1.0, inter_node_collective=1.0,
                              memory_bandwidth=1.0, comm_overlap=0.5 if cuda else 0.0),
    )


# --------------------------------------------------------------------------------------------
# orchestration


def default_nproc(device_type: str) -> int:
    import torch

    if device_type == "cuda":
        return torch.cuda.device_count()
    return cpu_cores()


def _under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def run_profile(opts: ProfileOptions, progress: Progress | None = None, step_runner: StepRunner | None = None,
                prepare_forks: Callable[[], None] | None = None) -> MeasuredProfile | None:
    """Profile this machine (or this torchrun job); the caller writes it. Returns the measured
    profile on rank 0, None on the other torchrun ranks and in the process that relaunched itself
    under torchrun (rank 0 of that job wrote `opts.out`).

    `step_runner` runs the calibration steps (none without it); `prepare_forks` runs before the
    benchmark ranks fork, so that they inherit what it imports (as the calibration ranks will)."""
    progress = progress or NoProgress()
    started = time.perf_counter()
    device_type = resolve_device(opts.device)
    dims = architecture_dims(opts.model.hf_config) if opts.model is not None else None
    if _under_torchrun():
        return _run_torchrun_rank(opts, device_type, dims, progress, started)
    nproc = opts.nproc or default_nproc(device_type)
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1 (got {nproc})")
    if device_type == "cuda" and nproc > 1:
        _relaunch_under_torchrun(opts, nproc)
        return None
    threads = max(1, cpu_cores() // nproc)
    calibrating = opts.calibrate and opts.model is not None and device_type == "cpu" and step_runner is not None
    total = progress_total(len(gemm_dtypes(device_type)), 4 if nproc > 1 else 0,
                           len(fit_layouts(256, nproc)) if calibrating else 0)
    progress.total(total)
    progress.step(f"inventory: {nproc} x {device_type}")
    if device_type == "cuda":  # one GPU: no fork, benchmark in this process
        raw = rank_benchmarks(0, 1, 1, device_type, threads, opts.quick, dims, progress.step)
    else:
        if prepare_forks:
            prepare_forks()
        raw = _run_forked(nproc, device_type, threads, opts.quick, dims, progress)
    return _finish(opts, raw, device_type, nproc, 1, threads, step_runner if calibrating else None, progress,
                   started)


def _finish(opts: ProfileOptions, raw: dict[str, Any], device_type: str, nproc: int, nodes: int, threads: int,
            step_runner: StepRunner | None, progress: Progress, started: float) -> MeasuredProfile:
    reserve = raw.get("reserved_gib", raw["rss_gib"])
    inventory = take_inventory(device_type, nproc, nodes, threads, reserved_gib=reserve)
    label = "cpu" if device_type == "cpu" else inventory.device_name.replace(" ", "-").lower()
    hardware = hardware_from(raw, inventory, name=f"profile:{label}")
    steps = None
    if step_runner is not None:
        assert opts.model is not None
        steps = measure_calibration_steps(opts.model, hardware.devices_per_node, threads, opts.quick, step_runner,
                                          progress=progress.step)
    elif opts.model is None:
        inventory.notes.append("no --model: GEMM shapes are square and no calibration ran "
                               "(efficiency factors 1.0 of the measured rates)")
    elif device_type == "cuda":
        inventory.notes.append("calibration steps run on CPU only for now; on CUDA see bench/gpu_check.py")
    names = [inventory.device_name] * nproc
    profile = HardwareProfile(
        created=dt.datetime.now(dt.timezone.utc), quick=opts.quick, fingerprint=this_host(names),
        inventory=inventory, measurements=measurements_of(raw), hardware=hardware,
        duration_s=time.perf_counter() - started,
    )
    progress.step("done")
    return MeasuredProfile(profile, steps)


def _run_torchrun_rank(opts: ProfileOptions, device_type: str, dims: dict[str, int] | None, progress: Progress,
                       started: float) -> MeasuredProfile | None:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = max(1, cpu_cores() // local_world)
    if device_type == "cuda":
        import torch

        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    report = progress.step if rank == 0 else (lambda what: None)
    raw = rank_benchmarks(rank, world, local_world, device_type, threads, opts.quick, dims, report)
    measured = None
    if rank == 0:  # no step runner under torchrun: `main` has none to hand in
        measured = _finish(opts, raw, device_type, local_world, world // local_world, threads, None, progress,
                           started)
    dist.barrier()
    dist.destroy_process_group()
    return measured


def _relaunch_under_torchrun(opts: ProfileOptions, nproc: int) -> None:
    import subprocess

    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "profiler.run_profile", "--out", str(opts.out or "profile.json"), "--device", "cuda"]
    if opts.quick:
        args.append("--quick")
    if opts.model is not None:
        args += ["--model", opts.model.source if opts.model.source != "preset" else opts.model.name]
    if subprocess.run(args).returncode != 0:
        raise UsageError(f"the profiling job under torchrun failed ({' '.join(args)})")


def main() -> None:
    """`python -m profiler.run_profile` (what `advisor profile --nproc N` runs under torchrun)."""
    import argparse

    parser = argparse.ArgumentParser(description="advisor profile, one process of a torchrun job")
    parser.add_argument("--out", type=Path, default=Path("profile.json"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    opts = ProfileOptions(out=args.out, quick=args.quick, model=load_model(args.model) if args.model else None,
                          device=args.device)
    measured = run_profile(opts)  # no step runner here: this entry point only measures
    if measured is not None:
        measured.profile.write(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
