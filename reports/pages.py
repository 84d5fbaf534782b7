"""The two reports as documents: what a manager decides from (capacity) and what an engineer
checks after a run (run). Numbers come from `reports.capacity` and `reports.run_report`; this
module only lays them out."""

from __future__ import annotations

import math

from specs.capabilities import prices_ours
from specs.core import GiB
from reports import charts
from reports.capacity import (CHECKPOINT_WRITE_GBS, COST_SLACK, METHOD_WORDS, SCALING_EFFICIENCY_RULE,
                              SLOWER_THAN_MEGATRON, CapacityReport, CapacityRequest, Option)
from reports.document import Cell, Document, Table, format_number, num, pct, text

PLANNING_MARGIN = 0.05  # the planner keeps peaks under (1 - margin) x usable memory (PlanOptions)


def _tokens(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:,.3g}{unit}"
    return f"{n:,.0f}"


def _accuracy_text(report: CapacityReport, option: Option) -> str:
    """Which engine the figures price and how far that engine's prices fell from published runs."""
    engine = report.request.priced_engine
    who = ("our engines, as `advisor train` runs the layout" if prices_ours(engine)
           else f"{engine} (--engine {engine}), as that engine runs it")
    band = report.error_band
    if not band:
        return f"Priced for {who}; no published-runs bench has measured this engine's accuracy."
    low, high = option.gpu_hours * (1 - band["p90"]), option.gpu_hours * (1 + band["p90"])
    return (f"Priced for {who}. Against {band['rows']:.0f} published GPU runs (bench/published_bench.py), this "
            f"engine's throughput was within {band['p90']:.0%} for 90% of them (median {band['median']:.0%}): "
            f"read the GPU-hours as {low:,.0f} to {high:,.0f}.")


def capacity_document(report: CapacityReport) -> Document:
    """The page a manager decides from: the decision first, then the evidence behind it."""
    req = report.request
    fitting = [o for o in report.options if o.fits and math.isfinite(o.wall_s)]
    stuck = [o for o in report.options if o.fits and not math.isfinite(o.wall_s)]
    refused = [o for o in report.options if not o.fits]
    tokens = fitting[0].tokens if fitting else (req.tokens or 0)
    work = f"task '{req.task.name}'" if req.task else f"{_tokens(tokens)} tokens"
    doc = Document(f"Capacity plan: {req.model.name}, {work}",
                   f"{len(report.options)} options ({len(req.hardware)} hardware x {len(set(req.gpu_counts))} GPU "
                   f"counts x {len(req.methods)} methods), planned in {report.seconds:.1f} s")
    _recommendation_section(doc, report)
    _options_section(doc, report, fitting)
    _refused_section(doc, refused, stuck)
    _scaling_section(doc, report)
    if len(req.methods) > 1:
        _methods_section(doc, report, fitting)
    _assumptions_section(doc, req, work, tokens)
    if req.command:
        doc.h2("Reproduce")
        doc.code(req.command)
    return doc


def _recommendation_section(doc: Document, report: CapacityReport) -> None:
    """The decision first: the recommendation, its risks, the chosen option's figures."""
    rec = report.recommendation
    doc.h2("Recommendation", id="recommendation-heading")
    doc.callout(rec.text, id="recommendation")
    doc.callout(f"Main risk: {rec.main_risk}.", id="main-risk", kind="risk")
    if rec.other_risks:
        doc.p("Other risks:")
        doc.bullets(rec.other_risks, id="other-risks")
    if not rec.option:
        return
    doc.table(_chosen_table(rec.option))
    doc.p(_accuracy_text(report, rec.option), id="error-band")
    if report.against_megatron and report.against_megatron.slower > SLOWER_THAN_MEGATRON:
        c = report.against_megatron
        doc.callout(f"Our engines run this job {c.slower:.0%} slower than Megatron-LM would "
                    f"({c.ours_tokens_per_s:,.0f} against {c.megatron_tokens_per_s:,.0f} tokens/s); the "
                    f"largest difference is {c.why}.", id="against-megatron", kind="risk")


