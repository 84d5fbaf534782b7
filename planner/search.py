"""Layout search: branch and bound over parallel shapes, an ILP (PuLP, solved by HiGHS) for each shape.

The decision splits in two, because its two halves have different structure:

* the *parallel shape* — dp, tp, pp, virtual stages, sequence parallelism, ZeRO stage, offload,
  micro-batch size and accumulation at a fixed global batch, the recomputation mode, the fine-tune
  method — is a small discrete product that multiplies into the cost model non-linearly
  (dp * tp * pp = devices, dp * mbs * gas = batch). We enumerate it, prune shapes the back-ends
  cannot run, and order the rest by a valid lower bound on the step time;
* for one shape, the *layer-to-stage split* and *how many layers of each stage recompute* are an
  integer linear program: every memory and time term of a pipeline stage is affine in its layer
  count n_s and recomputed count k_s (see `stage_memory.StageMemory`), so the ILP
      min  (gas + (pp - 1)/vpp) T + D + O
      s.t. sum_s n_s = L,  0 <= k_s <= n_s,  k_s <= L r_s  (r_s binary: the stage recomputes)
           memory_s(n_s, k_s) <= capacity (both peak moments, both transient cases)
           T >= per-micro-batch time_s,  D >= exposed DP traffic_s,  O >= optimizer time_s
           gas * compute_s >= f * step         (the Amdahl rule, on every stage)
  is exact with respect to the cost model. Its coefficients are read off the cost model itself
  (evaluated at (n, k) = (0, 0), (1, 0), (1, 1)), so no formula is written twice.

Branch and bound: shapes are solved in order of their lower bound until the K-th best plan found
beats every remaining bound.
The result is therefore the optimum of the cost model over the whole space, which
`tests/test_plan_search.py` checks against brute-force enumeration.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import numpy as np

from specs.errors import UsageError
from specs.capabilities import config_shape, runnable_problem
from specs.layout_rules import ModelShape, config_value, layout_problem, pipeline_problem, tensor_parallel_problem, tp_crosses_nodes
from specs.core import MAX_BATCH, MEMORY_MARGIN, MIN_COMPUTE_FRACTION, Estimate, HardwareSpec, Layout, ModelSpec
from planner.cost_model import (
    Placement,
    StageTime,
    estimate_from_trace,
    model_shape,
    stage_memory,
    stage_time,
)
from planner.comm_time import dp_overlap
from planner.stage_params import engine_of
from planner.memory import micro_batches_in_flight
from planner.stage_memory import StageMemory
from profiler.model_trace import ModelTrace, trace_model

RECOMPUTE_MODES = ("selective", "full")
LP_BOUND_SLACK = 1e-6  # relative: HiGHS's feasibility tolerances move an LP optimum by far less
# relative: `spread_bound` lies at or below the LP's optimum, which HiGHS's tolerances may move by
# LP_BOUND_SLACK; a wider margin keeps it from passing the LP's bound (see `search`)
SPREAD_SLACK = 10 * LP_BOUND_SLACK


@dataclass
class SearchSpace:
    """What the search may choose. Every layout it returns also passes `specs.capabilities`
    (what `advisor train` runs, on the engine `engine` selects) unless `runnable_only` is off: then
    it plans for other engines too (Megatron-style sp and interleaving), and says so in the plan."""

    methods: tuple[str, ...] = ("full",)
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    offloads: tuple[str, ...] = ("none", "optimizer", "optimizer+params")
    max_micro_batch: int = 64
    max_vpp: int = 4
    sequence_parallel: tuple[bool, ...] = (False, True)
    allow_cross_node_tp: bool = False
    tp_degrees: tuple[int, ...] | None = None  # restrict (tests, brute-force comparisons)
    pp_degrees: tuple[int, ...] | None = None
    runnable_only: bool = True
    engine: str = "auto"
    # layout keys held fixed (`advisor plan --fix "tp=8,zero=1"`): only layouts with these values
    fixed: dict[str, Any] = field(default_factory=dict)


DEFAULT_LORA_RANK: int = Layout.model_fields["lora_rank"].default


@dataclass
class PlanRequest:
    model: ModelSpec
    hardware: HardwareSpec
    devices: int
    seq: int
    global_batch: int
    dtype: str
    space: SearchSpace = field(default_factory=SearchSpace)
    min_compute_fraction: float = MIN_COMPUTE_FRACTION
    memory_margin: float = MEMORY_MARGIN
    top_k: int = 5
    attention: str | None = None
    lora_rank: int = DEFAULT_LORA_RANK  # LoRA/QLoRA: the adapters' rank (`advisor plan --lora-rank`)
    # rows pack several documents, as the trainer packs its data (trainer/stream.py: a text's
    # documents, or examples beside their padding): priced with the document mask and the expanded
    # GQA key/value heads that transformers' SDPA path then saves. False: one sequence per row
    packed: bool = False


@dataclass
class Solution:
    layout: Layout
    estimate: Estimate
    step_s: float
    meets_compute_rule: bool


@dataclass
class SearchResult:
    solutions: list[Solution]
    status: str
    seconds: float
    shapes: int
    ilps: int
    relaxed_compute_rule: bool


# ------------------------------------------------------------------------------------------
# the discrete shapes


def _divisors(n: int, most: int) -> list[int]:
    """The divisors of n up to `most`, ascending. n comes from the command line (a global batch of
    10**12, a million nodes) and the search needs only small divisors (tp up to the attention
    heads, pp up to the layers, micro-batches up to `max_micro_batch`), so the cost is O(most)."""
    return [d for d in range(1, min(n, most) + 1) if n % d == 0]


def enumerate_shapes(trace: ModelTrace, req: PlanRequest, method: str) -> list[Layout]:
    """Every uniform layout the trainer runs (see `SearchSpace.runnable_only`); recompute is the
    mode the ILP may apply. The dominance rules below skip a layout only for a runnable one that
    is at least as good, so they never empty the space of what runs."""
    shape = model_shape(trace)
    # Selective recomputation is worth offering only where its policy keeps less than everything;
    # otherwise "none" (k = 0 in the full-recompute family) dominates it.
    layer = trace.layer
    selective_kept = layer.input_bytes + layer.selective_replicated_bytes + layer.selective_sharded_bytes
    modes = RECOMPUTE_MODES if selective_kept < layer.act_bytes else ("full",)
    runs = _runs(req, shape)
    return [layout for layout in _candidate_shapes(shape, modes, req, method, runs) if runs(layout)]


def may_have_shapes(req: PlanRequest, method: str) -> bool:
    """Whether any layout of `method` can run, read from the config before any trace: of the trace,
    the enumeration reads only the sizes the config gives and whether the head is tied (both tried
    here), and here every recompute mode is offered, so False is the traced search's answer too. A
    cold trace costs seconds per (method, sequence length): planning a 10**12 batch on 2**20 devices,
    which no layout splits, traced six of them for nothing."""
    if any(config_value(req.model.hf_config, size) is None for size in ("hidden_size", "num_heads", "num_layers")):
        return True  # the trace says, in one line, what the config lacks
    for tied in (False, True):
        shape = dataclasses.replace(config_shape(req.model.hf_config), tied_embeddings=tied)
        runs = _runs(req, shape)
        if any(runs(layout) for layout in _candidate_shapes(shape, RECOMPUTE_MODES, req, method, runs)):
            return True
    return False


def _runs(req: PlanRequest, shape: ModelShape) -> Callable[[Layout], bool]:
    """Whether a layout of this model is in the space: holds the fixed keys and, where the space is
    what runs here (`SearchSpace.runnable_only`), runs on the device and engine; else is well formed."""
    fixed, engine, device_type = req.space.fixed, req.space.engine, req.hardware.device_type
    if req.space.runnable_only:
        return lambda layout: (has_fixed(layout, fixed)
                               and runnable_problem(layout, shape, device_type, engine) is None)
    return lambda layout: has_fixed(layout, fixed) and layout_problem(layout, shape) is None


def has_fixed(layout: Layout, fixed: dict[str, Any]) -> bool:
    """Whether `layout` holds the fixed keys' values. Inside `runs`, so that a dominance rule never
    skips a layout for one the fix excludes."""
    return all(getattr(layout, key) == value for key, value in fixed.items())


def _candidate_shapes(shape: ModelShape, modes: tuple[str, ...], req: PlanRequest, method: str,
                      runs: Callable[[Layout], bool]) -> Iterator[Layout]:
    """The product of the discrete choices, less what a runnable layout dominates (lazily: a caller
    asking whether any runs stops at the first)."""
    space, hw = req.space, req.hardware
    tps = space.tp_degrees or tuple(_divisors(req.devices, shape.num_heads))  # tp divides the heads
    for tp in tps:
        if req.devices % tp or tensor_parallel_problem(tp, shape):
            continue
        if tp_crosses_nodes(tp, hw.devices_per_node) and not space.allow_cross_node_tp:
            continue
        for pp in space.pp_degrees or tuple(_divisors(req.devices // tp, shape.num_layers)):  # pp <= layers
            if (req.devices // tp) % pp or pipeline_problem(pp, 1, 1, None, shape.num_layers):
                continue
            dp = req.devices // (tp * pp)
            if req.global_batch % dp:
                continue
            per_replica = req.global_batch // dp
            for mbs in _divisors(per_replica, space.max_micro_batch):
                gas = per_replica // mbs
                if gas > MAX_BATCH:  # more micro-steps than a layout may hold (specs.core MAX_BATCH)
                    continue
                vpps = [1] + [v for v in range(2, space.max_vpp + 1)
                              if pp > 1 and not pipeline_problem(pp, v, gas, None, shape.num_layers)]
                for vpp, sp in itertools.product(vpps, space.sequence_parallel):
                    if sp and tp == 1:
                        continue
                    if not sp and tp > 1 and True in space.sequence_parallel and runs(Layout(
                            dp=dp, tp=tp, pp=pp, vpp=vpp, sp=True, mbs=mbs, gas=gas, method=method,
                            dtype=req.dtype, seq=req.seq, lora_rank=req.lora_rank)):
                        continue  # SP dominates at tp > 1: less memory, same traffic (AG + RS = AR)
                    for zero in space.zero_stages:
                        if zero and dp == 1 and (zero != 2 or "optimizer" not in space.offloads
                                                 or hw.device_type == "cpu"):
                            continue  # ZeRO shards across replicas; alone it only serves ZeRO-Offload
                        # no dominance between zero=0 and ZeRO-1 now that each is priced as its engine keeps
                        # it: DDP's bf16 AdamW holds no fp32 master, DeepSpeed's and FSDP2's ZeRO-1 do
                        for offload in space.offloads:
                            if offload == "optimizer" and zero == 0 or offload == "optimizer+params" and zero != 3:
                                continue
                            if offload != "none" and hw.device_type == "cpu":
                                continue  # on a CPU the device memory is the host memory
                            if dp == 1 and zero and offload == "none":
                                continue
                            for mode in modes:
                                yield Layout(
                                    dp=dp, tp=tp, pp=pp, vpp=vpp, sp=sp, zero=zero, offload=offload, mbs=mbs,
                                    gas=gas, recompute=mode, method=method, dtype=req.dtype, seq=req.seq,
                                    lora_rank=req.lora_rank,
                                )


# ------------------------------------------------------------------------------------------
# affine coefficients of one shape's stages, read off the cost model


@dataclass
class _Affine:
    c: float   # at (n, k) = (0, 0)
    n: float   # per layer
    k: float   # per recomputed layer

    def __call__(self, layers: float, recomputed: float) -> float:
        return self.c + self.n * layers + self.k * recomputed


def _affine(f00: float, f10: float, f11: float) -> _Affine:
    return _Affine(f00, f10 - f00, f11 - f10)


@dataclass
class _StageCoefficients:
    backward_base: _Affine  # weights + optimizer + resident grads + activations + ZeRO-3 live
    optimizer_moment: _Affine
    logits: float  # the loss's buffers, or DeepSpeed ZeRO-1/2's bucket and first gradient where larger
    regrown: float
    overlap: float
    host: _Affine
    host_capacity: float
    fixed_per_layer: float  # bytes per layer of the backward-start moment that are not activations
    # Read off the cost model on first use, once for a stage and the copies `_all_coefficients` makes
    # of it (cached callables): most shapes are refused on their memory alone (7 in 10 for llama3-70b
    # on 256 GPUs) and only the stage program reads the regrown gradients. The time terms are
    # per_mb, compute, dp_comm, dp_hidden, update.
    time_terms: Callable[[], tuple[_Affine, ...]] = field(repr=False)
    time_point: Callable[[int, int], tuple[float, ...]] = field(repr=False)  # the terms at one (n, k)
    regrown_gradients_of: Callable[[], _Affine] = field(repr=False)  # with the regrown layer only (no k)

    def _time(self, term: int) -> _Affine:
        return self.time_terms()[term]

    def time_constant(self, term: int) -> float:
        """The term at (n, k) = (0, 0), its affine's `c`, without the two other points: the mean-stage
        bound reads the slopes of the first stage only (`lower_bound`)."""
        return self.time_point(0, 0)[term]

    def time_slope(self, term: int) -> float:
        """The term's affine's `n`, without the point at (1, 1) (read for `k` only)."""
        return self.time_point(1, 0)[term] - self.time_point(0, 0)[term]

    per_mb = property(lambda self: self._time(0))
    compute = property(lambda self: self._time(1))
    dp_comm = property(lambda self: self._time(2))
    dp_hidden = property(lambda self: self._time(3))
    update = property(lambda self: self._time(4))
    regrown_gradients = property(lambda self: self.regrown_gradients_of())


def _memo(function: Callable) -> Callable:
    """`functools.cache` without its wrapper's bookkeeping, which cost more than it saved at three a
    stage kind of each of thousands of shapes."""
    results: dict = {}

    def cached(*args):
        if args not in results:
            results[args] = function(*args)
        return results[args]

    return cached


def _memory_parts(m: StageMemory) -> tuple[float, float]:
    return (m.weights + m.optimizer + m.resident_gradients + m.activations + m.zero3_live, m.optimizer_step)


def _time_parts(t: StageTime) -> tuple[float, ...]:
    return (t.per_micro_batch, t.useful_compute_mb, t.dp_comm, t.dp_hidden_max, t.optimizer + t.offload)


def stage_coefficients(trace: ModelTrace, layout: Layout, hw: HardwareSpec, stage: int,
                       known: dict[tuple[int, int], StageMemory] | None = None) -> _StageCoefficients:
    """The stage's memory and time as affine functions of its layers n and recomputed layers k, read
    off the cost model at a few (n, k) points; `known`: (n, k) -> its memory, where already evaluated
    (`_cheap_refusal`)."""
    known = known or {}
    mems = [known.get(nk) or stage_memory(trace, layout, hw, stage, *nk) for nk in ((0, 0), (1, 0), (1, 1))]
    parts = [_memory_parts(m) for m in mems]
    m0, m1 = mems[:2]
    fixed_per_layer = (m1.weights + m1.optimizer + m1.resident_gradients + m1.zero3_live) - (
        m0.weights + m0.optimizer + m0.resident_gradients + m0.zero3_live)

    @_memo
    def time_point(n: int, k: int) -> tuple[float, ...]:
        return _time_parts(stage_time(trace, layout, hw, Placement.of(layout, hw.devices_per_node), stage, n, k))

    @_memo
    def time_terms() -> tuple[_Affine, ...]:
        times = [time_point(n, k) for n, k in ((0, 0), (1, 0), (1, 1))]
        return tuple(_affine(*(t[i] for t in times)) for i in range(5))

    @_memo
    def regrown_gradients() -> _Affine:
        grads_per_layer = stage_memory(trace, layout, hw, stage, 2, 1).regrown_gradients - mems[2].regrown_gradients
        return _Affine(mems[2].regrown_gradients - grads_per_layer, grads_per_layer, 0.0)

    return _StageCoefficients(
        backward_base=_affine(*(p[0] for p in parts)), optimizer_moment=_affine(*(p[1] for p in parts)),
        logits=max(mems[0].logits, mems[0].first_gradient), regrown=mems[2].regrown,
        overlap=dp_overlap(hw, engine_of(layout), trace.num_layers), host=_affine(*(m.host for m in mems)),
        host_capacity=mems[0].host_capacity, fixed_per_layer=fixed_per_layer, time_terms=time_terms,
        time_point=time_point, regrown_gradients_of=regrown_gradients,
    )


def _stage_kinds(pp: int) -> list[int]:
    """Stages whose coefficients differ by more than their in-flight count: first, middle, last."""
    return sorted({0, min(1, pp - 1), pp - 1})


def _kind_coefficients(trace: ModelTrace, layout: Layout, hw: HardwareSpec,
                       known: list[dict[tuple[int, int], StageMemory]] | None = None) -> list[_StageCoefficients]:
    """Of the stages `_stage_kinds` names: every stage where pp <= 3."""
    kinds = _stage_kinds(layout.pp)
    return [stage_coefficients(trace, layout, hw, s, known[i] if known else None) for i, s in enumerate(kinds)]


def _cheap_refusal(trace: ModelTrace, layout: Layout, hw: HardwareSpec, capacity: float,
                   known: list[dict[tuple[int, int], StageMemory]]) -> bool:
    """Whether the shape fails the two memory rows that refuse most shapes of a large plan, read at
    the fewest points (the rest of its coefficients, and all of its times, are then never read): the
    last stage with one recomputed layer beside the loss's buffers (two points; alone it refuses 9
    in 10 of these shapes for llama3-70b on 256 GPUs, so it goes first), then the optimizer step
    (affine in n, flight-independent) on every stage with one layer and on the mean stage. `known`
    collects the memory evaluated, by stage kind."""
    pp, kinds = layout.pp, _stage_kinds(layout.pp)
    last = known[-1]
    for nk in ((0, 0), (1, 1)):
        last[nk] = stage_memory(trace, layout, hw, kinds[-1], *nk)
    if _memory_parts(last[(1, 1)])[0] + max(last[(0, 0)].logits, last[(0, 0)].first_gradient) > capacity:
        return True
    for stage, points in zip(kinds, known):
        for nk in ((0, 0), (1, 0)):
            if nk not in points:
                points[nk] = stage_memory(trace, layout, hw, stage, *nk)
    counts = [1] * len(kinds) if pp <= 3 else [1, pp - 2, 1]
    empty = [points[(0, 0)].optimizer_step for points in known]
    one = [points[(1, 0)].optimizer_step for points in known]
    mean = (sum(w * e for w, e in zip(counts, empty)) + (one[0] - empty[0]) * trace.num_layers) / pp
    return max(one) > capacity or mean > capacity


def _all_coefficients(trace: ModelTrace, layout: Layout, hw: HardwareSpec,
                      kinds: list[_StageCoefficients] | None = None) -> list[_StageCoefficients]:
    """Per stage. Middle stages differ only in micro-batches in flight, which scales the
    activation terms: evaluate stages 0, 1 and pp-1 (`kinds`, when already evaluated) and rescale
    the others exactly."""
    pp = layout.pp
    kinds = kinds or _kind_coefficients(trace, layout, hw)
    if pp <= 3:
        return kinds
    first, middle, last = kinds
    act_per_layer = middle.backward_base.n - middle.fixed_per_layer
    act_per_recomputed = middle.backward_base.k
    base_flight = micro_batches_in_flight(1, layout)
    out = [first]
    for s in range(1, pp - 1):
        scale = micro_batches_in_flight(s, layout) / base_flight
        base = middle.backward_base
        coeff = _StageCoefficients(**{**middle.__dict__})
        coeff.backward_base = _Affine(base.c, base.n - act_per_layer + scale * act_per_layer,
                                      scale * act_per_recomputed)
        out.append(coeff)
    out.append(last)
    return out


# ------------------------------------------------------------------------------------------
# bounds and the ILP


@dataclass(frozen=True)
class Bound:
    """What any split of one shape can at best achieve."""

    step_s: float             # lower bound on the step time
    max_compute_fraction: float  # upper bound on the least busy stage's compute share
    # each stage's coefficients, read for the bound: the shape's program reuses them in both searches
    coefficients: list[_StageCoefficients] | None = field(default=None, compare=False, repr=False)


def _most_layers(c: _StageCoefficients, layers: int, capacity: float) -> int:
    """At most how many decoder layers (<= `layers`) one stage can hold within its memory rows of
    the ILP, whatever it recomputes: its memory is affine in the recomputed count k, so k = 0 or
    k = n is least, and each row, affine in n, allows the n below its crossing (or every n up to
    `layers` when it falls with n). An upper bound, which is all the search's bound needs."""
    limit = capacity * (1 + 1e-9)

    def most(a: float, b: float, cap: float = limit) -> int:  # max n in [-1, layers] with a + b n <= cap
        if a + b * layers <= cap:
            return layers
        return min(layers, math.floor((cap - a) / b + 1e-9)) if b > 0 and a <= cap else -1

    base = c.backward_base
    keep_all = most(base.c + c.logits, base.n)
    recompute_all = most(base.c + max(c.logits, c.regrown), base.n + base.k)
    return min(max(keep_all, recompute_all), most(c.optimizer_moment.c, c.optimizer_moment.n),
               most(c.host.c, c.host.n, c.host_capacity * (1 + 1e-9)))


