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
from functools import partial
from pathlib import Path
from typing import Any, Callable, Protocol

from specs.errors import UsageError
from specs.profile import HardwareProfile, Inventory, Measurement, NodeInventory, load_profile
from specs.core import COLLECTIVE_OPS, Efficiency, HardwareSpec, LinkFigures, ModelSpec, SizeCurve
from presets import load_hardware, load_model
from profiler import hardware_bench as hb
from profiler.calibration_steps import CalibrationSteps, StepRunner, fit_layouts, measure_calibration_steps
from profiler.cluster import ClusterOptions, meet
from profiler.cluster_bench import bench_bisection, bench_node_pairs, pair_rounds
from profiler.cluster_profile import cluster_notes, cluster_of, priced_at_slowest
from profiler.host_ops import bench_host_op
from profiler.inventory import cpu_cores, process_rss_gib, resolve_device, take_inventory, this_host
from profiler.model_trace import architecture_dims
from profiler.ranks import finish_rank, free_port, init_device_and_group, init_rank, local_device
from profiler.stragglers import DEFAULT_THRESHOLD


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
    cluster: ClusterOptions | None = None  # several nodes profiling together (profiler/cluster.py)
    straggler_threshold: float = DEFAULT_THRESHOLD
    trust_remote_code: bool = False  # --model's folder may run its own Python code (auto_map)


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
    head_s: float = 3.0
    host_s: float = 1.5  # the host's time per op (profiler/host_ops.py)

    @classmethod
    def of(cls, quick: bool, device_type: str) -> "Budget":
        # a GPU's copy is 1 GiB even when quick: 64 MiB crosses its HBM in ~15 us, within the
        # launch's own overhead; a CPU copies 64 MiB in ~10 ms
        if quick:
            sizes = [4 << 10, 256 << 10, 4 << 20, 32 << 20]
            copy = (1 << 30) if device_type == "cuda" else (64 << 20)
            return cls(3.0, 0.6, 0.6, 1.0, copy, sizes, 3.0, 0.5)
        sizes = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20, 128 << 20]
        copy = (1 << 30) if device_type == "cuda" else (256 << 20)
        return cls(12.0, 2.0, 2.0, 3.0, copy, sizes, 8.0, 1.5)


# Work units of the progress bar, per part.
def progress_total(dtypes: int, collectives: int, calibration: int) -> int:
    return 1 + dtypes + 3 + collectives + calibration + 1


def gemm_dtypes(device_type: str) -> list[str]:
    return ["fp32", "bf16", "fp16"] if device_type == "cuda" else ["fp32", "bf16"]


def gemm_tokens(model: ModelSpec | None, quick: bool, device_type: str) -> int:
    if device_type == "cuda":
        return 4096 if quick else 8192
    return 256 if quick else 1024