def _chosen_table(o: Option) -> Table:
    assert o.overhead is not None and o.layout is not None
    k = o.key
    rows = [
        [text("wall-clock time (days)"), num(o.wall_days, f"{k}:wall_days")],
        [text("wall-clock time (hours)"), num(o.wall_s / 3600, f"{k}:wall_hours")],
        [text("GPU-hours"), num(o.gpu_hours, f"{k}:gpu_hours")],
        [text("cost ($)"), num(o.cost, f"{k}:cost") if o.cost is not None else text("no price given")],
        [text("throughput (tokens/s)"), num(o.tokens_per_s, f"{k}:tokens_per_s")],
        [text("MFU"), pct(o.mfu, f"{k}:mfu")],
        [text("peak memory per GPU (GiB)"), num(o.peak_bytes / GiB, f"{k}:peak_gib")],
        [text("memory headroom"), pct(o.headroom, f"{k}:headroom")],
        [text("checkpoint every (hours)"), num(o.overhead.interval_s / 3600, f"{k}:checkpoint_interval_h")],
        [text("checkpoint overhead"), pct(o.overhead.checkpoint_fraction, f"{k}:checkpoint_overhead")],
        [text("expected failures"), num(o.overhead.failures, f"{k}:failures")],
        [text("failure overhead"), pct(o.overhead.failure_fraction, f"{k}:failure_overhead")],
        [text("layout"), text(f"`{o.layout.short()}`", wrap=True)],
    ]
    return Table(["the recommended option", o.label], rows, id="chosen")


def _options_section(doc: Document, report: CapacityReport, fitting: list[Option]) -> None:
    """Every option that fits: its figures, its layout, and the charts that compare them."""
    req = report.request
    chosen = report.recommendation.option.key if report.recommendation.option else None
    doc.h2("Options that fit", id="options-heading")
    priced = any(o.cost is not None for o in fitting)
    headers = ["hardware", "GPUs", "nodes", "method", "days", "GPU-hours"] + (["cost ($)"] if priced else []) + [
        "tokens/s", "MFU", "peak GiB", "headroom", "ckpt", "failures", "fail. overhead", "compute rule"] + (
        ["deadline"] if req.deadline_s else [])
    rows = [_option_row(o, req, priced) for o in fitting]
    # the recommended row reads as chosen even where it misses the deadline
    classes = ["chosen" if o.key == chosen else ("bad" if req.deadline_s and not o.meets_deadline else "")
               for o in fitting]
    doc.table(Table(headers, rows, id="options", row_classes=classes,
                    caption="days and GPU-hours include checkpoint writes and expected failures; "
                            "ckpt and fail. overhead are shares of the pure training time"))
    layouts = [[text(o.key), text(f"`{o.layout.short()}`", wide=True)] for o in fitting if o.layout]
    doc.table(Table(["option", "the planner's best layout"], layouts, id="layouts"))
    doc.figure("wall_clock", charts.option_bars(report.options, "wall_days", "days", "wall-clock time", chosen),
               "Wall-clock days per option, including checkpoints and expected failures "
               "(outlined: recommended; hatched: LoRA).")
    metric, label = ("cost", "dollars") if req.priced else ("gpu_hours", "GPU-hours")
    doc.figure("cost", charts.option_bars(report.options, metric, label, f"{label} per option", chosen),
               f"{label.capitalize()} per option (the whole job, including overheads).")
    doc.figure("memory", charts.memory_chart(report.options, PLANNING_MARGIN),
               "Predicted peak memory per GPU as a share of usable memory; the dashed line is the planner's "
               f"limit ({100 * (1 - PLANNING_MARGIN):.0f}%).")


def _option_row(o: Option, req: CapacityRequest, priced: bool) -> list[Cell]:
    """One fitting option's row of the options table (cost and deadline columns only when asked)."""
    assert o.overhead is not None and o.estimate is not None
    k = o.key
    row = [text(o.hardware), num(o.gpus, f"{k}:gpus"), num(o.nodes, f"{k}:nodes"), text(o.method),
           num(o.wall_days, f"{k}:wall_days"), num(o.gpu_hours, f"{k}:gpu_hours")]
    if priced:
        row.append(num(o.cost, f"{k}:cost") if o.cost is not None else text("-"))
    row += [num(o.tokens_per_s, f"{k}:tokens_per_s"), pct(o.mfu, f"{k}:mfu"),
            num(o.peak_bytes / GiB, f"{k}:peak_gib"), pct(o.headroom, f"{k}:headroom"),
            pct(o.overhead.checkpoint_fraction, f"{k}:checkpoint_overhead"),
            num(o.overhead.failures, f"{k}:failures"),
            pct(o.overhead.failure_fraction, f"{k}:failure_overhead"),
            text("met" if o.meets_compute_rule else f"{100 * o.estimate.compute_fraction:.0f}% < "
                 f"{100 * req.min_compute_fraction:.0f}%")]
    if req.deadline_s:
        row.append(text("met" if o.meets_deadline else "missed"))
    return row