def lower_bound(trace: ModelTrace, layout: Layout, hw: HardwareSpec, capacity: float) -> Bound | None:
    """A valid bound for every split of this shape; None if no split can fit in memory.

    The max over stages is >= the mean over stages, and the mean of an affine term depends only on
    sum n_s = L. Recomputation only adds time and only removes memory: the bound charges the
    least recomputation that brings the *mean* stage's memory under the capacity.
    """
    pp, layers = layout.pp, trace.num_layers
    known: list[dict[tuple[int, int], StageMemory]] = [{} for _ in _stage_kinds(pp)]
    if _cheap_refusal(trace, layout, hw, capacity, known):
        return None
    kinds = _kind_coefficients(trace, layout, hw, known)
    coeffs = kinds  # first, middle and last stage where pp > 3
    counts = [1] * len(coeffs) if pp <= 3 else [1, pp - 2, 1]

    def mean(get) -> float:  # mean over stages of an affine term with k = 0
        return (sum(w * get(c).c for w, c in zip(counts, coeffs)) + get(coeffs[0]).n * layers) / pp

    # memory: every stage holds >= 1 layer; the optimizer moment is affine and flight-independent
    if max(c.optimizer_moment(1, 0) for c in coeffs) > capacity:
        return None
    if mean(lambda c: c.optimizer_moment) > capacity:
        return None
    if coeffs[-1].backward_base(1, 1) + coeffs[-1].logits > capacity:
        return None
    if max(c.host(1, 0) - c.host_capacity for c in coeffs) > 0:
        return None
    every_stage = _all_coefficients(trace, layout, hw, kinds)
    most = [_most_layers(c, layers, capacity) for c in every_stage]
    if min(most) < layout.vpp or sum(most) < layers:
        return None  # no split fits: some stage cannot hold its vpp chunks, or all cannot hold L
    # least recomputation that the mean stage needs (layers placed where they cost least memory)
    base = sum(w * (c.backward_base.c + c.logits) for w, c in zip(counts, coeffs))
    excess = base + min(c.backward_base.n for c in coeffs) * layers - pp * capacity
    recomputed = 0.0
    if excess > 0:
        saving = max(-c.backward_base.k for c in coeffs)  # per recomputed layer, best stage
        if saving <= 0 or excess > saving * layers:
            return None
        recomputed = excess / saving
    def mean_time(term: int) -> float:  # `mean` of a time term, read at the fewest points
        return (sum(w * c.time_constant(term) for w, c in zip(counts, coeffs)) + coeffs[0].time_slope(term) * layers) / pp

    slot = mean_time(0) + (coeffs[0].per_mb.k * recomputed / pp if recomputed else 0.0)
    dp = mean_time(2) * (1 - coeffs[0].overlap)
    # the step, (gas - 1/vpp) max_s t_s + sum_s t_s / vpp, is at least this at max >= mean
    step = (layout.gas + (pp - 1) / layout.vpp) * slot + dp + mean_time(4)
    return Bound(step, layout.gas * mean_time(1) / step, every_stage)