def attention_heads(dims: dict[str, int] | None, hidden: int) -> tuple[int, int]:
    """Heads and head dim of the attention bench: the model's, else 128-wide heads over `hidden`.
    Flash attention's kernels take head dims up to 256; the 512 of hidden // 8 on a GPU fell back to
    an unfused path and read 3.8 GFLOP/s on an H200 (issue 28)."""
    if dims:
        return dims["num_heads"], dims["head_dim"]
    return max(1, hidden // 128), 128


def datasheet_tflops(device: Any) -> dict[str, float]:
    """The datasheet's dense GEMM peaks of a known GPU (its preset's), above which no measured GEMM
    runs: none for a CPU or an unknown GPU. fp32's is the fp32 figure while TF32 is off (torch's
    default), the TF32 tensor cores' where TF32 is on and the preset gives it, else none."""
    import torch

    if device.type != "cuda":
        return {}
    name = torch.cuda.get_device_name(device).lower()
    preset = next((p for key, p in _NETWORK_PRESETS if key in name), None)
    if preset is None:
        return {}
    peaks = {dtype: tflops for dtype, tflops in load_hardware(preset).peak_tflops.items() if tflops > 0}
    tf32 = peaks.pop("tf32", None)  # not a dtype the profile measures: the ceiling of fp32 GEMMs under TF32
    if torch.backends.cuda.matmul.allow_tf32:
        peaks.pop("fp32", None)
        if tf32:
            peaks["fp32"] = tf32
    return peaks


def priced_tflops(gemm: dict[str, Any]) -> float:
    """The rate a `bench_gemm` result prices: as measured, or, where it stayed above the datasheet's
    peak (suspect), no more than that peak."""
    if gemm.get("suspect") and gemm.get("datasheet_tflops"):
        return min(gemm["tflops"], gemm["datasheet_tflops"])
    return gemm["tflops"]


def measured_gemm(shapes: list[hb.GemmShape], dtype: str, device: Any, budget_s: float, ceiling: float | None,
                  shrink: bool = True) -> dict[str, Any]:
    """`bench_gemm`, measured again where a shape ran above the datasheet's `ceiling`."""
    result = hb.remeasured_once(partial(hb.bench_gemm, shapes, dtype, device, budget_s, shrink),
                                partial(hb.impossible_gemm, datasheet_tflops=ceiling))
    return {**result, "datasheet_tflops": ceiling} if ceiling else result


# --------------------------------------------------------------------------------------------
# one rank


def rank_benchmarks(rank: int, world: int, local_world: int, device_type: str, threads: int, quick: bool,
                    dims: dict[str, int] | None, report: Callable[[str], None],
                    timeout_s: float | None = None) -> dict[str, Any]:
    """Every micro-benchmark of one rank; collectives need every rank to call this together."""
    import torch

    torch.set_num_threads(threads)
    device = local_device(device_type)  # set up by the caller (`init_device_and_group`)
    budget = Budget.of(quick, device_type)
    out: dict[str, Any] = {"rss_gib": process_rss_gib()}
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        out["reserved_gib"] = (total - free) / 2**30
    tokens = gemm_tokens(None, quick, device_type)
    # the decoder's GEMMs; the LM head's, whose rate changes with the vocabulary, are measured apart
    shapes = hb.model_gemm_shapes(dims, tokens, head=False) if dims else hb.square_gemm_shapes(device_type)
    # a GPU also measures its dense peak (8192^3) beside a model's shapes; not priced, a sanity anchor
    peak_shapes = hb.square_gemm_shapes(device_type)[-1:] if dims and device.type != "cpu" else []
    ceilings = datasheet_tflops(device)
    out["gemm"], out["gemm_peak"] = {}, {}
    for dtype in gemm_dtypes(device_type):
        if hb.dtype_supported(dtype, device):
            budget_s = budget.gemm_s if dtype == "fp32" else budget.gemm_s / 2
            out["gemm"][dtype] = measured_gemm(shapes, dtype, device, budget_s, ceilings.get(dtype))
            if peak_shapes:
                out["gemm_peak"][dtype] = measured_gemm(peak_shapes, dtype, device, budget_s / 4,
                                                        ceilings.get(dtype), shrink=False)
        report(f"GEMM {dtype}")
    head_dtype = "fp32" if device_type == "cpu" else "bf16"
    if head_dtype in out["gemm"]:
        hidden = dims["hidden_size"] if dims else (1024 if device_type == "cpu" else 4096)
        out["head_gemm"] = hb.bench_head_gemms(hidden, tokens, hb.head_gemm_widths(device_type), head_dtype,
                                               device, budget.head_s, shapes)
        heads, head_dim = attention_heads(dims, hidden)
        out["attention"] = hb.remeasured_once(
            partial(hb.bench_attention, heads, head_dim, hb.attention_seqs(device_type), max(tokens, 1024),
                    head_dtype, device, budget.head_s, shapes), hb.impossible_attention)
    report("LM head GEMMs and attention")
    out["memory"] = hb.bench_memory_bandwidth(device, budget.copy_bytes, budget.memory_s)
    if device.type == "cuda":
        out["host_device"] = hb.bench_host_device(device, 256 << 20, budget.memory_s)
    out["host_op"] = bench_host_op(device, budget.host_s)
    report("memory bandwidth and host time per op")
    adam_shapes = hb.model_param_shapes(dims, 2) if dims else [(4_000_000,)]
    out["adam"] = hb.bench_cpu_adam(adam_shapes, budget.adam_s)
    out["adam_by_size"] = hb.bench_cpu_adam_by_size(hb.ADAM_TENSOR_SIZES, budget.adam_s,
                                                    out["adam"]["params_per_s"])
    if device.type == "cuda":  # where our DeepSpeed engine offloads to DeepSpeed's own host Adam
        out["deepspeed_adam"] = hb.bench_deepspeed_cpu_adam(adam_shapes, budget.adam_s)
    report("CPU optimizer step")
    if world > 1:
        # across nodes the quick budget doubles: multi-node plans rest on the inter-node fit, and a
        # short sample of a shared network swings with its load
        seconds = budget.collective_s * (2 if quick and world > local_world else 1)
        out["collectives"] = hb.bench_collectives(rank, world, local_world, device, budget.collective_sizes,
                                                  seconds, progress=report, timeout_s=timeout_s)
    return out


@dataclass(frozen=True)
class RankSetup:
    """Where the ranks of this node sit in the job and how they meet."""

    world: int
    local_world: int
    node: int
    nodes: int
    first_rank: int  # this node's first global rank
    port: int
    master_addr: str
    timeout_s: float | None
    device_type: str
    threads: int
    quick: bool
    dims: dict[str, int] | None


def rank_work(rank: int, setup: RankSetup, report: Callable[[str], None]) -> dict[str, Any] | None:
    """One rank's part of the profile: its benchmarks, the links between nodes, then every rank's
    figures gathered on rank 0 (None elsewhere)."""
    raw = rank_benchmarks(rank, setup.world, setup.local_world, setup.device_type, setup.threads, setup.quick,
                          setup.dims, report, setup.timeout_s)
    device = local_device(setup.device_type)
    if setup.nodes > 1:
        budget = Budget.of(setup.quick, setup.device_type)
        sizes = [budget.collective_sizes[0], budget.collective_sizes[-1]]
        raw["node_pairs"] = bench_node_pairs(rank, setup.local_world, setup.nodes, sizes, 5 if setup.quick else 10,
                                             device, progress=report)
        raw["bisection"] = bench_bisection(setup.world, setup.local_world, budget.collective_sizes[-1],
                                           budget.collective_s, device)
        report("bisection (all-to-all)")
    local_rank = rank - setup.first_rank
    mine = {"rank": rank, "node": setup.node, "local_rank": local_rank,
            "gemm": {dtype: priced_tflops(g) for dtype, g in raw["gemm"].items()}, "memory_gbs": raw["memory"]["gbs"],
            "node_pairs": raw.pop("node_pairs", []),
            "inventory": _node_inventory(setup, raw) if local_rank == 0 else None}
    ranks = [mine]
    if setup.world > 1:
        import torch.distributed as dist

        ranks = [None] * setup.world
        dist.all_gather_object(ranks, mine)
    if rank != 0:
        return None
    raw["ranks"] = ranks
    return raw


def _node_inventory(setup: RankSetup, raw: dict[str, Any]) -> dict[str, Any]:
    inventory = take_inventory(setup.device_type, setup.local_world, setup.nodes, setup.threads,
                               reserved_gib=raw.get("reserved_gib", raw["rss_gib"]))
    host = this_host()
    return NodeInventory(node=setup.node, hostname=host.hostname, cpu_model=host.cpu_model,
                         device_name=inventory.device_name, devices=inventory.devices_per_node,
                         cpu_cores=inventory.cpu_cores, host_memory_gib=inventory.host_memory_gib,
                         device_memory_gib=inventory.device_memory_gib).model_dump()


def _forked_rank(local_rank: int, setup: RankSetup, queue: Any, out_dir: str) -> None:
    rank = setup.first_rank + local_rank
    init_rank(rank, setup.world, setup.port, distributed=setup.world > 1, threads=setup.threads,
              master_addr=setup.master_addr, local_rank=local_rank, local_world=setup.local_world,
              device_type=setup.device_type, timeout_s=setup.timeout_s)
    report = (lambda what: queue.put(what)) if local_rank == 0 else (lambda what: None)
    result = rank_work(rank, setup, report)
    if result is not None:
        Path(out_dir, "rank0.json").write_text(json.dumps(result))
    finish_rank(distributed=setup.world > 1)


def _run_forked(setup: RankSetup, progress: Progress) -> dict[str, Any] | None:
    """This node's ranks, forked (spawned on CUDA, which a fork cannot use); rank 0's gathered
    figures, or None on the other nodes. A failing rank stops the others and raises one line."""
    import torch.multiprocessing as mp

    method = "spawn" if setup.device_type == "cuda" else "fork"
    queue = mp.get_context(method).SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="advisor_profile_") as out_dir:
        context = mp.start_processes(_forked_rank, args=(setup, queue, out_dir), nprocs=setup.local_world,
                                     join=False, start_method=method)
        last_heard = time.monotonic()
        try:
            while not context.join(timeout=0.1):
                while not queue.empty():
                    progress.step(queue.get())
                    last_heard = time.monotonic()
                if setup.timeout_s and time.monotonic() - last_heard > setup.timeout_s:
                    _stop(context)
                    raise UsageError(f"node {setup.node}: no progress for {setup.timeout_s:g} s (--timeout-s); "
                                     "another node, a rank or a link stopped")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise UsageError(f"profiling stopped on node {setup.node}, local rank {exc.error_index}: "
                             f"{_last_line(str(exc))}") from None
        while not queue.empty():
            progress.step(queue.get())
        path = Path(out_dir, "rank0.json")
        return json.loads(path.read_text()) if path.is_file() else None


