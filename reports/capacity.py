"""Capacity planning: the planner's best plan for every (hardware, GPU count, method) option, what
each costs in time, GPU-hours and money once checkpoints and failures are counted, where scaling
stops paying, and which option to pick.

Decisions stay in `planner/` (layouts, checkpoint cadence, failure overhead); this module only
runs the planner per option, compares the results, and words a recommendation.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any, Callable

from specs.capabilities import prices_ours
from specs.errors import UsageError
from specs.core import MIN_COMPUTE_FRACTION, GiB, Estimate, HardwareSpec, Layout, ModelSpec
from specs.task import TaskSpec
from planner.time_to_train import RESTART_S, FailureOverhead, checkpoint_write_s, time_to_train
from planner.plan import InfeasiblePlan, PlanOptions, default_global_batch, make_plan
from presets import pricing_band

_PLAN_DEFAULTS = {f.name: f.default for f in dataclasses.fields(PlanOptions)}
MTBF_HOURS = float(_PLAN_DEFAULTS["mtbf_hours"])  # per node, the planner's assumption
CHECKPOINT_WRITE_GBS = float(_PLAN_DEFAULTS["checkpoint_write_gbs"])  # per node, the planner's assumption
SCALING_EFFICIENCY_RULE = MIN_COMPUTE_FRACTION  # the same 80% rule, applied to scaling: keep >= 80% of the work useful
COST_SLACK = 1 / SCALING_EFFICIENCY_RULE  # so a recommendation may cost up to 1.25x the cheapest
HEADROOM_RISK = 0.10  # less free memory than this at the peak is an OOM risk worth naming
DEADLINE_MARGIN_RISK = 0.20


@dataclass
class CapacityRequest:
    model: ModelSpec
    hardware: list[HardwareSpec]
    gpu_counts: list[int]
    methods: list[str] = field(default_factory=lambda: ["full", "lora"])
    tokens: float | None = None
    task: TaskSpec | None = None
    stage_tokens: dict[str, int] | None = None  # per stage, from the prepared data's manifest
    seq: int | None = None
    global_batch: int | None = None
    prices: dict[str, float] = field(default_factory=dict)  # hardware name -> $ per GPU-hour
    deadline_s: float | None = None
    mtbf_hours: float = MTBF_HOURS
    checkpoint_write_gbs: float = CHECKPOINT_WRITE_GBS
    restart_s: float = RESTART_S
    min_compute_fraction: float = MIN_COMPUTE_FRACTION
    command: str = ""
    # `--engine`: whose behaviour is priced (specs.capabilities PRICED_ENGINES)
    priced_engine: str = "ours"

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.task is None):
            raise UsageError("give the work to plan: exactly one of --tokens N or --task task.yaml")
        if self.tokens is not None and self.tokens <= 0:
            raise UsageError(f"--tokens must be positive (got {self.tokens:g})")
        if not self.hardware or not self.gpu_counts or not self.methods:
            raise UsageError("need at least one hardware, one GPU count and one method")
        for method in self.methods:
            if method not in ("full", "lora", "qlora"):
                raise UsageError(f"--method takes full, lora or qlora, comma-separated (got {method})")
        if any(g < 1 for g in self.gpu_counts):
            raise UsageError("--gpus must be positive integers")
        unknown = set(self.prices) - {h.name for h in self.hardware}
        if unknown:
            raise UsageError(f"--price-per-gpu-hour names hardware not in --hardware: {', '.join(sorted(unknown))}")

    @property
    def seq_len(self) -> int:
        return self.seq or (self.task.seq_len if self.task else 2048)

    @property
    def batch(self) -> int:
        """One global batch for every option, so that options differ only in hardware."""
        return (self.global_batch or (self.task.global_batch if self.task else None)
                or default_global_batch(max(self.gpu_counts), self.seq_len))

    @property
    def priced(self) -> bool:
        return all(h.name in self.prices for h in self.hardware)


@dataclass
class Option:
    """One (hardware, GPU count, method) and the planner's best plan for it, or why none fits."""

    hardware: str
    gpus: int
    method: str
    nodes: int
    fits: bool
    why_not: str = ""
    fixes: list[str] = field(default_factory=list)
    layout: Layout | None = None
    estimate: Estimate | None = None
    meets_compute_rule: bool = True
    tokens: float = 0.0
    overhead: FailureOverhead | None = None
    price: float | None = None
    deadline_s: float | None = None
    notes: list[str] = field(default_factory=list)
    plan_seconds: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.hardware}/{self.gpus}/{self.method}"

    @property
    def label(self) -> str:
        return f"{self.gpus} x {self.hardware} {self.method}"

    # -- figures of a fitting option ---------------------------------------------------------
    @property
    def wall_s(self) -> float:
        assert self.overhead is not None
        return self.overhead.wall_s

    @property
    def wall_days(self) -> float:
        return self.wall_s / 86400

    @property
    def gpu_hours(self) -> float:
        return self.wall_s / 3600 * self.gpus

    @property
    def cost(self) -> float | None:
        return None if self.price is None else self.gpu_hours * self.price

    @property
    def planned(self) -> Estimate:
        """The chosen layout's estimate (only options the planner could place have one)."""
        assert self.estimate is not None
        return self.estimate

    # the planner's figures for this option, read off its estimate
    tokens_per_s = property(lambda self: self.planned.throughput.tokens_per_s)
    mfu = property(lambda self: self.planned.throughput.mfu)
    peak_bytes = property(lambda self: self.planned.memory.peak)
    capacity_bytes = property(lambda self: self.planned.memory.capacity)

    @property
    def headroom(self) -> float:
        """Free share of the device's usable memory at the predicted peak."""
        return 1 - self.peak_bytes / self.capacity_bytes

    @property
    def meets_deadline(self) -> bool:
        return self.fits and (self.deadline_s is None or self.wall_s <= self.deadline_s)

    def row(self) -> dict[str, Any]:
        """The option as one JSON object (`advisor report capacity --json`)."""
        out: dict[str, Any] = {"key": self.key, "hardware": self.hardware, "gpus": self.gpus, "nodes": self.nodes,
                               "method": self.method, "fits": self.fits}
        if not self.fits:
            return {**out, "why_not": self.why_not, "fixes": self.fixes}
        assert self.overhead is not None and self.layout is not None and self.estimate is not None
        ov = self.overhead
        if not math.isfinite(self.wall_s):  # failures come faster than the job progresses
            return {**out, "layout": self.layout.short(), "never_finishes": True, "why_not":
                    "failures would come faster than the job progresses", "fixes": []}
        return {**out, "layout": self.layout.short(), "meets_compute_rule": self.meets_compute_rule,
                "tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "step_s": self.estimate.time.step_s,
                "mfu": self.mfu, "peak_bytes": self.peak_bytes, "capacity_bytes": self.capacity_bytes,
                "headroom": self.headroom, "train_hours": ov.train_s / 3600, "wall_hours": self.wall_s / 3600,
                "wall_days": self.wall_days, "gpu_hours": self.gpu_hours, "price_per_gpu_hour": self.price,
                "cost": self.cost, "checkpoint_write_s": ov.write_s, "checkpoint_interval_s": ov.interval_s,
                "checkpoint_overhead": ov.checkpoint_fraction, "expected_failures": ov.failures,
                "failure_overhead": ov.failure_fraction, "meets_deadline": self.meets_deadline,
                "notes": self.notes}