def may_meet_compute_rule(bound: Bound, layout: Layout, layers: int, min_fraction: float) -> bool:
    """Whether any split of the shape might keep every stage's compute >= `min_fraction` of the step:
    the mean stage's share (`Bound.max_compute_fraction`), then the least busy stage's
    (`_least_busy_compute`, read only for the shapes the first lets through)."""
    least = min_fraction * (1 - 1e-9)
    if bound.max_compute_fraction < least:
        return False
    if not min_fraction or bound.coefficients is None:
        return True
    every = bound.coefficients
    kinds = every if layout.pp <= 3 else [every[0], every[1], every[-1]]  # the middle copies share times
    return layout.gas * _least_busy_compute(kinds, layout, layers) / bound.step_s >= least


def _least_busy_compute(kinds: list[_StageCoefficients], layout: Layout, layers: int) -> float:
    """An upper bound on the least busy stage's useful compute over every integer split (each stage
    holds at least vpp layers): the stage with the fewest layers holds at most floor(L / pp); where
    pp > 3, the fewest among the pp - 2 middle stages (one kind) at most floor((L - 2 vpp) / (pp - 2)).
    80 layers on 32 stages: 2, where the mean stage computes 2.5 and the first and last more."""
    pp, vpp = layout.pp, layout.vpp
    group, others = (kinds[1:2], 2) if pp > 3 else (kinds, 0)
    fewest = (layers - others * vpp) // (pp - others)

    def most(c: _StageCoefficients) -> float:  # affine in n, k <= n: an end of [vpp, fewest]
        slope = c.compute.n + max(0.0, c.compute.k)
        return c.compute.c + slope * max(vpp, fewest) if slope >= 0 else c.compute.c + slope * vpp

    return max(most(c) for c in group)


