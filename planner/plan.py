"""`advisor plan`: from model, hardware and task to a ranked, explained plan (or the nearest fixes).

Objectives: `throughput` (the fastest layout on the given devices) and `cost` (the fewest
GPU-hours over device counts up to the given ones that still meet a deadline).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

from specs.capabilities import PRICED_ENGINE_LIMITS, attention_implementation, config_shape, cost_engine, runnable_problem, prices_ours
from specs.errors import UsageError
from specs.plan_file import (DEFAULT_CHECKPOINT_WRITE_GBS, DEFAULT_MTBF_HOURS, Plan, PlanAssumptions, PlannedLayout,
                             StagePlan)
from specs.profile import ClusterProfile
from specs.core import (MAX_BATCH, MEMORY_MARGIN, MIN_COMPUTE_FRACTION, Estimate, GiB, HardwareSpec, Layout, ModelSpec,
                        check_number, check_seq_fits)
from specs.task import TaskSpec
from planner.explain import preset_note, why
from planner.fix import REQUEST_KEYS, check_fix, describe
from planner.granularity import restage
from planner.memory import HOST_MEMORY_USABLE
from planner.search import (DEFAULT_LORA_RANK, PlanRequest, SearchResult, SearchSpace, Solution, plan_layouts,
                             validate_request)
from planner.stragglers import pricing_note, priced_without, straggler_candidates
from planner.time_to_train import RESTART_S, checkpoint_write_s, time_to_train
from presets import task_finding

METHOD_ORDER = ("full", "lora", "qlora")


class InfeasiblePlan(UsageError):
    """Nothing fits: `why`, and the nearest feasible changes (`fixes`), which the message lists one
    per line under `heading`; callers read the fields, never the message."""

    multiline = True

    def __init__(self, why: str, fixes: list[str] | None = None, heading: str = "Nearest feasible changes:",
                 none_found: str = "") -> None:
        self.why, self.fixes = why, list(fixes or [])
        lines = [f"  - {fix}" for fix in self.fixes] or ([f"  - {none_found}"] if none_found else [])
        super().__init__("\n".join([why, heading, *lines]) if lines else why)


@dataclass
class PlanOptions:
    model: ModelSpec
    hardware: HardwareSpec
    nodes: int = 1
    gpus_per_node: int | None = None
    task: TaskSpec | None = None
    # tokens per stage from `advisor data prepare`'s manifest, when one is there and fresh, and for stages
    # budgeted in epochs one pass over their raw data when it is readable (the caller reads them)
    stage_tokens: dict[str, int] | None = None
    seq: int | None = None
    global_batch: int | None = None
    method: str = "full"  # full | lora | qlora | auto
    lora_rank: int | None = None  # LoRA/QLoRA adapters' rank (None: the Layout's default)
    objective: str = "throughput"
    deadline_s: float | None = None
    tokens: float | None = None
    price_per_gpu_hour: float | None = None
    min_compute_fraction: float = MIN_COMPUTE_FRACTION
    top_k: int = 5
    mtbf_hours: float = DEFAULT_MTBF_HOURS  # per node (specs.plan_file PlanAssumptions)
    checkpoint_write_gbs: float = DEFAULT_CHECKPOINT_WRITE_GBS  # per node, to the checkpoint file system
    restart_s: float = RESTART_S  # per failure
    per_stage_devices: bool = False
    memory_margin: float = MEMORY_MARGIN
    allow_cross_node_tp: bool = False
    attention: str | None = None
    dtype: str | None = None
    space: SearchSpace = field(default_factory=SearchSpace)
    # `--fix`: layout keys held fixed (specs.core.parse_layout_string's values; planner/fix.py)
    fix: dict[str, Any] = field(default_factory=dict)
    # `--any-engine`: plan over everything the cost model prices, not only what `advisor train` runs
    any_engine: bool = False
    # `--engine`: whose behaviour is priced (specs.capabilities PRICED_ENGINES); a published engine
    # plans as --any-engine does, every layout priced as that engine runs it
    priced_engine: str = "ours"
    # a cluster profile's per-device and per-link figures (the hardware prices its slowest), and the
    # devices (n1d0) or nodes (n1) `--exclude` leaves out of that pricing (planner/stragglers.py)
    cluster: ClusterProfile | None = None
    exclude: list[str] = field(default_factory=list)


def parse_duration(text: str, flag: str = "--deadline") -> float:
    """'14d', '36h', '90m', '3600s', '1.5d' or plain seconds; positive and finite."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([dhms]?)\s*", text)
    if not match:
        raise UsageError(f"{flag}: cannot read duration '{text}': use e.g. 14d, 36h or 90m")
    value = float(match.group(1)) * {"d": 86400, "h": 3600, "m": 60, "s": 1}[match.group(2) or "s"]
    if not 0 < value < math.inf:
        raise UsageError(f"{flag} '{text}': must be more than zero and finite")
    return value