def _stop(context: Any) -> None:
    """Kill this node's ranks (a watchdog: gloo's own set-up can wait minutes past its timeout for a
    peer that died)."""
    for process in context.processes:
        if process.is_alive():
            process.kill()
    for process in context.processes:
        process.join(timeout=5)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "a rank failed"


# --------------------------------------------------------------------------------------------
# from measurements to a HardwareSpec


def collective_links(raw: dict[str, Any]) -> dict[str, LinkFigures]:
    """Each measured collective other than the all-reduce (which sets the link's own figures) at
    its own fit: on gloo, all-gather and reduce-scatter run at a third to a half of the all-reduce's
    bus bandwidth, and FSDP2 and ZeRO-3 run on them."""
    links = {}
    for op in COLLECTIVE_OPS[1:]:
        for scope in ("intra", "inter"):
            fit = _collective_fit(raw, op, scope)
            if fit and fit["fit"]["bandwidth_gbs"] > 0:
                links[f"{op}/{scope}"] = LinkFigures(bandwidth_gbs=fit["fit"]["bandwidth_gbs"],
                                                     latency_us=fit["fit"]["latency_us"])
    return links


def _collective_fit(raw: dict[str, Any], op: str, scope: str) -> dict[str, Any] | None:
    fits = [r for r in raw.get("collectives", []) if "fit" in r and r["op"] == op and r["scope"] == scope]
    return max(fits, key=lambda r: r["ranks"]) if fits else None