class StageProgram:
    """The stage-split ILP of one shape (see the module docstring), written in matrix form and
    modelled in PuLP once per shape, solved by HiGHS in process (highspy): CBC, PuLP's bundled
    solver, runs as one subprocess per solve and its branch and bound took up to seconds on
    pp >= 4 shapes, so it is only the fallback where highspy does not import. Its LP relaxation
    is the shape's second, tighter bound (`relaxed_step_s`): it sees the max over stages, the
    memory of every stage and the compute rule, which the mean-stage `lower_bound` cannot.

    Variables: n_s (layers), k_s (recomputed layers), r_s (the stage recomputes; only where the
    recomputed layer regrows activations), then T (slot), D (exposed DP traffic), O (optimizer).
    Memory rows are in units of the capacity and time rows in seconds, which keeps the solver's
    tolerances meaningful for byte counts of 1e11 next to times of 1e-3.
    """

    def __init__(self, coeffs: list[_StageCoefficients], layout: Layout, layers: int, capacity: float,
                 min_fraction: float):
        pp, gas = layout.pp, layout.gas
        self.pp, self.layout = pp, layout
        regrows = [s for s, c in enumerate(coeffs) if c.regrown > 0]
        r_index = {s: 2 * pp + i for i, s in enumerate(regrows)}
        width = 2 * pp + len(regrows) + 3
        slot, dp, update = width - 3, width - 2, width - 1
        # step = gas T + (sum_s per_mb_s - T) / vpp + D + O (cost_model.step_seconds: the slowest
        # stage's slots and the other stages' fill and drain); sum_s per_mb_s is affine in (n, k)
        objective = np.zeros(width)
        objective[[slot, dp, update]] = (gas - 1 / layout.vpp, 1.0, 1.0)
        for s, c in enumerate(coeffs):
            objective[s] += c.per_mb.n / layout.vpp
            objective[pp + s] += c.per_mb.k / layout.vpp
        self.step_constant = sum(c.per_mb.c for c in coeffs) / layout.vpp
        rows: list[np.ndarray] = []
        lo: list[float] = []
        hi: list[float] = []

        def row(terms: dict[int, float], low: float = -np.inf, high: float = np.inf) -> None:
            line = np.zeros(width)
            for index, value in terms.items():
                line[index] += value
            rows.append(line)
            lo.append(low)
            hi.append(high)

        row({s: 1.0 for s in range(pp)}, layers, layers)
        most = [_most_layers(c, layers, capacity) for c in coeffs]
        for s, c in enumerate(coeffs):
            n, k = s, pp + s
            row({k: 1.0, n: -1.0}, high=0.0)
            scale = 1.0 / capacity
            base = c.backward_base
            if s in r_index:  # the layer being recomputed regrows its activations
                row({k: 1.0, r_index[s]: -float(max(1, most[s]))}, high=0.0)  # the least big-M: a tighter LP
                # the gradients held then grow with n but count only with r: big-M keeps the row
                # slack when the stage does not recompute (n <= most)
                grads = c.regrown_gradients
                big = max(grads.n, 0.0) * max(1, most[s])
                row({n: (base.n + grads.n) * scale, k: base.k * scale,
                     r_index[s]: (c.regrown + grads.c + big) * scale}, high=1.0 - (base.c - big) * scale)
            row({n: base.n * scale, k: base.k * scale}, high=1.0 - (base.c + c.logits) * scale)
            moment = c.optimizer_moment
            row({n: moment.n * scale, k: moment.k * scale}, high=1.0 - moment.c * scale)
            if c.host.n or c.host.c:
                row({n: c.host.n / c.host_capacity}, high=1.0 - c.host.c / c.host_capacity)
            row({slot: 1.0, n: -c.per_mb.n, k: -c.per_mb.k}, low=c.per_mb.c)
            row({dp: 1.0, n: -(1 - c.overlap) * c.dp_comm.n}, low=(1 - c.overlap) * c.dp_comm.c)
            row({dp: 1.0, n: c.dp_hidden.n - c.dp_comm.n, k: c.dp_hidden.k}, low=c.dp_comm.c - c.dp_hidden.c)
            row({update: 1.0, n: -c.update.n}, low=c.update.c)
            if min_fraction > 0:  # gas * compute_s >= f * step
                terms = {i: -min_fraction * objective[i] for i in range(width) if objective[i]}
                terms[n] = terms.get(n, 0.0) + gas * c.compute.n
                terms[k] = terms.get(k, 0.0) + gas * c.compute.k
                row(terms, low=-gas * c.compute.c + min_fraction * self.step_constant)
        lower = np.zeros(width)
        upper = np.full(width, np.inf)
        # each device holds vpp chunks of at least one layer (specs.core.chunk_layers)
        lower[:pp], upper[:pp] = layout.vpp, np.maximum(most, layout.vpp)
        upper[pp:2 * pp] = layers
        # Some stage holds at least ceil(L / pp) layers, so each max-over-stages term is at least its
        # least value over stages at that many layers: valid for every integer split, and it closes
        # most of the LP's gap where the layers do not divide evenly (80 layers on 32 stages).
        lower[slot], lower[dp], lower[update] = _crowded_floors(coeffs, layers)
        upper[2 * pp:slot] = 1
        integrality = np.zeros(width)
        integrality[:slot] = 1
        self.objective, self.integrality, self.lower, self.upper = objective, integrality, lower, upper
        self.rows, self.row_lo, self.row_hi = np.array(rows), np.array(lo), np.array(hi)
        self._model = None

    def _pulp(self):
        """The program as a PuLP model, built once per shape (the LP relaxation and the ILP both
        solve it): its columns, in the matrix's order, and the objective without its constant."""
        if self._model is None:
            import pulp  # deferred: only `advisor plan` solves programs

            problem = pulp.LpProblem("stage_split", pulp.LpMinimize)
            names = _column_names(self.pp, len(self.objective) - 2 * self.pp - 3)
            digits = len(str(len(names)))  # PuLP hands its columns to the solver sorted by name
            columns = [problem.add_variable(f"x{j:0{digits}d}_{name}", lowBound=float(low),
                                            upBound=float(high) if math.isfinite(high) else None,
                                            cat=pulp.LpInteger if integral else pulp.LpContinuous)
                       for j, (name, low, high, integral) in
                       enumerate(zip(names, self.lower, self.upper, self.integrality))]

            def expression(line: np.ndarray):
                return pulp.LpAffineExpression([(columns[j], float(line[j])) for j in np.flatnonzero(line)])

            objective = expression(self.objective)
            problem.setObjective(objective)
            for line, low, high in zip(self.rows, self.row_lo, self.row_hi):
                if low == high:
                    problem.addConstraint(pulp.LpConstraint(expression(line), pulp.LpConstraintEQ, rhs=float(low)))
                    continue
                if math.isfinite(high):
                    problem.addConstraint(pulp.LpConstraint(expression(line), pulp.LpConstraintLE, rhs=float(high)))
                if math.isfinite(low):
                    problem.addConstraint(pulp.LpConstraint(expression(line), pulp.LpConstraintGE, rhs=float(low)))
            self._model = (problem, columns, objective)
        return self._model

    def _solve(self, integral: bool, cutoff: float = math.inf) -> np.ndarray | None:
        """The optimal columns of the ILP (or, not `integral`, of its LP relaxation); None when
        nothing fits with a step below `cutoff`."""
        import pulp

        problem, columns, objective = self._pulp()
        if cutoff < math.inf:  # only a step below the cutoff matters: the solver prunes by it
            problem = problem.copy()  # the rows are shared, not copied
            problem.addConstraint(pulp.LpConstraint(objective, pulp.LpConstraintLE, "cutoff",
                                                    cutoff - self.step_constant))
        problem.solve(_solver(integral))
        if problem.status != pulp.LpStatusOptimal:
            return None
        return np.array([column.varValue for column in columns], dtype=float)

    def _single_stage(self) -> tuple[float, np.ndarray] | None:
        """pp = 1: the stage holds every layer, so only k (and r = [k > 0]) is free. Every k is tried
        on the program's own rows, with T, D and O at the least their rows allow (which also leaves
        the compute rule the most room): the exact optimum, without a solver call."""
        width = len(self.objective)
        tdo = slice(width - 3, width)
        ks = np.arange(int(self.lower[1]), int(self.upper[1]) + 1)
        x = np.zeros((len(ks), width))
        x[:, 0], x[:, 1] = self.row_lo[0], ks  # row 0: sum n = L
        if width > 5:
            x[:, 2] = ks > 0
        head = x[:, :width - 3] @ self.rows[:, :width - 3].T  # (choices, rows): all but T, D, O
        owners = self.rows[:, tdo]
        for i in range(3):  # rows `var - terms >= low` bound one of T, D, O from below
            only = (owners[:, i] > 0) & (np.count_nonzero(owners, axis=1) == 1) & np.isfinite(self.row_lo)
            need = (self.row_lo[only] - head[:, only]) / owners[only, i]
            x[:, width - 3 + i] = np.maximum(self.lower[width - 3 + i], need.max(axis=1, initial=0.0))
        activity = x @ self.rows.T
        slack = 1e-9 * (1 + np.abs(np.where(np.isfinite(self.row_hi), self.row_hi, self.row_lo)))
        fits = (np.all((activity <= self.row_hi + slack) & (activity >= self.row_lo - slack), axis=1)
                & np.all((x >= self.lower) & (x <= self.upper), axis=1))
        if not fits.any():
            return None
        steps = np.where(fits, x @ self.objective + self.step_constant, np.inf)
        best = int(np.argmin(steps))  # the fewest recomputed layers among equals
        return float(steps[best]), x[best]

    def relaxed_step_s(self) -> float:
        """The LP relaxation's optimum (for pp = 1 the exact one): no split of this shape steps
        faster; inf when none fits."""
        if self.pp == 1:
            single = self._single_stage()
            return single[0] if single else math.inf
        values = self._relaxation()
        return float(self.objective @ values) + self.step_constant if values is not None else math.inf

    def _relaxation(self) -> np.ndarray | None:
        """The LP relaxation's optimal columns, by HiGHS on the matrix itself: a bound that orders the
        search, solved for ~20x more shapes than reach the ILP, where building each as a PuLP model
        cost more than HiGHS's solve (the decision itself, `solve`, is PuLP's). Through highspy where
        it imports: scipy's `linprog` around the same HiGHS took twice the solve in checks and copies."""
        if not _has_highspy():
            return self._relaxation_by_scipy()
        import highspy

        infinite = highspy.kHighsInf
        lp = highspy.HighsLp()
        lp.num_row_, lp.num_col_ = self.rows.shape
        lp.col_cost_, lp.col_lower_ = self.objective, self.lower
        lp.col_upper_ = np.where(np.isfinite(self.upper), self.upper, infinite)
        lp.row_lower_ = np.where(np.isfinite(self.row_lo), self.row_lo, -infinite)
        lp.row_upper_ = np.where(np.isfinite(self.row_hi), self.row_hi, infinite)
        columns, rows = np.nonzero(self.rows.T)  # column-wise, as HiGHS stores a matrix
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.searchsorted(columns, np.arange(lp.num_col_ + 1)).astype(np.int32)
        lp.a_matrix_.index_, lp.a_matrix_.value_ = rows.astype(np.int32), self.rows[rows, columns]
        solver = _lp_solver()
        solver.clearModel()
        solver.passModel(lp)
        solver.run()
        if solver.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        return np.array(solver.getSolution().col_value, dtype=float)

    def _relaxation_by_scipy(self) -> np.ndarray | None:
        """`_relaxation` where highspy does not import: scipy bundles its own HiGHS."""
        from scipy.optimize import linprog  # deferred: only `advisor plan` solves programs

        equal = self.row_lo == self.row_hi
        above, below = ~equal & np.isfinite(self.row_hi), ~equal & np.isfinite(self.row_lo)
        result = linprog(self.objective, A_ub=np.vstack([self.rows[above], -self.rows[below]]),
                         b_ub=np.concatenate([self.row_hi[above], -self.row_lo[below]]),
                         A_eq=self.rows[equal], b_eq=self.row_lo[equal],
                         bounds=[(low, high if math.isfinite(high) else None) for low, high in zip(self.lower, self.upper)],
                         method="highs")
        return result.x if result.status == 0 else None

    def solve(self, cutoff: float = math.inf) -> Layout | None:
        """The optimal split and recompute counts, as a layout; None when nothing fits with a step
        below `cutoff` (the search's K-th best: a shape that cannot beat it changes no answer)."""
        if self.pp == 1:
            single = self._single_stage()
            if single is None or single[0] > cutoff:
                return None
            values = single[1]
        else:
            values = self._solve(integral=True, cutoff=cutoff)
            if values is None:
                return None
        pp = self.pp
        split = [int(round(v)) for v in values[:pp]]
        recomputed = [int(round(v)) for v in values[pp:2 * pp]]
        update_fields: dict = {"stage_layers": split if pp > 1 else None}
        if any(recomputed):
            update_fields["recompute_layers"] = recomputed
        else:
            update_fields.update(recompute="none", recompute_layers=None)
        return self.layout.model_copy(update=update_fields)