def check_plan_numbers(opts: PlanOptions) -> None:
    """The command line's numbers (a task's and a plan file's are validated as they load): finite and
    in range, and a sequence the model's position embeddings cover (the default one is not checked:
    the search keeps to what fits)."""
    check_number(opts.tokens, "--tokens", gt=0)
    check_number(opts.price_per_gpu_hour, "--price-per-gpu-hour", ge=0)
    check_number(opts.mtbf_hours, "--mtbf-hours", gt=0)
    check_number(opts.min_compute_fraction, "--min-compute-fraction", ge=0, le=1)
    check_number(opts.deadline_s, "--deadline", gt=0)
    if opts.seq:
        check_seq_fits(opts.model, opts.seq)
    elif opts.task is not None and "seq_len" in opts.task.model_fields_set:
        check_seq_fits(opts.model, opts.task.seq_len, f"task {opts.task.name} seq_len")
    for stage in opts.task.stages if opts.task is not None else []:
        if stage.seq_len:
            check_seq_fits(opts.model, stage.seq_len, f"task {opts.task.name} stage '{stage.name}' seq_len")


def stage_global_batch(batch: int, seq: int, stage_seq: int) -> int:
    """A stage with its own sequence length keeps the plan's tokens per step (batch x seq): its
    global batch in sequences scales inversely, so a token budget takes the same steps and the
    learning-rate schedule (in steps) keeps its shape; rounded to whole sequences, at least one.
    (Holding sequences instead would change the tokens per step by the length ratio.)"""
    return max(1, round(batch * seq / stage_seq))


def _shape(opts: PlanOptions, devices: int) -> tuple[int, int]:
    """The chosen layout's sequence and global batch: the command line's, else the task's (when every
    stage sets the same other sequence length, that one at the same tokens per step), else defaults."""
    seq = opts.seq or (opts.task.seq_len if opts.task else 2048)
    batch = opts.global_batch or (opts.task.global_batch if opts.task and opts.task.global_batch else None) \
        or default_global_batch(devices, seq)
    if opts.task is None or opts.seq:
        return seq, batch
    seqs = {opts.task.stage_seq(stage) for stage in opts.task.stages}
    if len(seqs) == 1 and seq not in seqs:
        only = seqs.pop()
        return only, stage_global_batch(batch, seq, only)
    return seq, batch


def _check_batch_fits_a_layout(opts: PlanOptions, devices: int, batch: int) -> None:
    """One line where no layout can hold the global batch: every device's micro-batches of at most
    `max_micro_batch` sequences, at most MAX_BATCH of them per step (the spec's bound)."""
    most = devices * opts.space.max_micro_batch * MAX_BATCH
    if batch > most:
        raise UsageError(f"global batch {batch:,} needs more than {MAX_BATCH:,} accumulation steps of "
                         f"{opts.space.max_micro_batch} sequences on each of {devices:,} devices: give a smaller "
                         "--global-batch or more devices")


def default_global_batch(devices: int, seq: int) -> int:
    """About 2M tokens per step (the Llama and GPT-3 recipes' order), at least one sequence per
    device, a power of two so that most data-parallel degrees divide it."""
    return max(2 ** round(math.log2(max(1, 2**21 / seq))), 2 ** math.ceil(math.log2(devices)))