def measurements_of(raw: dict[str, Any]) -> list[Measurement]:
    out = []
    for kind in ("gemm", "gemm_peak"):
        for dtype, g in raw.get(kind, {}).items():
            repeats = sum(s["repeats"] for s in g["shapes"])
            extra = {"datasheet_tflops": g["datasheet_tflops"]} if g.get("datasheet_tflops") else {}
            out.append(Measurement(name=f"{kind}/{dtype}", value=g["tflops"], unit="TFLOP/s", repeats=repeats,
                                   stable=all(s["stable"] for s in g["shapes"]), suspect=g.get("suspect"),
                                   shapes=g["shapes"], **extra))
    m = raw["memory"]
    out.append(Measurement(name="memory_bandwidth", value=m["gbs"], unit="GB/s", median_s=m["median_s"],
                           repeats=m["repeats"], stable=m["stable"], bytes=m["bytes"]))
    for way, h in raw.get("host_device", {}).items():
        out.append(Measurement(name=f"host_device/{way}", value=h["gbs"], unit="GB/s", median_s=h["median_s"],
                               repeats=h["repeats"], stable=h["stable"], bytes=h["bytes"]))
    a = raw["adam"]
    out.append(Measurement(name="cpu_adam", value=a["params_per_s"], unit="params/s", median_s=a["median_s"],
                           repeats=a["repeats"], stable=a["stable"], params=a["params"], tensors=a["tensors"]))
    ds = raw.get("deepspeed_adam")
    if ds and "error" not in ds:
        out.append(Measurement(name="deepspeed_cpu_adam", value=ds["params_per_s"], unit="params/s",
                               median_s=ds["median_s"], repeats=ds["repeats"], stable=ds["stable"],
                               params=ds["params"], tensors=ds["tensors"]))
    host = raw.get("host_op")
    if host:
        out.append(Measurement(name="host_op", value=host["host_op_s"] * 1e6, unit="us/op", median_s=host["median_s"],
                               repeats=host["repeats"], stable=host["stable"], ops=host["ops"]))
    by_size = raw.get("adam_by_size", {"sizes": [], "relative": []})
    for size, relative in zip(by_size["sizes"], by_size["relative"]):
        out.append(Measurement(name=f"cpu_adam/tensor_{size}", value=relative * a["params_per_s"], unit="params/s"))
    attention = raw.get("attention")
    for seq, relative in zip(attention["seqs"], attention["relative"]) if attention else ():
        out.append(Measurement(name=f"attention/{attention['dtype']}/{seq}",
                               value=relative * priced_tflops(raw["gemm"][attention["dtype"]]), unit="TFLOP/s",
                               suspect=attention.get("suspect"), heads=attention["heads"],
                               head_dim=attention["head_dim"]))
    head = raw.get("head_gemm")
    for width, relative in zip(head["widths"], head["relative"]) if head else ():
        out.append(Measurement(name=f"head_gemm/{head['dtype']}/{width}",
                               value=relative * priced_tflops(raw["gemm"][head["dtype"]]), unit="TFLOP/s",
                               hidden=head["hidden"], tokens=head["tokens"]))
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
    peaks.update({d: priced_tflops(g) for d, g in raw["gemm"].items()})
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
        collective_links=collective_links(raw),
        threads_per_device=None if cuda else inventory.threads_per_device,
        cpu_cores=None if cuda else inventory.cpu_cores,
        host_memory_gib=inventory.host_memory_gib,
        host_to_device_gbs=h2d,
        cpu_adam_params_per_s=offload_adam(raw)["params_per_s"],
        head_gemm=SizeCurve(sizes=raw["head_gemm"]["widths"], relative=raw["head_gemm"]["relative"])
        if "head_gemm" in raw else None,
        attention=SizeCurve(sizes=raw["attention"]["seqs"], relative=raw["attention"]["relative"])
        if "attention" in raw and not raw["attention"].get("suspect") else None,
        cpu_adam_by_tensor=SizeCurve(sizes=raw["adam_by_size"]["sizes"], relative=raw["adam_by_size"]["relative"])
        if "adam_by_size" in raw and offload_adam(raw) is raw["adam"] else None,
        efficiency=Efficiency(gemm=1.0, intra_node_collective=1.0, inter_node_collective=1.0,
                              memory_bandwidth=1.0, comm_overlap=0.5 if cuda else 0.0,
                              host_op_s=min(raw["host_op"]["host_op_s"], HOST_OP_CAP_S)
                              if cuda and "host_op" in raw else 0.0),
    )