@dataclass
class Scaling:
    """Throughput against GPU count for one hardware and method, and where it stops scaling."""

    hardware: str
    method: str
    points: list[tuple[int, float, float]]  # (gpus, tokens/s, efficiency against linear from the first)
    knee: int | None  # the largest count whose efficiency, and every smaller count's, stays >= 80%
    beyond_range: bool  # every tested count kept >= 80%: the knee lies at or past the largest one


@dataclass
class Recommendation:
    option: Option | None
    text: str
    main_risk: str
    other_risks: list[str] = field(default_factory=list)


@dataclass
class CapacityReport:
    request: CapacityRequest
    options: list[Option]
    scaling: list[Scaling]
    recommendation: Recommendation
    seconds: float
    # how far this engine's prices fell from published runs (presets.pricing_band), and, for our
    # engines, the recommended job as Megatron-LM would run it (`engine_comparison`)
    error_band: dict[str, float] | None = None
    against_megatron: EngineComparison | None = None

    def option(self, key: str) -> Option:
        return next(o for o in self.options if o.key == key)

    def to_json(self) -> dict[str, Any]:
        req = self.request
        rec = self.recommendation
        return {
            "model": req.model.name,
            "tokens": next((o.tokens for o in self.options if o.fits), req.tokens),
            "seq_len": req.seq_len, "global_batch": req.batch,
            "options": [o.row() for o in self.options],
            "scaling": [{"hardware": s.hardware, "method": s.method, "knee_gpus": s.knee,
                         "knee_beyond_range": s.beyond_range,
                         "points": [{"gpus": g, "tokens_per_s": t, "efficiency": e} for g, t, e in s.points]}
                        for s in self.scaling],
            "recommended": rec.option.key if rec.option else None,
            "recommendation": rec.text, "main_risk": rec.main_risk,
            "engine": req.priced_engine, "error_band": self.error_band,
            "against_megatron": dataclasses.asdict(self.against_megatron) if self.against_megatron else None,
            "seconds": self.seconds,
        }