def _request(opts: PlanOptions, devices: int, seq: int, batch: int, methods: tuple[str, ...],
             hardware: HardwareSpec) -> PlanRequest:
    space = SearchSpace(**{**opts.space.__dict__, "methods": methods,
                           "allow_cross_node_tp": opts.allow_cross_node_tp,
                           "fixed": {**opts.space.fixed, **_shape_fix(opts)},
                           "engine": cost_engine(opts.priced_engine, opts.space.engine),
                           "runnable_only": _runnable_only(opts), **PRICED_ENGINE_LIMITS.get(opts.priced_engine, {})})
    dtype = opts.dtype or hardware.default_dtype
    req = PlanRequest(model=opts.model, hardware=hardware, devices=devices, seq=seq, global_batch=batch,
                      dtype=dtype, space=space, min_compute_fraction=opts.min_compute_fraction,
                      memory_margin=opts.memory_margin, top_k=opts.top_k, attention=opts.attention,
                      lora_rank=opts.lora_rank or DEFAULT_LORA_RANK,
                      packed=True)  # the trainer packs documents into rows (trainer/stream.py), padding as one
    validate_request(req)
    return req


def _runnable_only(opts: PlanOptions) -> bool:
    """Whether the search keeps to what `advisor train` runs: not with --any-engine, nor when a
    published engine is priced (`--engine megatron`)."""
    return opts.space.runnable_only and not opts.any_engine and prices_ours(opts.priced_engine)


def _shape_fix(opts: PlanOptions) -> dict[str, Any]:
    """The fixed keys the search enumerates (the others became the request's own: `_with_fix`)."""
    return {key: value for key, value in opts.fix.items() if key not in REQUEST_KEYS}


def _with_fix(opts: PlanOptions) -> PlanOptions:
    """The options with fixed method, dtype and sequence length as the request's, unless the command
    line asks for another (a copy: the caller's options stay as given)."""
    fixed = {}
    for key, attr, flag in (("method", "method", "--method"), ("dtype", "dtype", "dtype"), ("seq", "seq", "--seq-len")):
        if key not in opts.fix:
            continue
        given = getattr(opts, attr)
        if given not in (None, opts.fix[key]) and not (key == "method" and given == "full"):
            raise UsageError(f"--fix {key}={opts.fix[key]} contradicts {flag} {given}")
        fixed[attr] = opts.fix[key]
    return replace(opts, **fixed)


def _check_fix(opts: PlanOptions, devices: int, hw: HardwareSpec, seq: int, batch: int,
               methods: tuple[str, ...]) -> None:
    """Refuse a fix the trainer cannot run (or, with --any-engine, that no layout has), with the reason."""
    if opts.fix:
        runnable = _runnable_only(opts)
        check_fix(opts.fix, model=opts.model, devices=devices, devices_per_node=hw.devices_per_node,
                  global_batch=batch, method=methods[0], dtype=opts.dtype or hw.default_dtype, seq=seq,
                  device_type=hw.device_type, engine=opts.space.engine, runnable_only=runnable,
                  allow_cross_node_tp=opts.allow_cross_node_tp)


def _methods(opts: PlanOptions) -> tuple[str, ...]:
    if opts.method == "auto":
        return METHOD_ORDER
    if opts.method not in METHOD_ORDER:
        raise UsageError(f"--method must be one of auto, {', '.join(METHOD_ORDER)} (got {opts.method})")
    if opts.lora_rank is not None and opts.method == "full":
        raise UsageError("--lora-rank sets LoRA adapters; --method full trains every weight (plan --method lora, "
                         "qlora or auto)")
    if opts.method == "qlora" and opts.dtype == "fp32":
        raise UsageError("--method qlora computes in bf16 over its 4-bit base: drop --dtype fp32")
    return (opts.method,)


def _planned(result: SearchResult, capacity: float, min_fraction: float) -> list[PlannedLayout]:
    out = []
    best = None
    for sol in result.solutions:
        out.append(PlannedLayout(layout=sol.layout, estimate=sol.estimate,
                                 why=why(sol.layout, sol.estimate, capacity, min_fraction, best),
                                 meets_compute_rule=sol.meets_compute_rule))
        best = best or (sol.layout, sol.estimate)
    return out