def _crowded_floors(coeffs: list[_StageCoefficients], layers: int) -> tuple[float, float, float]:
    """Floors on the program's T, D and O: some stage holds at least ceil(L / pp) layers, so each
    max-over-stages term is at least its least value over stages at that many layers."""
    crowded = -(-layers // len(coeffs))
    terms = [c.time_terms() for c in coeffs]  # per_mb, compute, dp_comm, dp_hidden, update: read once
    return (_least_at(crowded, [(t[0].c, t[0].n, t[0].k) for t in terms]),
            _least_at(crowded, [((1 - c.overlap) * t[2].c, (1 - c.overlap) * t[2].n, 0.0) for c, t in zip(coeffs, terms)]),
            _least_at(crowded, [(t[4].c, t[4].n, t[4].k) for t in terms]))


def spread_bound(coeffs: list[_StageCoefficients], layout: Layout, layers: int, capacity: float) -> float:
    """A lower bound on the stage program's optimum, LP relaxation included, from a relaxation of its
    rows solved in closed form: the slot T is at least the column floor (`_crowded_floors`) and at
    least the least T at which the stages, each held to its time and backward-start memory rows
    (`_least_slot`), can take the L layers between them; the fill and drain term, sum_s per_mb_s /
    vpp, is at least every stage's constant plus L layers at the least per-layer slope. Tighter than
    the mean-stage `lower_bound` where the layers do not divide evenly (80 on 32 stages: the crowded
    stage holds 3, the mean 2.5) or where the first stages' micro-batches in flight force them to
    recompute, and far cheaper than the LP."""
    slot, dp, update = _crowded_floors(coeffs, layers)
    slot = max(slot, _least_slot(coeffs, layout, layers, capacity))
    per_mb = [c.per_mb for c in coeffs]
    least_slope = min(t.n + min(0.0, t.k) for t in per_mb)
    fill = (sum(t.c for t in per_mb) + least_slope * layers) / layout.vpp
    return (layout.gas - 1 / layout.vpp) * slot + fill + dp + update


def _least_slot(coeffs: list[_StageCoefficients], layout: Layout, layers: int, capacity: float) -> float:
    """The least T with sum_s n_s(T) >= L, n_s(T) the most layers stage s holds with per_mb_s <= T
    and its backward-start row (recomputing the fewest layers that row needs, k >= 0 only): a
    lower bound on the program's T. Each n_s(T) is piecewise linear in T, so the sum is evaluated at
    every stage's breakpoints and solved between the two that straddle L. 0 (no bound) where a
    stage's terms do not have the signs this assumes (time grows with n and k, recomputing frees)."""
    per_mb = [c.per_mb for c in coeffs]
    base = [c.backward_base for c in coeffs]
    if any(t.n < 0 or t.k < 0 or b.n < 0 or b.k >= 0 for t, b in zip(per_mb, base)):
        return 0.0
    most = np.array([max(_most_layers(c, layers, capacity), layout.vpp) for c in coeffs], dtype=float)
    c0, a, b = (np.array([getattr(t, x) for t in per_mb]) for x in ("c", "n", "k"))
    beta, freed = np.array([m.n for m in base]), -np.array([m.k for m in base])
    room = capacity - np.array([m.c + c.logits for m, c in zip(base, coeffs)])  # before any recompute
    kept = np.where(room <= 0, 0.0, np.minimum(most, np.divide(room, beta, out=np.full_like(room, np.inf),
                                                                where=beta > 0)))

    def time(n: np.ndarray) -> np.ndarray:
        return c0 + a * n + b * np.maximum(0.0, (beta * n - room) / freed)

    knots = np.stack([time(np.zeros_like(most)), time(kept), time(most)])  # (3, stages)

    def held(slots: np.ndarray) -> np.ndarray:  # sum_s n_s(slot) at each slot, the upper value at a jump
        t0, t1, t2 = knots
        slot = slots[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            first = np.where(t1 > t0, kept * (slot - t0) / (t1 - t0), kept)
            second = np.where(t2 > t1, kept + (most - kept) * (slot - t1) / (t2 - t1), most)
        n = np.where(slot >= t2, most, np.where(slot >= t1, second, np.where(slot >= t0, first, 0.0)))
        return n.sum(axis=1)

    points = np.unique(knots)
    totals = held(points)
    if totals[-1] < layers:
        return math.inf  # the stages cannot hold L layers at any T
    reach = int(np.argmax(totals >= layers))
    if reach == 0:
        return float(points[0])
    low, high = points[reach - 1], points[reach]
    middle = (low + high) / 2  # the sum is linear between breakpoints: its slope there
    slope = (float(held(np.array([middle]))[0]) - totals[reach - 1]) / (middle - low)
    crossing = low + (layers - totals[reach - 1]) / slope if slope > 0 else high
    return float(min(max(crossing, low), high))


def _least_at(layers: int, terms: list[tuple[float, float, float]]) -> float:
    """A lower bound on max_s (c_s + a_s n_s + b_s k_s) over splits where some stage holds `layers`
    or more (0 <= k_s <= n_s): the least over stages of the term at that many layers, when every term
    grows with n (else 0, no bound)."""
    slopes = [a + min(0.0, b) for _, a, b in terms]
    if min(slopes) < 0:
        return 0.0
    return max(0.0, min(c + slope * layers for (c, _, _), slope in zip(terms, slopes)))


def _column_names(pp: int, indicators: int) -> list[str]:
    """The program's columns, named for the PuLP model (and its LP file, when debugging)."""
    return ([f"layers_{s}" for s in range(pp)] + [f"recomputed_{s}" for s in range(pp)]
            + [f"recomputes_{i}" for i in range(indicators)] + ["slot", "dp_exposed", "update"])


@functools.cache
def _has_highspy() -> bool:
    """Whether highspy imports. A process's first `highspy.Highs()` prints HiGHS's banner on file
    descriptor 1, whatever its options (they are set after it exists), which would corrupt
    `advisor plan --json`: that first one is made here, with the descriptor pointed at /dev/null."""
    try:
        import highspy
    except ImportError:
        return False
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return True


@functools.cache
def _lp_solver():
    """One quiet, single-threaded HiGHS for the process's LP relaxations (each clears the last)."""
    import highspy

    solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    solver.setOptionValue("threads", 1)
    return solver


def _solver(integral: bool):
    """HiGHS in process (through highspy) where it imports; else the CBC binary PuLP bundles, one
    subprocess per solve (slower by the process and its files, same optimum)."""
    import pulp

    if _has_highspy():  # one thread: the same answer on every machine, and faster on these small programs
        return pulp.HiGHS(mip=integral, msg=False, gapRel=0.0, threads=1)
    with warnings.catch_warnings():  # PuLP 3.x warns that 4.0 drops the bundled CBC; pyproject keeps pulp < 4
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(mip=integral, msg=False, gapRel=0.0)


# ------------------------------------------------------------------------------------------
# the search


def _accept(estimate: Estimate, capacity: float, min_fraction: float) -> bool:
    return (estimate.memory.peak <= capacity * (1 + 1e-9) and estimate.memory.host_fits
            and estimate.compute_fraction >= min_fraction - 1e-9)


def bound_shapes(trace: ModelTrace, req: PlanRequest, method: str) -> tuple[int, list[tuple[Bound, Layout]]]:
    """All shapes of a method that can fit, with their bounds, best bound first."""
    capacity = req.hardware.usable_bytes * (1 - req.memory_margin)
    shapes = enumerate_shapes(trace, req, method)
    bounded = []
    for layout in shapes:
        bound = lower_bound(trace, layout, req.hardware, capacity)
        if bound is not None:
            bounded.append((bound, layout))
    bounded.sort(key=lambda item: item[0].step_s)
    return len(shapes), bounded


def search(req: PlanRequest, method: str, min_fraction: float, trace: ModelTrace | None = None,
           bounded: tuple[int, list[tuple[Bound, Layout]]] | None = None) -> SearchResult:
    """The K best layouts of one method under the cost model (exact, see the module docstring)."""
    started = time.perf_counter()
    trace = trace or trace_model(req.model, req.seq, req.dtype, method, req.lora_rank,  # type: ignore[arg-type]
                                 attention=req.attention, device_type=req.hardware.device_type, packed=req.packed)
    hw = req.hardware
    capacity = hw.usable_bytes * (1 - req.memory_margin)
    shapes, candidates = bounded or bound_shapes(trace, req, method)
    candidates = [(b, layout) for b, layout in candidates
                  if may_meet_compute_rule(b, layout, trace.num_layers, min_fraction)]

    found: list[Solution] = []
    seen: set[str] = set()
    ilps = 0
    # Best first over three bounds: a shape enters with its mean-stage bound; popped, it goes back with
    # its `spread_bound` where that is higher (cheap: most shapes of 80 layers on 32 stages then never
    # need an LP), then with its LP relaxation's; popped at that, its ILP is solved. Stops when the
    # K-th best plan found beats every bound left, so it solves no ILP the single-bound search would
    # have skipped. The spread bound lies below the LP's (with a margin for HiGHS's tolerances) and
    # the LP's key is the mean-stage and LP bounds alone, so ILPs are solved in the two-bound order.
    queue: list[tuple[float, int, int, StageProgram | None, Layout]] = [
        (b.step_s, i, 0, None, layout) for i, (b, layout) in enumerate(candidates)]  # sorted: a heap
    read = [b.coefficients for b, _ in candidates]
    while queue:
        bound, order, level, program, shape = heapq.heappop(queue)
        kth = sorted(s.step_s for s in found)[req.top_k - 1] if len(found) >= req.top_k else math.inf
        if bound >= kth:
            break
        if level == 0:
            read[order] = read[order] or _all_coefficients(trace, shape, hw)
            spread = spread_bound(read[order], shape, trace.num_layers, capacity) * (1 - SPREAD_SLACK)
            if spread > bound:
                heapq.heappush(queue, (spread, order, 1, None, shape))
                continue
        if program is None:
            program = StageProgram(read[order], shape, trace.num_layers, capacity, min_fraction)
            relaxed = program.relaxed_step_s()
            if relaxed < math.inf:  # the solver's tolerances: never let its bound pass the true one
                mean_bound = candidates[order][0].step_s
                heapq.heappush(queue, (max(mean_bound, relaxed * (1 - LP_BOUND_SLACK)), order, 2, program, shape))
            continue
        layout = program.solve(kth * (1 + LP_BOUND_SLACK))
        ilps += 1
        if layout is not None and layout.short() not in seen:
            est = estimate_from_trace(trace, layout, hw, req.space.engine)  # priced as the engine that runs it
            if _accept(est, capacity, min_fraction):  # always, when the ILP mirrors the cost model
                seen.add(layout.short())
                found.append(Solution(layout, est, est.time.step_s, est.compute_fraction >= req.min_compute_fraction))
    # exact ties (e.g. the same tokens in fewer, larger micro-batches) go to fewer micro-batches:
    # per-launch overheads the model may not know of only shrink with them
    found.sort(key=lambda s: (float(f"{s.step_s:.9g}"), s.layout.gas))
    status = "optimal" if found else "infeasible"
    return SearchResult(found[: req.top_k], status, time.perf_counter() - started, shapes, ilps, False)


def plan_layouts(req: PlanRequest) -> tuple[SearchResult, str]:
    """Search each allowed method in preference order (full before LoRA before QLoRA: the
    cheaper method trades model quality); relax the compute rule only when nothing meets it."""
    last: SearchResult | None = None
    for method in req.space.methods:
        if method == "qlora" and req.dtype == "fp32":
            req = replace(req, dtype="bf16")  # the 4-bit base computes in bf16 (an fp32 QLoRA layout is refused)
        if not may_have_shapes(req, method):  # no layout splits it: the answer without a trace
            last = SearchResult([], "infeasible", 0.0, 0, 0, False)
            continue
        trace = trace_model(req.model, req.seq, req.dtype, method, req.lora_rank,  # type: ignore[arg-type]
                            attention=req.attention, device_type=req.hardware.device_type, packed=req.packed)
        bounded = bound_shapes(trace, req, method)  # shared by the strict and the relaxed search
        result = search(req, method, req.min_compute_fraction, trace, bounded)
        if result.solutions:
            return result, method
        relaxed = search(req, method, 0.0, trace, bounded)
        if relaxed.solutions:
            relaxed.relaxed_compute_rule = True
            relaxed.status = "below_compute_rule"
            return relaxed, method
        last = relaxed
    assert last is not None
    return last, req.space.methods[-1]


def validate_request(req: PlanRequest) -> None:
    if req.devices < 1:
        raise UsageError("need at least one device")
    if req.global_batch < 1:
        raise UsageError("--global-batch must be positive")
    if not 0 <= req.min_compute_fraction <= 1:
        raise UsageError("--min-compute-fraction must lie in [0, 1]")