# ------------------------------------------------------------------------------------------------
# planning every option


def _nodes(gpus: int, per_node: int) -> tuple[int, int] | None:
    """(nodes, GPUs per node) for a GPU count: part of one node, or whole nodes."""
    if gpus <= per_node:
        return 1, gpus
    if gpus % per_node:
        return None
    return gpus // per_node, per_node


def plan_option(req: CapacityRequest, hw: HardwareSpec, gpus: int, method: str) -> Option:
    """The planner's best plan for one option (top-level, so that worker processes can run it)."""
    started = time.perf_counter()
    price = req.prices.get(hw.name)
    split = _nodes(gpus, hw.devices_per_node)
    option = Option(hardware=hw.name, gpus=gpus, method=method, nodes=math.ceil(gpus / hw.devices_per_node),
                    fits=False, price=price, deadline_s=req.deadline_s)
    if split is None:
        option.why_not = (f"{gpus} GPUs are not a whole number of {hw.devices_per_node}-GPU {hw.name} nodes")
        return option
    nodes, per_node = split
    option.nodes = nodes
    opts = PlanOptions(model=req.model, hardware=hw, nodes=nodes, gpus_per_node=per_node, task=req.task,
                       stage_tokens=req.stage_tokens,
                       seq=req.seq_len, global_batch=req.batch, method=method, tokens=req.tokens,
                       min_compute_fraction=req.min_compute_fraction, top_k=1, mtbf_hours=req.mtbf_hours,
                       checkpoint_write_gbs=req.checkpoint_write_gbs, restart_s=req.restart_s,
                       priced_engine=req.priced_engine)
    try:
        plan = make_plan(opts)
    except InfeasiblePlan as exc:
        option.why_not, option.fixes = exc.why, exc.fixes
        option.plan_seconds = time.perf_counter() - started
        return option
    except UsageError as exc:  # e.g. a batch smaller than the device count, QLoRA on CPU
        option.why_not = str(exc)
        option.plan_seconds = time.perf_counter() - started
        return option
    chosen = plan.chosen
    est, layout = chosen.estimate, chosen.layout
    if plan.stages:  # a task: the planner's steps per stage (a stage may run its own method)
        train_s = sum(s.steps * s.step_s for s in plan.stages)
        tokens = float(sum(s.tokens for s in plan.stages))
    else:
        assert req.tokens is not None
        tokens = req.tokens
        train_s = tokens / est.throughput.tokens_per_s
    write_s = checkpoint_write_s(est, layout, nodes, req.checkpoint_write_gbs)
    option.fits = True
    option.layout, option.estimate = layout, est
    option.meets_compute_rule = chosen.meets_compute_rule
    option.tokens = tokens
    option.overhead = time_to_train(train_s, write_s, nodes, req.mtbf_hours, req.restart_s)
    option.notes = list(plan.notes)
    option.plan_seconds = time.perf_counter() - started
    return option


def _plan_args(args: tuple) -> Option:
    return plan_option(*args)