def _suggestions(opts: PlanOptions, devices: int, seq: int, batch: int, methods: tuple[str, ...]) -> list[str]:
    """The nearest changes that make the request feasible, each checked with the planner."""
    hw = opts.hardware
    found = []
    for method in METHOD_ORDER:
        if method in methods:
            continue
        result, _ = plan_layouts(_request(opts, devices, seq, batch, (method,), hw))
        if result.solutions:
            sol = result.solutions[0]
            found.append(f"--method {method}: fits ({sol.layout.short()}, peak "
                         f"{sol.estimate.memory.peak / GiB:.1f} GiB)")
    roomy = hw.model_copy(update={"host_memory_gib": 1e6})
    result, _ = plan_layouts(_request(opts, devices, seq, batch, methods, roomy))
    if result.solutions:
        sol = result.solutions[0]
        sharing = min(devices, hw.devices_per_node)
        need = sol.estimate.memory.host_offload * sharing / HOST_MEMORY_USABLE / GiB
        found.append(f"offload with >= {need:,.0f} GiB host RAM per node (this node has {hw.host_memory_gib:,.0f}): "
                     f"{sol.layout.short()}")
    for factor in (2, 4, 8, 16, 32, 64):
        more = devices * factor
        nodes = math.ceil(more / hw.devices_per_node)
        result, _ = plan_layouts(_request(opts, more, seq, max(batch, more), methods, hw))
        if result.solutions:
            found.append(f"{more} x {hw.name} ({nodes} node{'s' if nodes > 1 else ''}) fit the same method "
                         f"({result.solutions[0].layout.short()})")
            break
    shorter = seq // 2
    while shorter >= 256:
        result, _ = plan_layouts(_request(opts, devices, shorter, batch, methods, hw))
        if result.solutions:
            found.append(f"--seq-len {shorter} fits ({result.solutions[0].layout.short()})")
            break
        shorter //= 2
    return found


def _device_options(opts: PlanOptions, per_node: int) -> list[int]:
    """Device counts the cost objective compares: powers of two within a node, then whole nodes."""
    counts = [2**i for i in range(int(math.log2(per_node)) + 1) if 2**i <= per_node] if per_node else []
    nodes = 2
    while nodes <= opts.nodes:
        counts.append(nodes * per_node)
        nodes *= 2
    if opts.nodes * per_node not in counts:
        counts.append(opts.nodes * per_node)
    return sorted(set(counts))


def _total_tokens(opts: PlanOptions, tokens_per_step: int) -> float:
    if opts.tokens:
        return opts.tokens
    if opts.task:
        one_pass = opts.stage_tokens or {}  # an epochs budget: its passes over the data counted for it
        return float(sum(opts.task.stage_tokens(s, tokens_per_step) or (s.epochs or 0) * one_pass.get(s.name, 0)
                         for s in opts.task.stages))
    raise UsageError("--objective cost needs the work to do: --task task.yaml or --tokens N")


def _time_to_train(opts: PlanOptions, sol: Solution, nodes: int) -> float:
    """Wall-clock seconds of the whole job on this layout: training, checkpoints, expected failures."""
    train_s = _total_tokens(opts, sol.layout.tokens_per_step) / sol.estimate.throughput.tokens_per_s
    write_s = checkpoint_write_s(sol.estimate, sol.layout, nodes, opts.checkpoint_write_gbs)
    return time_to_train(train_s, write_s, nodes, opts.mtbf_hours, opts.restart_s).wall_s


def _with_prepared_tokens(task: TaskSpec, counts: dict[str, int] | None, notes: list[str]) -> TaskSpec:
    """Stage budgets from `advisor data prepare`'s manifest: the prepared data (after dedup and
    filters) is what the stages will actually read. A stage budgeted in epochs keeps its budget
    (the trainer sizes it from the data it reads); `plan_stage` sizes it from the same counts."""
    if not counts:
        return task
    stages = [s.model_copy(update={"tokens": counts[s.name], "steps": None})
              if s.name in counts and s.epochs is None else s for s in task.stages]
    notes.append("stage token budgets from the prepared data's manifest: "
                 + ", ".join(f"{name} {tokens:,}" for name, tokens in counts.items()))
    return task.model_copy(update={"stages": stages})


def _assumed_network(hw: HardwareSpec, nodes: int) -> list[str]:
    """A note when a plan spans nodes on inter-node figures that were assumed, not measured."""
    assumed = {key: where for key, where in hw.assumed.items() if key.startswith("inter_node")}
    if nodes <= 1 or not assumed:
        return []
    return ["this plan spans nodes, but the profile's inter-node figures are assumed, not measured: "
            + "; ".join(f"{key} {getattr(hw, key):g} ({where})" for key, where in assumed.items())]