def _refused_section(doc: Document, refused: list[Option], stuck: list[Option]) -> None:
    """Options the planner refused (with its reason and nearest fixes), and those that never finish."""
    doc.h2("Options that do not fit", id="refused-heading")
    if not (refused or stuck):
        doc.p("Every option fits.", id="refused")
        return
    rows = [[text(o.hardware), num(o.gpus), text(o.method), text(o.why_not, wide=True),
             text("; ".join(o.fixes) or "-", wide=True)] for o in refused]
    rows += [[text(o.hardware), num(o.gpus), text(o.method),
              text("fits, but failures would come faster than the job progresses", wide=True), text("-")]
             for o in stuck]
    doc.table(Table(["hardware", "GPUs", "method", "why", "the planner's nearest changes"], rows, id="refused"))


def _scaling_section(doc: Document, report: CapacityReport) -> None:
    """Throughput against the linear ideal per hardware and method, and each curve's knee."""
    req = report.request
    doc.h2("Scaling against ideal", id="scaling-heading")
    doc.p(f"Scaling efficiency at n GPUs = (tokens/s per GPU at n) / (tokens/s per GPU at the smallest count that "
          f"fits). The knee is the largest GPU count whose efficiency, and that of every tested count below it, "
          f"stays at or above {100 * SCALING_EFFICIENCY_RULE:.0f}%: the source article's Amdahl rule (keep at least "
          f"{100 * SCALING_EFFICIENCY_RULE:.0f}% of the work useful). Beyond the knee, more GPUs finish sooner but "
          f"waste more than a fifth of what they cost. The global batch is held at {req.batch:,} sequences of "
          f"{req.seq_len:,} tokens for every option, so the knee is only as fine as the GPU counts tested.")
    rows = []
    knees = []
    for curve in report.scaling:
        for gpus, tps, eff in curve.points:
            k = f"{curve.hardware}/{gpus}/{curve.method}"
            base_g, base_t = curve.points[0][0], curve.points[0][1]
            rows.append([text(curve.hardware), text(curve.method), num(gpus), num(tps, f"{k}:tokens_per_s"),
                         num(base_t * gpus / base_g, f"{k}:ideal_tokens_per_s"), pct(eff, f"{k}:efficiency"),
                         text("knee" if gpus == curve.knee else "")])
        if curve.knee is not None:
            where = (f"{curve.knee} GPUs (every tested count kept {100 * SCALING_EFFICIENCY_RULE:.0f}%; the real knee "
                     "may lie further out)" if curve.beyond_range else f"{curve.knee} GPUs")
            knees.append(f"{curve.hardware}, {curve.method}: knee at {where}")
    doc.table(Table(["hardware", "method", "GPUs", "tokens/s", "linear ideal", "efficiency", ""], rows, id="scaling"))
    doc.bullets(knees, id="knees")
    if report.scaling:
        doc.figure("scaling", charts.scaling_chart(report.scaling, SCALING_EFFICIENCY_RULE),
                   "Predicted throughput against GPUs with the linear ideal from the smallest fitting count; "
                   "the ring marks the knee.")


def _methods_section(doc: Document, report: CapacityReport, fitting: list[Option]) -> None:
    """The first method against each other one, per hardware and GPU count (only with two or more)."""
    req = report.request
    doc.h2("Full fine-tuning against LoRA", id="methods-heading")
    base, others = req.methods[0], req.methods[1:]
    rows = []
    for hw in req.hardware:
        for gpus in sorted(set(req.gpu_counts)):
            by = {o.method: o for o in fitting if o.hardware == hw.name and o.gpus == gpus}
            for other in others:
                if by.get(base) is not None or by.get(other) is not None:  # a row only where one of them fits
                    rows.append(_method_row(hw.name, gpus, base, other, by.get(base), by.get(other)))
    doc.table(Table(["hardware", "GPUs", "methods", f"{base} days", f"{base} GPU-h", "other days",
                     "other GPU-h", "GPU-hours saved", "weights trained"], rows, id="methods"))
    doc.p(f"{METHOD_WORDS.get(others[0], others[0])} trains small adapters and keeps the base weights frozen: it "
          "needs far less memory and optimizer state, and usually a little less time per token, but it can "
          "learn less than full fine-tuning; the report cannot judge quality, only cost.")
    doc.figure("methods", charts.method_chart(report.options, req.methods),
               "GPU-hours of each method for every hardware and GPU count.")