def plan_options(req: CapacityRequest, progress: Callable[[Option], None] | None = None,
                 jobs: int | None = None) -> list[Option]:
    """Plan every option, in worker processes when that is safe (see below); results in a fixed
    order: hardware as given, then GPU count, then method."""
    work = [(req, hw, gpus, method) for hw in req.hardware for gpus in sorted(set(req.gpu_counts))
            for method in req.methods]
    jobs = jobs if jobs is not None else min(len(work), os.cpu_count() or 1)
    # fork is cheap (the parent's imports are reused) but unsafe once torch has started its thread
    # pools; presets never import torch in the planner, so only a custom model's trace does
    use_pool = jobs > 1 and "torch" not in sys.modules and sys.platform != "win32"
    results: list[Option] = []
    if use_pool:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("fork")) as pool:
            futures = [pool.submit(_plan_args, args) for args in work]
            for future in as_completed(futures):
                option = future.result()
                results.append(option)
                if progress:
                    progress(option)
    else:
        for args in work:
            option = plan_option(*args)
            results.append(option)
            if progress:
                progress(option)
    order = {(hw.name, gpus, method): i for i, (_, hw, gpus, method) in enumerate(work)}
    return sorted(results, key=lambda o: order[(o.hardware, o.gpus, o.method)])


# ------------------------------------------------------------------------------------------------
# comparing the options


def scaling_curves(options: list[Option], rule: float = SCALING_EFFICIENCY_RULE) -> list[Scaling]:
    """Per hardware and method: throughput per GPU against the smallest fitting count's.

    Efficiency(n) = (tokens/s(n) / n) / (tokens/s(n0) / n0), n0 the smallest count that fits.
    The knee is the largest n with efficiency >= `rule` at n and at every fitting count below it.
    """
    curves = []
    keys = dict.fromkeys((o.hardware, o.method) for o in options)
    for hardware, method in keys:
        fitting = sorted((o for o in options if o.hardware == hardware and o.method == method and o.fits),
                         key=lambda o: o.gpus)
        if not fitting:
            continue
        base = fitting[0].tokens_per_s / fitting[0].gpus
        points = [(o.gpus, o.tokens_per_s, (o.tokens_per_s / o.gpus) / base) for o in fitting]
        knee = None
        for gpus, _, efficiency in points:
            if efficiency < rule - 1e-12:
                break
            knee = gpus
        beyond = all(e >= rule - 1e-12 for _, _, e in points)
        curves.append(Scaling(hardware=hardware, method=method, points=points, knee=knee, beyond_range=beyond))
    return curves


def _cost_metric(option: Option, priced: bool) -> float:
    return option.cost if priced and option.cost is not None else option.gpu_hours


def _money(option: Option) -> str:
    return f"${option.cost:,.0f}" if option.cost is not None else f"{option.gpu_hours:,.0f} GPU-hours"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "never (failures come faster than progress)"
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:,.1f} days"
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:,.1f} hours"
    return f"{seconds / 60:,.0f} minutes"


METHOD_WORDS = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}


def _risks(option: Option, req: CapacityRequest, hw: HardwareSpec) -> list[str]:
    """What could make the chosen option miss its figures, most severe first."""
    assert option.estimate is not None and option.overhead is not None
    risks = []
    if option.headroom < HEADROOM_RISK:
        risks.append(f"memory: the predicted peak is {option.peak_bytes / GiB:.1f} GiB of "
                     f"{option.capacity_bytes / GiB:.1f}"
                     f" GiB usable ({100 * option.headroom:.0f}% headroom); fragmentation, a longer sequence or "
                     "another framework version can run out of memory, so keep the plan's alternatives as fallback")
    if req.deadline_s and option.wall_s > (1 - DEADLINE_MARGIN_RISK) * req.deadline_s:
        risks.append(f"deadline: {_duration(option.wall_s)} leaves less than {100 * DEADLINE_MARGIN_RISK:.0f}% "
                     f"slack before the {_duration(req.deadline_s)} deadline")
    if not option.meets_compute_rule:
        risks.append(f"efficiency: compute is only {100 * option.estimate.compute_fraction:.0f}% of each step "
                     f"(below the {100 * req.min_compute_fraction:.0f}% rule); communication and the pipeline "
                     "bubble eat the rest, and real networks are rarely better than the model assumes")
    ov = option.overhead
    if ov.checkpoint_fraction + ov.failure_fraction > 0.10:
        risks.append(f"failures: {ov.failures:,.1f} expected failures and checkpointing add "
                     f"{100 * (ov.checkpoint_fraction + ov.failure_fraction):.0f}% to the training time at an "
                     f"MTBF of {req.mtbf_hours:,.0f} hours per node")
    if hw.source == "preset":
        risks.append(f"unmeasured basis: {hw.name} figures are datasheet peaks times assumed efficiencies; "
                     "run `advisor profile` and a short stress run on the real cluster before committing "
                     "(the source article: copied configurations fail on other clusters)")
    return risks