def _priced_cluster(opts: PlanOptions, hw: HardwareSpec, notes: list[str]) -> HardwareSpec:
    """The hardware at the slowest device and link the plan runs on (the profile's own pricing,
    or, with --exclude, without the members it names)."""
    if opts.cluster is None or len(opts.cluster.devices) < 2:
        if opts.exclude:
            raise UsageError("--exclude needs --hardware to be a profile of several devices (advisor profile)")
        return hw
    if opts.exclude or opts.cluster.stragglers or len(opts.cluster.nodes) > 1:
        notes.append(pricing_note(opts.cluster, opts.exclude, opts.dtype or hw.default_dtype))
    return priced_without(hw, opts.cluster, opts.exclude)


def _straggler_gains(opts: PlanOptions, measured_hw: HardwareSpec, chosen: PlannedLayout, seq: int, batch: int,
                     methods: tuple[str, ...]) -> list[str]:
    """What leaving out each remaining straggler would gain: the same devices, planned again with
    it replaced by one like the others."""
    if opts.cluster is None:
        return []
    notes = []
    base = chosen.estimate.throughput.tokens_per_s
    for name, straggler in straggler_candidates(opts.cluster, opts.exclude).items():
        hw = priced_without(measured_hw, opts.cluster, [*opts.exclude, name])
        result, _ = plan_layouts(_request(opts, chosen.layout.devices, seq, batch, methods, hw))
        if not result.solutions:
            continue
        faster = result.solutions[0].estimate.throughput.tokens_per_s
        notes.append(f"straggler {straggler.name} ({straggler.figure} {100 * straggler.slower_by:.0f}% below the "
                     f"median): --exclude {name} would give {faster:,.0f} instead of {base:,.0f} tokens/s "
                     f"({100 * (faster / base - 1):+.0f}%), if a device like the others takes its place")
    return notes