def _method_row(hw: str, gpus: int, base: str, other: str, a: Option | None, b: Option | None) -> list[Cell]:
    """`base` (a) against `other` (b) on one hardware and GPU count; either may not fit."""
    saving = (1 - b.gpu_hours / a.gpu_hours) if a and b else None
    share = (b.estimate.model.trainable_params / b.estimate.model.params) if b and b.estimate else None
    return [text(hw), num(gpus), text(f"{base} vs {other}"),
            num(a.wall_days, f"{a.key}:wall_days") if a else text("does not fit"),
            num(a.gpu_hours, f"{a.key}:gpu_hours") if a else text("-"),
            num(b.wall_days, f"{b.key}:wall_days") if b else text("does not fit"),
            num(b.gpu_hours, f"{b.key}:gpu_hours") if b else text("-"),
            pct(saving, f"{hw}/{gpus}/{other}:saving_vs_{base}") if saving is not None else text("-"),
            pct(share, f"{b.key}:trainable_share", 2) if share is not None else text("-")]


def _assumptions_section(doc: Document, req: CapacityRequest, work: str, tokens: float) -> None:
    """Every assumption the figures rest on, and where each input came from."""
    doc.h2("Assumptions and basis", id="assumptions")
    basis = []
    for hw in req.hardware:
        if hw.source == "preset":
            basis.append(f"{hw.name}: preset (datasheet peaks x assumed efficiencies, not measured): {hw.description}")
        else:
            basis.append(f"{hw.name}: measured profile `{hw.source}`")
    model_src = "shipped preset config" if req.model.source == "preset" else f"config `{req.model.source}`"
    items = [
        f"Model: {req.model.name} ({model_src}), traced layer by layer under fake tensors (no weights loaded).",
        *[f"Hardware basis: {b}." for b in basis],
        f"Work: {work}{f' ({_tokens(tokens)} tokens)' if req.task else ''}; sequence length {req.seq_len:,}; "
        f"global batch {req.batch:,} "
        "sequences per optimizer step, the same for every option.",
        f"Each option's plan is the planner's best layout (`advisor plan --method M --nodes N --gpus-per-node G "
        f"--seq-len {req.seq_len} --global-batch {req.batch}`): throughput at steady state, memory under "
        f"{100 * (1 - PLANNING_MARGIN):.0f}% of usable device memory.",
        *_overhead_assumptions(req),
        "Not included: evaluation passes, data preparation, queueing before the job starts.",
    ]
    if req.deadline_s:
        items.append(f"Deadline: {format_number(req.deadline_s / 86400)} days.")
    doc.bullets(items, id="assumption-list")


def _overhead_assumptions(req: CapacityRequest) -> list[str]:
    """The assumed failure, checkpoint, compute, price and recommendation rules, as the page states them."""
    return [
        f"Failures: MTBF {req.mtbf_hours:,.0f} hours per node (assumed; large fleets report one failure per 1-3 "
        f"thousand node-hours); expected failures = wall-clock hours x nodes / MTBF; each loses half a checkpoint "
        f"interval of work plus a restart of {req.restart_s / 60:.0f} minutes (assumed: re-queue, reload, rebuild "
        "communicators). Wall-clock time counts the failures' own time.",
        f"Checkpoints: written at {req.checkpoint_write_gbs:g} GB/s per node (assumed"
        + (", the planner's default" if req.checkpoint_write_gbs == CHECKPOINT_WRITE_GBS else "")
        + "), trainable weights in fp32 with Adam moments plus frozen weights for full fine-tuning; interval from "
        "Young's formula sqrt(2 x write time x job MTBF), at most the whole job; overhead = write time / interval.",
        f"Compute rule: a layout should keep at least {100 * req.min_compute_fraction:.0f}% of every GPU's step in "
        "computation; options that cannot are the fastest anyway and are flagged.",
        (f"Prices ($ per GPU-hour): {', '.join(f'{k} {v:g}' for k, v in req.prices.items())}." if req.prices
         else "Prices: none given; cost is in GPU-hours."),
        f"Recommendation rule: within the deadline, the fastest option of the first method in --method "
        f"({', '.join(req.methods)}) that costs at most {100 * (COST_SLACK - 1):.0f}% more than the cheapest "
        "(the same 80% rule applied to money).",
    ]