def recommend(options: list[Option], req: CapacityRequest) -> Recommendation:
    """The fastest option costing at most 1.25x the cheapest (the 80% efficiency rule applied to
    money), within the deadline, using the first method of --method that has one."""
    fitting = [o for o in options if o.fits and math.isfinite(o.wall_s)]
    model = req.model.name
    if not fitting:
        fixes = sorted({f for o in options for f in o.fixes})
        text = (f"No option fits: {model} does not train on any of the requested hardware, GPU counts and methods. "
                + (f"The planner's nearest changes: {'; '.join(fixes[:4])}." if fixes else ""))
        return Recommendation(option=None, text=text, main_risk="nothing fits")
    priced = req.priced
    eligible = [o for o in fitting if o.meets_deadline]
    missed = not eligible
    pool = eligible or fitting
    method = next(m for m in req.methods if any(o.method == m for o in pool))
    pool = [o for o in pool if o.method == method]
    if missed:  # nothing meets the deadline: the fastest, and say by how much it misses
        choice = min(pool, key=lambda o: o.wall_s)
        cheapest = None
    else:
        cheapest = min(pool, key=lambda o: (_cost_metric(o, priced), o.wall_s))
        affordable = [o for o in pool if _cost_metric(o, priced) <= COST_SLACK * _cost_metric(cheapest, priced) + 1e-9]
        choice = min(affordable, key=lambda o: (o.wall_s, _cost_metric(o, priced)))
    hw = next(h for h in req.hardware if h.name == choice.hardware)
    nodes = f"{choice.nodes} node{'s' if choice.nodes > 1 else ''}"
    parts = [f"Train {model} with {METHOD_WORDS[choice.method]} on {choice.gpus} x {choice.hardware} ({nodes}): "
             f"about {_duration(choice.wall_s)} of wall-clock time, {choice.gpu_hours:,.0f} GPU-hours"
             + (f", ${choice.cost:,.0f}" if choice.cost is not None else "") + "."]
    if missed:
        parts.append(f"No option meets the {_duration(req.deadline_s or 0)} deadline; this is the fastest that fits "
                     f"and misses it by {_duration(choice.wall_s - (req.deadline_s or 0))}.")
    elif cheapest is not None and cheapest is not choice:
        parts.append(f"It is the fastest option costing at most {100 * (COST_SLACK - 1):.0f}% more than the cheapest "
                     f"({cheapest.gpus} x {cheapest.hardware}: {_duration(cheapest.wall_s)}, {_money(cheapest)}).")
    else:
        parts.append("It is also the cheapest option" + (" that meets the deadline." if req.deadline_s else "."))
    if not priced:
        parts.append("No prices were given, so options are compared by GPU-hours, which counts an hour of every "
                     "GPU type alike; pass --price-per-gpu-hour to compare money.")
    curve = next((c for c in scaling_curves(options) if (c.hardware, c.method) == (choice.hardware, choice.method)),
                 None)
    if curve and curve.knee is not None and len(curve.points) > 1:
        parts.append(f"{choice.hardware} with {METHOD_WORDS[choice.method]} keeps at least "
                     f"{100 * SCALING_EFFICIENCY_RULE:.0f}% scaling efficiency up to {curve.knee} GPUs (the knee"
                     + (", at the largest count tested" if curve.beyond_range else "") + ").")
    alt_methods = [o for o in fitting if o.hardware == choice.hardware and o.gpus == choice.gpus
                   and o.method != choice.method]
    for alt in alt_methods:
        assert alt.estimate is not None and choice.estimate is not None
        saving = 1 - alt.gpu_hours / choice.gpu_hours
        share = alt.estimate.model.trainable_params / alt.estimate.model.params
        parts.append(f"{METHOD_WORDS[alt.method]} on the same GPUs would take {_duration(alt.wall_s)} "
                     f"({100 * abs(saving):.0f}% {'less' if saving >= 0 else 'more'} GPU time) but trains "
                     f"{100 * share:.2g}% of the weights; choose it only if its quality is enough.")
    risks = _risks(choice, req, hw)
    main = risks[0] if risks else "none stands out: the prediction has memory headroom, meets the compute rule " \
                                  "and its failure overhead is small"
    return Recommendation(option=choice, text=" ".join(parts), main_risk=main, other_risks=risks[1:])