def make_plan(opts: PlanOptions) -> Plan:
    started = time.perf_counter()
    notes: list[str] = []
    if opts.task is not None:  # the caller's options stay as given: a copy carries what planning adds
        opts = replace(opts, task=_with_prepared_tokens(opts.task, opts.stage_tokens, notes))
        notes += [finding] if (finding := task_finding(opts.task.name)) else []
    hw = opts.hardware
    per_node = opts.gpus_per_node or hw.devices_per_node
    if opts.gpus_per_node:
        hw = hw.model_copy(update={"devices_per_node": opts.gpus_per_node})
    devices, measured_hw = opts.nodes * per_node, hw
    hw = _priced_cluster(opts, hw, notes)
    opts = _with_fix(opts)
    check_plan_numbers(opts)
    seq, batch = _shape(opts, devices)
    _check_batch_fits_a_layout(opts, devices, batch)
    methods = _methods(opts)
    _check_fix(opts, devices, hw, seq, batch, methods)
    capacity = hw.usable_bytes * (1 - opts.memory_margin)
    if opts.objective == "throughput":
        result, method = plan_layouts(_request(opts, devices, seq, batch, methods, hw))
        nodes = opts.nodes
    elif opts.objective == "cost":
        if not opts.deadline_s:
            raise UsageError("--objective cost needs --deadline (e.g. 14d)")
        best: tuple[float, SearchResult, str, int] | None = None
        for count in _device_options(opts, per_node):
            res, meth = plan_layouts(_request(opts, count, seq, max(batch, count), methods, hw))
            if not res.solutions:
                continue
            sol = res.solutions[0]
            wall_s = _time_to_train(opts, sol, math.ceil(count / per_node))
            if wall_s > opts.deadline_s:
                continue
            gpu_hours = wall_s / 3600 * count
            if best is None or gpu_hours < best[0]:
                best = (gpu_hours, res, meth, count)
        if best is None:
            raise InfeasiblePlan(f"no device count up to {devices} x {hw.name} finishes by the deadline "
                                 f"({opts.deadline_s / 86400:.1f} days); allow more nodes or a later deadline")
        gpu_hours, result, method, count = best
        nodes = math.ceil(count / per_node)
        cost = f", ${gpu_hours * opts.price_per_gpu_hour:,.0f}" if opts.price_per_gpu_hour else ""
        notes.append(f"cost objective: {count} devices need {gpu_hours:,.0f} GPU-hours{cost}, the fewest that "
                     f"meet the {opts.deadline_s / 86400:.1f}-day deadline")
    else:
        raise UsageError(f"--objective must be throughput or cost (got {opts.objective})")

    if not result.solutions and opts.fix:
        raise InfeasiblePlan(_fix_infeasible(opts, result, devices, hw, seq, batch, methods))
    if not result.solutions:
        raise _infeasible(opts, result, devices, hw, seq, batch, methods)
    if result.relaxed_compute_rule:
        notes.append(f"no layout keeps compute >= {100 * opts.min_compute_fraction:.0f}% of the step; these are "
                     "the fastest anyway (flagged): fewer devices or a larger global batch would meet the rule")
    if method != methods[0]:
        notes.append(f"method {method}: {', '.join(m for m in methods if m != method and METHOD_ORDER.index(m) < METHOD_ORDER.index(method))} does not fit")

    planned = _planned(result, capacity, opts.min_compute_fraction)
    notes += _assumed_network(hw, nodes) + _straggler_gains(opts, measured_hw, planned[0], seq, batch, methods)
    if opts.fix:
        notes.append(f"fixed by --fix: {describe(opts.fix)}")
    runnable_here = _runnable_only(opts)
    notes += _engine_notes(opts, planned, hw)
    notes += [note] if (note := preset_note(measured_hw)) else []
    plan = Plan(model=opts.model, hardware=hw, nodes=nodes, gpus_per_node=per_node, objective=opts.objective,  # type: ignore[arg-type]
                min_compute_fraction=opts.min_compute_fraction, chosen=planned[0], alternatives=planned[1:],
                task=opts.task, notes=notes, runnable_here=runnable_here, priced_engine=opts.priced_engine,
                attention=attention_implementation(hw.device_type),
                assumptions=PlanAssumptions(mtbf_hours=opts.mtbf_hours, checkpoint_write_gbs=opts.checkpoint_write_gbs,
                                            restart_s=opts.restart_s))
    if opts.task:
        plan.stages = _plan_stages(opts, plan, hw, seq, batch, nodes)
    plan.solver = {"status": result.status, "seconds": time.perf_counter() - started, "shapes": result.shapes,
                   "ilps": result.ilps, "search_seconds": result.seconds}
    return plan


def _fix_infeasible(opts: PlanOptions, result: SearchResult, devices: int, hw: HardwareSpec, seq: int, batch: int,
                    methods: tuple[str, ...]) -> str:
    """Why a runnable fix found no plan: no layout of the space holds it, or none fits memory; and
    whether the same request fits without the fix."""
    fix = describe(opts.fix)
    if not result.shapes:
        reason = f"no layout of {devices:,} x {hw.name} at global batch {batch:,} holds it ({_layout_rules(opts)})"
    else:
        reason = (f"does not fit memory: no layout with it fits {hw.name} ({opts.model.name}, method "
                  f"{'/'.join(methods)}, sequence length {seq}, global batch {batch})")
    free = PlanOptions(**{**opts.__dict__, "fix": {}})
    unfixed, _ = plan_layouts(_request(free, devices, seq, batch, methods, hw))
    hint = (f"; without --fix: {unfixed.solutions[0].layout.short()}" if unfixed.solutions
            else "; nor does any layout without it")
    return f"--fix {fix}: {reason}{hint}"


def _infeasible(opts: PlanOptions, result: SearchResult, devices: int, hw: HardwareSpec, seq: int, batch: int,
                methods: tuple[str, ...]) -> InfeasiblePlan:
    """No plan: no layout splits the request at all (the rules named), or none fits memory; with the
    nearest changes that would make it feasible."""
    why_not = (f"has no layout on {devices:,} x {hw.name} at global batch {batch:,}: {_layout_rules(opts)}."
               if not result.shapes else
               f"does not fit {devices} x {hw.name} at sequence length {seq} and global batch {batch}, even "
               "with ZeRO sharding, offload and full recomputation.")
    return InfeasiblePlan(f"{opts.model.name} with method {'/'.join(methods)} {why_not}",
                          _suggestions(opts, devices, seq, batch, methods), none_found="none found within 64x the devices")