# The schema's bound on a host's time per op (Efficiency.host_op_s): beyond it a GPU step would be
# priced as a host's alone; a figure above it is kept in the measurements and priced at the bound.
HOST_OP_CAP_S = 0.01


def offload_adam(raw: dict[str, Any]) -> dict[str, Any]:
    """The host Adam that optimizer offload runs, as measured: DeepSpeed's own (`DeepSpeedCPUAdam`)
    where the profile measured it (a GPU machine whose DeepSpeed op loads), else torch's AdamW, which
    a CPU's DeepSpeed engine runs (`torch_adam`) and plain CPU training too."""
    ds = raw.get("deepspeed_adam")
    return ds if ds and "error" not in ds else raw["adam"]


def suspect_notes(raw: dict[str, Any]) -> list[str]:
    """What the inventory says of each suspect figure (hardware_bench.remeasured_once) and how the
    hardware prices it instead."""
    notes = [f"suspect gemm/{dtype}: {g['suspect']}; priced at no more than the datasheet"
             for dtype, g in raw["gemm"].items() if g.get("suspect")]
    notes += [f"suspect gemm_peak/{dtype}: {g['suspect']}" for dtype, g in raw.get("gemm_peak", {}).items()
              if g.get("suspect")]
    ds = raw.get("deepspeed_adam")
    if ds and "error" in ds:
        notes.append(f"DeepSpeed's CPU Adam did not load ({ds['error']}); optimizer offload priced at torch's "
                     "AdamW rate, which runs about 10x slower")
    if raw.get("attention", {}).get("suspect"):
        notes.append(f"suspect attention: {raw['attention']['suspect']}; attention priced at the GEMM rate")
    return notes


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
    """Profile this machine, this torchrun job or, with `opts.cluster`, this node's part of a
    multi-node profile; the caller writes it. Returns the measured profile on rank 0, None on the
    other torchrun ranks and nodes, and in the process that relaunched itself under torchrun (rank 0
    of that job wrote `opts.out`).

    `step_runner` runs the calibration steps (none without it); `prepare_forks` runs before the
    benchmark ranks fork, so that they inherit what it imports (as the calibration ranks will)."""
    progress = progress or NoProgress()
    started = time.perf_counter()
    device_type = resolve_device(opts.device)
    dims = architecture_dims(opts.model.hf_config) if opts.model is not None else None
    if not 0 <= opts.straggler_threshold < 1:
        raise UsageError(f"--straggler-threshold must be within 0-1 (got {opts.straggler_threshold})")
    if _under_torchrun():
        return _run_torchrun_rank(opts, device_type, dims, progress, started)
    nproc = opts.nproc or default_nproc(device_type)
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1 (got {nproc})")
    if opts.cluster is not None:
        return _run_cluster_node(opts, opts.cluster, device_type, nproc, dims, progress, started)
    calibrating = opts.calibrate and opts.model is not None and step_runner is not None
    if device_type == "cuda" and nproc > 1:
        _relaunch_under_torchrun(opts, nproc)
        return _calibrated_after_torchrun(opts, nproc, step_runner, progress) if calibrating else None
    threads = max(1, cpu_cores() // nproc)
    total = progress_total(len(gemm_dtypes(device_type)), _collective_units(nproc, nproc),
                           len(fit_layouts(256, nproc)) if calibrating else 0)
    progress.total(total)
    progress.step(f"inventory: {nproc} x {device_type}")
    setup = RankSetup(world=nproc, local_world=nproc, node=0, nodes=1, first_rank=0, port=free_port(),
                      master_addr="127.0.0.1", timeout_s=None, device_type=device_type, threads=threads,
                      quick=opts.quick, dims=dims)
    if device_type == "cuda":  # one GPU: no fork, benchmark in this process
        init_device_and_group(device_type, distributed=False)
        raw = rank_work(0, setup, progress.step)
    else:
        if prepare_forks:
            prepare_forks()
        raw = _run_forked(setup, progress)
    assert raw is not None
    return _finish(opts, raw, device_type, nproc, 1, threads, step_runner if calibrating else None, progress,
                   started)


def _collective_units(world: int, local_world: int) -> int:
    return len(hb.COLLECTIVES) * len(hb.collective_groups(world, local_world))


def _run_cluster_node(opts: ProfileOptions, cluster: ClusterOptions, device_type: str, nproc: int,
                      dims: dict[str, int] | None, progress: Progress, started: float) -> MeasuredProfile | None:
    """This node's ranks of a multi-node profile; the profile (on node 0) or None. No calibration
    steps: they run on one node (`advisor profile --model M` there)."""
    meeting = meet(cluster, nproc)
    threads = max(1, cpu_cores() // nproc)
    world = meeting.world
    progress.total(progress_total(len(gemm_dtypes(device_type)), _collective_units(world, nproc), 0)
                   + len(pair_rounds(cluster.nnodes)) + 1)
    progress.step(f"node {cluster.node_rank} of {cluster.nnodes}: {nproc} x {device_type}")
    setup = RankSetup(world=world, local_world=nproc, node=cluster.node_rank, nodes=cluster.nnodes,
                      first_rank=meeting.first_rank(cluster.node_rank), port=cluster.group_port,
                      master_addr=cluster.master_addr, timeout_s=cluster.timeout_s, device_type=device_type,
                      threads=threads, quick=opts.quick, dims=dims)
    raw = _run_forked(setup, progress)
    if raw is None:  # another node: node 0 writes the profile
        progress.step("done")
        return None
    measured = _finish(opts, raw, device_type, nproc, cluster.nnodes, threads, None, progress, started)
    if opts.model is not None and opts.calibrate:
        measured.profile.inventory.notes.append(
            "calibration steps run on one node: rerun `advisor profile --model M` there to fit the efficiencies")
    return measured


def _finish(opts: ProfileOptions, raw: dict[str, Any], device_type: str, nproc: int, nodes: int, threads: int,
            step_runner: StepRunner | None, progress: Progress, started: float) -> MeasuredProfile:
    reserve = raw.get("reserved_gib", raw["rss_gib"])
    inventory = take_inventory(device_type, nproc, nodes, threads, reserved_gib=reserve)
    label = "cpu" if device_type == "cpu" else inventory.device_name.replace(" ", "-").lower()
    cluster = cluster_of(raw, opts.straggler_threshold)
    inventory.nodes = len(cluster.nodes)
    inventory.notes += cluster_notes(cluster)
    inventory.notes += suspect_notes(raw)
    hardware = priced_at_slowest(hardware_from(raw, inventory, name=f"profile:{label}"), cluster)
    steps = None
    if step_runner is not None:
        assert opts.model is not None
        steps = measure_calibration_steps(opts.model, hardware.devices_per_node, threads, opts.quick, step_runner,
                                          progress=progress.step, device_type=device_type)
        inventory.notes += calibration_notes(steps)
        steps = steps if steps.layouts else None
    elif opts.model is None:
        inventory.notes.append("no --model: GEMM shapes are square and no calibration ran "
                               "(efficiency factors 1.0 of the measured rates)")
    names = [inventory.device_name] * nproc
    profile = HardwareProfile(
        created=dt.datetime.now(dt.timezone.utc), quick=opts.quick, fingerprint=this_host(names),
        inventory=inventory, measurements=measurements_of(raw), hardware=hardware, cluster=cluster,
        duration_s=time.perf_counter() - started,
    )
    progress.step("done")
    return MeasuredProfile(profile, steps)


def calibration_notes(steps: CalibrationSteps) -> list[str]:
    if not steps.out_of_memory:
        return []
    left_out = ", ".join(layout.short() for layout in steps.out_of_memory)
    fitted = "the fit uses the others" if steps.layouts else "no calibration ran (efficiency factors 1.0)"
    return [f"calibration steps out of the device's memory, left out: {left_out}; {fitted}"]


def _run_torchrun_rank(opts: ProfileOptions, device_type: str, dims: dict[str, int] | None, progress: Progress,
                       started: float) -> MeasuredProfile | None:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = max(1, cpu_cores() // local_world)
    timeout_s = opts.cluster.timeout_s if opts.cluster else 600.0
    init_device_and_group(device_type, timeout_s=timeout_s)
    node = rank // local_world
    setup = RankSetup(world=world, local_world=local_world, node=node, nodes=world // local_world,
                      first_rank=node * local_world, port=int(os.environ.get("MASTER_PORT", 0)),
                      master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), timeout_s=timeout_s,
                      device_type=device_type, threads=threads, quick=opts.quick, dims=dims)
    raw = rank_work(rank, setup, progress.step if rank == 0 else (lambda what: None))
    measured = None
    if raw is not None:  # rank 0; no step runner under torchrun: `main` has none to hand in
        measured = _finish(opts, raw, device_type, local_world, setup.nodes, threads, None, progress, started)
    dist.barrier()
    dist.destroy_process_group()
    return measured


def _calibrated_after_torchrun(opts: ProfileOptions, nproc: int, step_runner: StepRunner | None,
                               progress: Progress) -> MeasuredProfile | None:
    """The profile the torchrun job wrote, with the calibration steps run afterwards from this process
    (the step runner starts its own ranks on the node's GPUs; the job's ranks have none to run)."""
    assert opts.model is not None and step_runner is not None
    progress.total(len(fit_layouts(256, nproc)))
    profile = load_profile(_torchrun_out(opts))
    steps = measure_calibration_steps(opts.model, nproc, 1, opts.quick, step_runner, progress=progress.step,
                                      device_type="cuda")
    profile.inventory.notes += calibration_notes(steps)
    return MeasuredProfile(profile, steps if steps.layouts else None)


def _torchrun_out(opts: ProfileOptions) -> Path:
    return Path(opts.out or "profile.json")


def _relaunch_under_torchrun(opts: ProfileOptions, nproc: int) -> None:
    import subprocess

    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "profiler.run_profile", "--out", str(_torchrun_out(opts)), "--device", "cuda"]
    if opts.quick:
        args.append("--quick")
    if opts.model is not None:
        args += ["--model", opts.model.source if opts.model.source != "preset" else opts.model.name]
    if opts.trust_remote_code:
        args.append("--trust-remote-code")
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
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args()
    opts = ProfileOptions(out=args.out, quick=args.quick, device=args.device, trust_remote_code=args.trust_remote_code,
                          model=load_model(args.model, args.trust_remote_code) if args.model else None)
    measured = run_profile(opts)  # no step runner here: this entry point only measures
    if measured is not None:
        measured.profile.write(args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