def capacity_report(req: CapacityRequest, progress: Callable[[Option], None] | None = None,
                    jobs: int | None = None) -> CapacityReport:
    started = time.perf_counter()
    options = plan_options(req, progress, jobs)
    recommendation = recommend(options, req)
    comparison = engine_comparison(req, recommendation.option) if prices_ours(req.priced_engine) else None
    return CapacityReport(request=req, options=options, scaling=scaling_curves(options),
                          recommendation=recommendation, seconds=time.perf_counter() - started,
                          error_band=pricing_band(req.priced_engine), against_megatron=comparison)


@dataclass
class EngineComparison:
    """The recommended job planned for Megatron-LM too: how much faster it would run, and the part
    of the step that differs most (`why`)."""

    ours_tokens_per_s: float
    megatron_tokens_per_s: float
    slower: float  # our engines' shortfall: 1 - ours / megatron (negative: ours is faster)
    why: str


# The parts of a step the comparison names, as the cost model splits it (TimeEstimate)
_STEP_PARTS = {"compute_s": "computation (kernels, recomputation)", "tp_comm_s": "tensor-parallel collectives",
               "pp_comm_s": "pipeline transfers", "bubble_s": "the pipeline bubble",
               "dp_exposed_s": "data-parallel/ZeRO collectives not hidden behind compute",
               "optimizer_s": "the optimizer step"}
SLOWER_THAN_MEGATRON = 0.10  # the report says how much and why beyond this


def _step_parts(est: Estimate) -> dict[str, float]:
    """Seconds per token of each part of a step (`_STEP_PARTS`)."""
    t = est.time
    seconds = {"compute_s": t.compute_s, "tp_comm_s": t.tp_comm_s, "pp_comm_s": t.pp_comm_s, "bubble_s": t.bubble_s,
               "dp_exposed_s": max(0.0, t.comm_exposed_s - t.tp_comm_s - t.pp_comm_s), "optimizer_s": t.optimizer_s}
    return {part: value / est.layout.tokens_per_step for part, value in seconds.items()}


def engine_comparison(req: CapacityRequest, option: Option | None) -> EngineComparison | None:
    """The recommended option planned as Megatron-LM would run it (its own best layout for the same
    GPUs, method and batch); None where there is nothing to compare or Megatron finds no plan."""
    if option is None or option.estimate is None:
        return None
    hw = next(h for h in req.hardware if h.name == option.hardware)
    megatron = plan_option(dataclasses.replace(req, priced_engine="megatron"), hw, option.gpus, option.method)
    if megatron.estimate is None:
        return None
    ours, theirs = option.estimate, megatron.estimate
    slower = 1 - ours.throughput.tokens_per_s / theirs.throughput.tokens_per_s
    mine, megatrons = _step_parts(ours), _step_parts(theirs)
    part = max(mine, key=lambda p: mine[p] - megatrons[p])
    share = (mine[part] - megatrons[part]) * ours.layout.tokens_per_step / ours.time.step_s
    layouts = ("the same layout" if ours.layout == theirs.layout
               else f"ours {ours.layout.short()}, Megatron-LM's {theirs.layout.short()}")
    why = f"{_STEP_PARTS[part]}, {share:.0%} of our step beyond Megatron-LM's ({layouts})"
    return EngineComparison(ours.throughput.tokens_per_s, theirs.throughput.tokens_per_s, slower, why)


def parse_prices(text: str | None, hardware: list[HardwareSpec]) -> dict[str, float]:
    """'2.5' (every hardware) or 'h100-80g=2.5,a100-80g=1.6' (per hardware)."""
    if not text:
        return {}
    try:
        if "=" not in text:
            value = float(text)
            return {h.name: value for h in hardware}
        out = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            name, value = (s.strip() for s in item.split("=", 1))
            out[name] = float(value)
        return out
    except ValueError:
        raise UsageError(f"cannot read --price-per-gpu-hour '{text}': use 2.5 or h100-80g=2.5,a100-80g=1.6") from None


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--gpus takes comma-separated integers, e.g. 8,64,512 (got '{text}')") from None
    if not counts or min(counts) < 1:
        raise UsageError(f"--gpus takes positive integers (got '{text}')")
    return sorted(set(counts))