def _layout_rules(opts: PlanOptions) -> str:
    """The divisibility rules every layout obeys, memory aside: why a request may have none."""
    return (f"tp divides the attention heads, pp is at most the layers, dp divides the batch, and a replica's "
            f"share is at most {MAX_BATCH:,} micro-batches of at most {opts.space.max_micro_batch}; vpp is at most "
            f"{opts.space.max_vpp}, and vpp>1 needs gas divisible by pp")


def _engine_notes(opts: PlanOptions, planned: list[PlannedLayout], hw: HardwareSpec) -> list[str]:
    """What a plan for another engine than `advisor train`'s says: which engine priced it, or, with
    --any-engine, whether the trainer runs its best layout."""
    if not prices_ours(opts.priced_engine):
        return [f"priced as {opts.priced_engine} runs it (--engine {opts.priced_engine}), for that engine; "
                "advisor train runs its own engines"]
    if _runnable_only(opts):
        return []
    reason = _not_runnable_reason(planned, opts, hw)
    return ["planned for any engine (--any-engine): " + (f"advisor train refuses it ({reason})" if reason
            else "its best layout happens to run here too")]


def _not_runnable_reason(planned: list[PlannedLayout], opts: PlanOptions, hw: HardwareSpec) -> str | None:
    """Why `advisor train` would refuse the plan's first layout (None: it would run it)."""
    return runnable_problem(planned[0].layout, config_shape(opts.model.hf_config), hw.device_type, opts.space.engine)


def _plan_stages(opts: PlanOptions, plan: Plan, hw: HardwareSpec, seq: int, batch: int, nodes: int) -> list[StagePlan]:
    """Steps and checkpoint cadence per stage; a stage with its own method or sequence length gets
    its own layout (at the plan's tokens per step: `stage_global_batch`), and, with
    --per-stage-devices, the device count that needs the fewest GPU-hours."""
    assert opts.task is not None
    chosen = plan.chosen
    stages = []
    for stage in opts.task.stages:
        layout, est = chosen.layout, chosen.estimate
        method = stage.method or layout.method
        stage_seq = stage.seq_len or seq
        if method != layout.method or stage_seq != seq or opts.per_stage_devices:
            stage_batch = stage_global_batch(batch, seq, stage_seq)
            if stage_batch * stage_seq != batch * seq:
                plan.notes.append(f"stage '{stage.name}': {stage_batch} sequences of {stage_seq} tokens per step, "
                                  f"{stage_batch * stage_seq:,} tokens against the plan's {batch * seq:,} (whole "
                                  "sequences)")
            layout, est = _stage_layout(opts, plan, hw, stage.name, method, stage_seq, stage_batch)
        stage_nodes = math.ceil(layout.devices / plan.gpus_per_node)
        stages.append(restage(plan, opts.task, stage, layout, est, stage_nodes,
                              one_pass_tokens=(opts.stage_tokens or {}).get(stage.name)))
    return stages


def _stage_layout(opts: PlanOptions, plan: Plan, hw: HardwareSpec, name: str, method: str, seq: int,
                  batch: int) -> tuple[Layout, Estimate]:
    """The fastest device count whose every device still computes >= the rule's share (the source
    article: small sub-tasks get fewer GPUs); failing that, the count that comes closest to the rule.
    Without --per-stage-devices, the plan's device count."""
    counts = _device_options(opts, plan.gpus_per_node) if opts.per_stage_devices else [plan.chosen.layout.devices]
    options = []
    for count in counts:
        res, _ = plan_layouts(_request(opts, count, seq, max(batch, count), (method,), hw))
        if res.solutions:
            options.append(res.solutions[0])
    if not options:
        raise InfeasiblePlan(f"stage '{name}' with method {method} and sequence length {seq} fits no device count")
    meeting = [o for o in options if o.meets_compute_rule]
    best = (max(meeting, key=lambda o: o.estimate.throughput.tokens_per_s) if meeting
            else max(options, key=lambda o: o.estimate.compute_fraction))
    return best.layout, best.estimate
