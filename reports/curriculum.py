"""`advisor curriculum compare`: does splitting the objective pay on this task?

Trains a small proxy under each curriculum variant (reports/curriculum_variants.py) at equal tokens,
for several seeds, through the trainer's own entries (`trainer.prepare.prepare_run`, then
`trainer.launch.run`, as `advisor train` runs them), and scores every run on each skill's held-out
data at its end: eval loss (the trainer's stage-end evaluation) and, where the trainer's evaluation
gives it, exact match. Across seeds it reports the mean and the spread of each, and recommends a
variant only when its advantage exceeds the spread (`recommend`). From the staged runs' stage-end
evaluations it measures forgetting and recovery.

Spread: the sample standard deviation over seeds (ddof=1).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from specs.errors import UsageError
from specs.model_depth import first_layers, layer_count_key
from specs.plan_file import Plan, load_plan
from specs.run_dir import DATA_CACHE_DIR, METRICS_FILE, PLAN_FILE, SUMMARY_FILE, read_json_lines
from specs.core import HardwareSpec, ModelSpec
from specs.task import TaskSpec
from planner.plan import PlanOptions, make_plan
from planner.search import SearchSpace
from reports.curriculum_variants import VARIANTS, mixed_stage, scaled, skills, variant_tasks
from trainer.run_lock import die_with_parent

# The rate grid: every variant is tried at these factors of the task's rate and keeps its best, so
# that no variant loses to a rate that suits another (the schedule is WSD for all: curriculum_variants)
LR_FACTORS = (0.5, 1.0, 2.0)
SCHEDULE_PROTOCOL = ("WSD for every variant (one warm-up, every stage at one peak rate, one linear decay over the "
                     "run's last wsd_decay_fraction of steps); the peak rate tuned per variant on seed 0 over the "
                     "same grid (lowest final mean eval loss), the other seeds at the rate chosen; the spike guard "
                     "rolls back non-finite steps only, so every variant trains every step of its schedule")
SUMMARY_METRIC = "mean eval loss over the skills"
MAX_MICRO_BATCH = 4  # one process on a CPU: micro-batches of 4 step faster than one of 16 (bench/curriculum.py)


# --- the proxy model ------------------------------------------------------------------------------


def proxy_model(model: ModelSpec, hidden: int | None = None, layers: int | None = None) -> ModelSpec:
    """`model` scaled down: `hidden` width (heads keep their size, the MLP its ratio) and `layers`
    blocks. Vocabulary and positions stay: the task's tokenizer and sequence length still apply."""
    if hidden is None and layers is None:
        return model
    config = first_layers(model.hf_config, layers) if layers is not None else dict(model.hf_config)
    if hidden is not None:
        old = int(config["hidden_size"])
        heads = int(config.get("num_attention_heads", 1))
        head_dim = old // heads
        if hidden % head_dim:
            raise UsageError(f"--hidden {hidden}: must be a multiple of {model.name}'s head size {head_dim}")
        new_heads = hidden // head_dim
        kv = int(config.get("num_key_value_heads", heads))
        group = max(1, heads // kv)  # queries per KV head, kept where it divides
        config.update(hidden_size=hidden, num_attention_heads=new_heads,
                      num_key_value_heads=new_heads // group if new_heads % group == 0 else new_heads)
        if "intermediate_size" in config:
            config["intermediate_size"] = max(8, round(int(config["intermediate_size"]) * hidden / old / 8) * 8)
    name = f"{model.name}-proxy-h{config.get('hidden_size')}-l{config.get(layer_count_key(config))}"
    return model.model_copy(update={"name": name, "hf_config": config})


# --- one run --------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One (variant, seed) run: each stage's end evaluation, and the final scores per skill."""

    variant: str
    seed: int
    stage_evals: list[dict[str, Any]]  # [{"name", "eval": {skill: loss}, "exact_match": {skill: acc}?}]
    tokens: int
    wall_s: float
    train_loss_tenths: list[float] = field(default_factory=list)
    lr: float = math.nan  # the peak rate it ran at

    def final(self, metric: str) -> dict[str, float]:
        return dict(self.stage_evals[-1].get(metric) or {}) if self.stage_evals else {}


def plan_variant(task: TaskSpec, model: ModelSpec, hardware: HardwareSpec) -> Plan:
    """The variant's plan on one device (the proxy is small): the planner's fastest layout."""
    space = SearchSpace(tp_degrees=(1,), pp_degrees=(1,), max_micro_batch=MAX_MICRO_BATCH)
    return make_plan(PlanOptions(model=model, hardware=hardware, gpus_per_node=1, task=task, space=space))


def train_run(plan: Plan, run_dir: Path, seed: int, eval_sequences: int, cache: Path | None) -> float:
    """Train `plan` into `run_dir` through the trainer's entry; the wall time. The runs of a
    comparison share one tokenized-data cache (the trainer keys it by source, sequence and tokenizer)."""
    # deferred: the trainer imports torch (seconds), which the CLI's other verbs never need
    from trainer.launch import DEFAULT_PORT, run
    from trainer.options import TrainOptions
    from trainer.prepare import prepare_run
    from trainer.run_lock import RunDirLock

    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock.take(run_dir)  # one launch per run dir, as `advisor train` holds it
    try:
        if cache is not None and not (run_dir / DATA_CACHE_DIR).exists():
            cache.mkdir(parents=True, exist_ok=True)
            (run_dir / DATA_CACHE_DIR).symlink_to(cache.resolve(), target_is_directory=True)
        # the trainer's run-time preparation, as `advisor train` does it (the old run moved aside)
        plan = prepare_run(plan, run_dir, resumed=False, overwrite=True).plan
        plan.write(run_dir / PLAN_FILE)
        options = TrainOptions(seed=seed, eval_sequences=eval_sequences, show_progress=False, overwrite=True,
                               keep_checkpoints=1)
        started = time.perf_counter()
        run(plan, run_dir, False, options, None, 0, "127.0.0.1", DEFAULT_PORT)
        return time.perf_counter() - started
    finally:
        lock.release()


def plan_tokens(plan: Plan) -> int:
    return sum(s.steps * s.layout.tokens_per_step for s in plan.stages)


def read_run(run_dir: Path, variant: str, seed: int, wall_s: float, lr: float = math.nan) -> RunResult:
    """The run's stage-end scores from its summary.json (exact match where the trainer wrote it)."""
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    if not summary.get("finished", False):
        raise RuntimeError(f"{run_dir}: the run did not finish")
    stages = [{"name": s["name"], "eval": s.get("eval") or {}, **({"exact_match": s["exact_match"]}
                                                                  if s.get("exact_match") else {})}
              for s in summary["stages"]]
    tokens = plan_tokens(load_plan(run_dir / PLAN_FILE))
    metrics = read_json_lines(run_dir / METRICS_FILE).records
    return RunResult(variant, seed, stages, tokens, wall_s, train_loss_tenths(metrics), lr)


# --- statistics and the recommendation ------------------------------------------------------------


@dataclass
class Stat:
    mean: float
    spread: float  # sample standard deviation over seeds; nan with one seed
    n: int

    def as_dict(self) -> dict[str, float | int | None]:
        """JSON-ready: nan (no value, or no spread with one seed) as null."""
        return {"mean": _or_none(self.mean), "spread": _or_none(self.spread), "n": self.n}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Stat":
        return cls(_or_nan(raw["mean"]), _or_nan(raw["spread"]), raw["n"])


def _or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _or_nan(x: float | None) -> float:
    return math.nan if x is None else x


def stat(values: list[float]) -> Stat:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return Stat(math.nan, math.nan, 0)
    spread = statistics.stdev(values) if len(values) > 1 else math.nan
    return Stat(statistics.fmean(values), spread, len(values))


@dataclass
class Recommendation:
    """`winner` beats every other variant by more than the larger of the two spreads; else None and
    `tied` lists the variants the best one does not clearly beat (empty with one seed: no spread)."""

    winner: str | None
    best: str | None
    tied: list[str] = field(default_factory=list)
    text: str = ""


def recommend(stats: dict[str, Stat], lower_is_better: bool = True, metric: str = SUMMARY_METRIC) -> Recommendation:
    """Recommend the best variant by mean only where its advantage exceeds the seeds' spread: for
    every other variant V, |mean(best) - mean(V)| > max(spread(best), spread(V)). Otherwise the
    choice does not matter at this budget (among the best and the variants it does not clearly beat).
    A spread needs two seeds: with one, nothing is recommended."""
    scored = {name: s for name, s in stats.items() if s.n > 0 and math.isfinite(s.mean)}
    if not scored:
        return Recommendation(None, None, [], f"no variant has a {metric}")
    ordered = sorted(scored, key=lambda n: scored[n].mean if lower_is_better else -scored[n].mean)
    best = ordered[0]
    if any(s.n < 2 for s in scored.values()):
        return Recommendation(None, best, [], f"{best} has the best {metric}, but one seed gives no spread "
                              "to judge the difference against: run --seeds 2 or more")
    if len(ordered) == 1:
        return Recommendation(best, best, [], f"{best} is the only variant scored")
    tied = [n for n in ordered[1:]
            if abs(scored[n].mean - scored[best].mean) <= max(scored[best].spread, scored[n].spread)]
    if tied:
        return Recommendation(None, best, tied, f"the choice does not matter at this budget: {best} has the best "
                              f"{metric}, but {', '.join(tied)} {'is' if len(tied) == 1 else 'are'} within the seeds' "
                              "spread of it")
    runner_up = ordered[1]
    gap = abs(scored[runner_up].mean - scored[best].mean)
    margin = max(scored[best].spread, scored[runner_up].spread)
    return Recommendation(best, best, [], f"use {best}: its {metric} beats the runner-up {runner_up} by {gap:.3g}, "
                          f"more than the seeds' spread ({margin:.3g}), and every other variant by more")


# --- forgetting -----------------------------------------------------------------------------------


def forgetting(run: RunResult, skill: str, mixed: str | None) -> dict[str, float] | None:
    """A staged run's eval loss of `skill` at the end of its own stage (`own`), the worst at a later
    stage end before the last (`worst_between`), and at the end; forgetting = the worst later rise
    (end included) over `own`. When the run closes with the mixed stage `mixed`: recovered = the share
    of the rise before it that it took back. None when the skill's stage is the last."""
    names = [s["name"] for s in run.stage_evals]
    if skill not in names or names.index(skill) == len(names) - 1:
        return None
    own_index = names.index(skill)
    own, end = run.stage_evals[own_index]["eval"].get(skill), run.stage_evals[-1]["eval"].get(skill)
    between = [v for s in run.stage_evals[own_index + 1:-1] if (v := s["eval"].get(skill)) is not None]
    if own is None or end is None:
        return None
    worst_between = max(between) if between else math.nan
    out = {"own_stage_end": own, "worst_between": worst_between, "end": end,
           "forgetting": max([end, *between]) - own, "recovered": math.nan}
    if mixed is not None and names[-1] == mixed and between and worst_between > own:
        out["recovered"] = (worst_between - end) / (worst_between - own)
    return out


def train_loss_tenths(metrics: list[dict[str, Any]]) -> list[float]:
    """Mean training loss over each tenth of the run's steps: whether it has flattened."""
    losses = [m["loss"] for m in metrics if isinstance(m.get("loss"), (int, float))]
    if len(losses) < 10:
        return []
    bounds = [round(i * len(losses) / 10) for i in range(11)]
    return [statistics.fmean(losses[a:b]) for a, b in zip(bounds, bounds[1:])]


# --- the comparison -------------------------------------------------------------------------------


@dataclass
class CompareRequest:
    task: TaskSpec
    model: ModelSpec
    hardware: HardwareSpec
    out: Path
    seeds: int = 3
    variants: tuple[str, ...] = VARIANTS
    scale: float = 1.0
    eval_sequences: int = 16
    jobs: int = 1  # runs at a time
    gpus: int = 0  # with jobs > 1 and at least `jobs` GPUs, each worker gets its own
    # the peak rates each variant is tried at, as factors of the task's first stage's rate
    lr_factors: tuple[float, ...] = LR_FACTORS


@dataclass
class Progress:
    """What the caller shows: each run's start (its run dir and steps) and end."""

    started: Callable[[str, int, Path, int], None] = lambda variant, seed, run_dir, steps: None
    finished: Callable[[str, int, Path, int], None] = lambda variant, seed, run_dir, steps: None


Plans = dict[str, dict[float, Plan]]  # variant -> peak rate -> its plan


def lr_grid(req: CompareRequest) -> list[float]:
    """The peak rates every variant is tried at: the same grid for all."""
    if not req.lr_factors or any(not math.isfinite(f) or f <= 0 for f in req.lr_factors):
        raise UsageError("--lr-grid: give one or more positive factors of the task's rate, e.g. 0.5,1,2")
    base = req.task.stages[0].lr
    return sorted({base * f for f in req.lr_factors})


def plan_variants(req: CompareRequest) -> Plans:
    task = scaled(req.task, req.scale)
    plans: Plans = {}
    for lr in lr_grid(req):
        for name, spec in variant_tasks(task, req.variants, lr).items():
            plans.setdefault(name, {})[lr] = plan_variant(spec, req.model, req.hardware)
    return plans


def runs_per_variant(req: CompareRequest) -> int:
    """Seed 0 at every rate of the grid, then the other seeds at the variant's chosen rate."""
    return len(lr_grid(req)) + req.seeds - 1


def plan_steps(plan: Plan) -> int:
    return sum(s.steps for s in plan.stages)


def compare(req: CompareRequest, plans: Plans | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Tune each variant's peak rate on seed 0 over the grid, then train the other seeds at the rate
    chosen (`chosen_lrs`); score them; the comparison as a JSON-ready dict (`compare.json`, rewritten
    after every run with `complete: false` until the last one).

    `req.jobs` runs at a time, each in its own process (spawned: a fresh torch) with its share of the
    CPU cores, or, on a machine with GPUs, its own device."""
    if req.seeds < 1:
        raise UsageError("--seeds must be at least 1")
    progress = progress or Progress()
    plans = plans or plan_variants(req)
    total = len(plans) * runs_per_variant(req)
    runs: list[RunResult] = []
    _train_batch(req, plans, [(name, lr, 0) for name in plans for lr in plans[name]], progress, runs, total)
    chosen = chosen_lrs(runs, skills(scaled(req.task, req.scale)))
    _train_batch(req, plans, [(name, chosen[name], seed) for seed in range(1, req.seeds) for name in plans],
                 progress, runs, total)
    return {**summarise(req, plans, runs), "complete": True}


def run_dir_of(req: CompareRequest, variant: str, lr: float, seed: int) -> Path:
    return req.out / "runs" / variant / f"lr-{lr:g}" / f"seed-{seed}"


def _train_batch(req: CompareRequest, plans: Plans, todo: list[tuple[str, float, int]], progress: Progress,
                 runs: list[RunResult], total: int) -> None:
    """Train the (variant, rate, seed) runs of `todo`, appending each result to `runs` and rewriting
    the outputs after each."""
    jobs = [(plans[name][lr], run_dir_of(req, name, lr, seed), seed, req.eval_sequences, req.out / DATA_CACHE_DIR)
            for name, lr, seed in todo]

    def done(item: tuple[str, float, int], job: tuple, wall_s: float) -> None:
        name, lr, seed = item
        runs.append(read_run(job[1], name, seed, wall_s, lr))
        progress.finished(name, seed, job[1], plan_steps(job[0]))
        write_outputs({**summarise(req, plans, runs), "complete": len(runs) == total}, req.out)

    for item, job in zip(todo, jobs):
        progress.started(item[0], item[2], job[1], plan_steps(job[0]))
        if req.jobs == 1:
            done(item, job, train_run(*job))
    if req.jobs > 1 and jobs:
        for item, job, wall_s in zip(todo, jobs, _in_parallel(jobs, req.jobs, req.gpus)):
            done(item, job, wall_s)


def run_mean_loss(run: RunResult, scored: list[str]) -> float:
    """The run's final eval loss averaged over the skills (nan when one is missing)."""
    losses = run.final("eval")
    values = [losses.get(skill) for skill in scored]
    return statistics.fmean(values) if values and all(isinstance(v, (int, float)) for v in values) else math.nan


def chosen_lrs(runs: list[RunResult], scored: list[str]) -> dict[str, float]:
    """Each variant's peak rate: the one of its seed-0 runs with the lowest final mean eval loss over
    the skills (the summary metric; ties to the lower rate)."""
    chosen: dict[str, tuple[float, float]] = {}
    for run in sorted((r for r in runs if r.seed == 0), key=lambda r: r.lr):
        loss = run_mean_loss(run, scored)
        best = chosen.get(run.variant)
        if best is None or (math.isfinite(loss) and not loss >= best[1]):
            chosen[run.variant] = (run.lr, loss)
    return {name: lr for name, (lr, _) in chosen.items()}


def _in_parallel(jobs: list[tuple], workers: int, gpus: int, work: Callable[..., Any] = train_run):
    """`work` (a run's training) over `jobs`, `workers` processes at a time; the results in the jobs'
    order. The workers die with this process: a stopped comparison leaves no training behind."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    devices = context.Queue()
    for index in range(workers):
        devices.put(index)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init,
                             initargs=(devices, workers, gpus, os.getpid())) as pool:
        futures = [pool.submit(work, *job) for job in jobs]
        for future in futures:
            yield future.result()


def _worker_init(devices, workers: int, gpus: int, parent: int) -> None:
    """A comparison worker: its own GPU where there are several, else its share of the CPU cores
    (oversubscribed OpenMP threads run several times slower: docs/notes-cpu-stack.md)."""
    die_with_parent(parent)
    index = devices.get()
    if gpus >= workers:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def summarise(req: CompareRequest, plans: Plans, runs: list[RunResult]) -> dict[str, Any]:
    task = scaled(req.task, req.scale)
    scored = skills(task)
    mixed = mixed_stage(task)
    metrics = ["eval"] + (["exact_match"] if any(r.final("exact_match") for r in runs) else [])
    chosen = chosen_lrs(runs, scored)
    variants: dict[str, Any] = {}
    for name, by_lr in plans.items():
        # before its first run a variant stands at the task's own rate (or the grid's lowest)
        lr = chosen.get(name, task.stages[0].lr if task.stages[0].lr in by_lr else min(by_lr))
        mine = [r for r in runs if r.variant == name and r.lr == lr]
        entry = _variant_entry(by_lr[lr], mine, scored, metrics, mixed.name if mixed else None)
        entry["lr"] = {"chosen": lr, "grid": [{"lr": rate, "mean_eval_loss": _or_none(run_mean_loss(r, scored))}
                                              for rate in sorted(by_lr)
                                              for r in runs if r.variant == name and r.seed == 0 and r.lr == rate],
                       "at_grid_edge": len(by_lr) > 1 and lr in (min(by_lr), max(by_lr))}
        variants[name] = entry
    result = {"task": req.task.name, "model": req.model.name, "hf_config": req.model.hf_config,
              "seeds": req.seeds, "scale": req.scale, "eval_sequences": req.eval_sequences, "skills": scored,
              "mixed_stage": mixed.name if mixed else None,
              "spread": "sample standard deviation over seeds", "schedule": SCHEDULE_PROTOCOL,
              "lr_grid": sorted({lr for by_lr in plans.values() for lr in by_lr}), "runs_done": len(runs),
              "runs_total": len(plans) * runs_per_variant(req), "variants": variants}
    result["recommendation"] = recommendations(variants, scored, metrics)
    result["finding"] = one_pot_finding(variants, scored)
    return result


def _variant_entry(plan: Plan, mine: list[RunResult], scored: list[str], metrics: list[str],
                   mixed: str | None) -> dict[str, Any]:
    """One variant's scores over its seeds at its chosen rate: per skill and their mean, mean ± spread."""
    entry: dict[str, Any] = {"tokens": plan_tokens(plan), "wall_s": stat([r.wall_s for r in mine]).as_dict(),
                             "layouts": sorted({s.layout.short() for s in plan.stages})}
    for metric in metrics:
        # exact match is null for skills without answers (text rows): their mean leaves them out
        values = [{k: v for k, v in r.final(metric).items() if v is not None} for r in mine]
        counted = [k for k in scored if any(k in v for v in values)]
        per_skill = {skill: stat([v.get(skill) for v in values]).as_dict() for skill in scored}
        means = [statistics.fmean([v[k] for k in counted]) for v in values
                 if counted and all(k in v for k in counted)]
        entry[metric] = {"skills": per_skill, "mean": stat(means).as_dict()}
    entry["forgetting"] = {skill: _forgetting_stats(mine, skill, mixed) for skill in scored}
    entry["train_loss_tenths"] = [stat(list(xs)).as_dict() for xs in zip(*(r.train_loss_tenths for r in mine))]
    entry["runs"] = [{"seed": r.seed, "lr": r.lr, "stages": r.stage_evals, "wall_s": r.wall_s,
                      "train_loss_tenths": r.train_loss_tenths} for r in mine]
    return entry


def _forgetting_stats(runs: list[RunResult], skill: str, mixed: str | None) -> dict[str, Any] | None:
    found = [f for f in (forgetting(r, skill, mixed) for r in runs) if f is not None]
    if not found:
        return None
    return {key: stat([f[key] for f in found]).as_dict() for key in found[0]}


def _stats(variants: dict[str, Any], metric: str, skill: str | None) -> dict[str, Stat]:
    out = {}
    for name, entry in variants.items():
        raw = entry[metric]["mean"] if skill is None else entry[metric]["skills"][skill]
        out[name] = Stat.from_dict(raw)
    return out


def recommendations(variants: dict[str, Any], scored: list[str], metrics: list[str]) -> dict[str, Any]:
    """The overall recommendation (summary metric: mean eval loss over skills) and each skill's winner."""
    overall = recommend(_stats(variants, "eval", None))
    out: dict[str, Any] = {"metric": SUMMARY_METRIC, "rule": "recommend the best mean only when it beats every "
                           "other variant by more than the larger of the two spreads",
                           "winner": overall.winner, "best": overall.best, "tied": overall.tied, "text": overall.text,
                           "per_skill": {}}
    for metric in metrics:
        for skill in scored:
            rec = recommend(_stats(variants, metric, skill), lower_is_better=metric == "eval",
                            metric=f"{skill} {'eval loss' if metric == 'eval' else 'exact match'}")
            out["per_skill"].setdefault(metric, {})[skill] = {"best": rec.best, "beats_spread": rec.winner is not None,
                                                              "tied": rec.tied}
    return out


def one_pot_finding(variants: dict[str, Any], scored: list[str]) -> str | None:
    """A measured sentence when no staged variant matches one-pot on every skill (eval loss: a
    staged mean at most one-pot's plus the larger spread counts as matching); None when one does, or
    when a variant has fewer than two seeds."""
    if "one-pot" not in variants or len(variants) < 2:
        return None
    pot = variants["one-pot"]["eval"]["skills"]
    if any(e["eval"]["skills"][k]["n"] < 2 for e in variants.values() for k in scored):
        return None  # a variant without two seeds has no spread to judge by (or is not scored yet)
    matching = []
    for name, entry in variants.items():
        if name == "one-pot":
            continue
        mine = entry["eval"]["skills"]
        if all(mine[k]["mean"] <= pot[k]["mean"] + max(_finite(mine[k]["spread"]), _finite(pot[k]["spread"]))
               for k in scored):
            matching.append(name)
    if matching:
        return None
    return ("no staged curriculum matched one-pot training on every skill at equal tokens "
            f"(eval loss, {', '.join(scored)}; mean over seeds within the seeds' spread)")


def _finite(x: float) -> float:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else 0.0


# --- what it writes -------------------------------------------------------------------------------


def mean_spread(raw: dict[str, Any] | None, digits: int = 3) -> str:
    if not raw or not raw.get("n"):
        return "-"
    spread = raw["spread"]
    return f"{raw['mean']:.{digits}f}" + (f" ± {spread:.{digits}f}" if spread is not None else "")


def table_markdown(result: dict[str, Any]) -> str:
    """One row per variant: each skill's final eval loss (and exact match), mean ± spread over seeds."""
    scored = result["skills"]
    has_em = any("exact_match" in v for v in result["variants"].values())
    head = [f"{s} loss" for s in scored] + ["mean loss"] + ([f"{s} exact match" for s in scored] if has_em else [])
    rows = ["| variant | tokens | peak lr | " + " | ".join(head) + " |", "|---|---:|---:|" + "---:|" * len(head)]
    for name, entry in result["variants"].items():
        cells = [mean_spread(entry["eval"]["skills"][s]) for s in scored] + [mean_spread(entry["eval"]["mean"])]
        if has_em:
            em = entry.get("exact_match", {}).get("skills", {})
            cells += [mean_spread(em.get(s)) for s in scored]
        rows.append(f"| {name} | {entry['tokens']:,} | {chosen_lr_text(entry)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def chosen_lr_text(entry: dict[str, Any]) -> str:
    """The variant's peak rate, marked (edge) when it is the grid's lowest or highest: a better one may
    lie beyond the grid."""
    lr = entry.get("lr") or {}
    if "chosen" not in lr:
        return "-"
    return f"{lr['chosen']:.3g}" + (" (edge)" if lr.get("at_grid_edge") else "")


def tuning_markdown(result: dict[str, Any]) -> str:
    """Seed 0's final mean eval loss per variant at every peak rate of the grid."""
    grid = result.get("lr_grid") or []
    if len(grid) < 2:
        return ""
    rows = ["| variant | " + " | ".join(f"lr {lr:.3g}" for lr in grid) + " | chosen |", "|---|" + "---:|" * (len(grid) + 1)]
    for name, entry in result["variants"].items():
        loss = {point["lr"]: point["mean_eval_loss"] for point in entry.get("lr", {}).get("grid", [])}
        cells = [f"{loss[lr]:.3f}" if loss.get(lr) is not None else "-" for lr in grid]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {chosen_lr_text(entry)} |")
    return "\n".join(rows)


def forgetting_markdown(result: dict[str, Any]) -> str:
    """Per staged variant and skill: loss at its own stage's end, worst later, end; how much came back."""
    rows = ["| variant | skill | after its stage | worst before the last stage | end | forgetting | recovered |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for name, entry in result["variants"].items():
        if name == "one-pot":
            continue
        for skill, f in entry["forgetting"].items():
            if not f:
                continue
            rec = _or_nan(f["recovered"]["mean"])
            rows.append(f"| {name} | {skill} | {mean_spread(f['own_stage_end'])} | {mean_spread(f['worst_between'])} | "
                        f"{mean_spread(f['end'])} | {mean_spread(f['forgetting'])} | "
                        f"{f'{100 * rec:.0f}%' if math.isfinite(rec) else '-'} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def winners_text(result: dict[str, Any]) -> str:
    """Which variant wins each skill, and whether that beats the seeds' spread."""
    parts = []
    for metric, per_skill in result["recommendation"]["per_skill"].items():
        label = "eval loss" if metric == "eval" else "exact match"
        for skill, rec in per_skill.items():
            if rec["best"] is None:
                continue
            verdict = "beyond the seeds' spread" if rec["beats_spread"] else \
                f"within the spread of {', '.join(rec['tied'])}" if rec["tied"] else "one seed: no spread"
            parts.append(f"{skill} ({label}): {rec['best']}, {verdict}")
    return "; ".join(parts)


def write_outputs(result: dict[str, Any], out: Path) -> list[Path]:
    """compare.json, compare.md (tables and the verdict) and compare.png in `out`."""
    from reports.charts import variant_chart  # deferred: matplotlib, only when the results are written

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "compare.json", out / "compare.md", out / "compare.png"]
    paths[0].write_text(json.dumps(result, indent=2))
    forgot, tuning = forgetting_markdown(result), tuning_markdown(result)
    partial = [] if result.get("complete", True) else [f"**Partial**: {result.get('runs_done')} of "
                                                       f"{result.get('runs_total')} runs done.", ""]
    body = [f"# Curriculum comparison: {result['task']} ({result['model']}, {result['seeds']} seeds)", "", *partial,
            "Final eval loss per skill (lower is better), mean ± spread (sample standard deviation over seeds).", "",
            table_markdown(result), "", f"Schedule: {result.get('schedule', SCHEDULE_PROTOCOL)}.", "",
            *(["Peak rate tuning (seed 0, final mean eval loss):", "", tuning, ""] if tuning else []),
            f"**Recommendation** ({result['recommendation']['rule']}): "
            f"{result['recommendation']['text']}.", "", f"Per skill: {winners_text(result)}."]
    if forgot:
        body += ["", "Forgetting and recovery (staged variants):", "", forgot]
    if result.get("finding"):
        body += ["", f"Finding: {result['finding']}."]
    paths[1].write_text("\n".join(body) + "\n")
    labels = list(result["variants"])
    values = {(v, s): (_or_nan(e["eval"]["skills"][s]["mean"]), _finite(e["eval"]["skills"][s]["spread"]))
              for v, e in result["variants"].items() for s in result["skills"]}
    paths[2].write_bytes(variant_chart(labels, result["skills"], values))
    return paths
