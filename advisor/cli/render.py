"""How the verbs show their results on the console: tables, and numbers in the units people read."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from rich.table import Table

from advisor.cli.common import console
from specs.core import Estimate, GiB, Layout
from profiler.stragglers import pace, straggles
from reports.skill_story import percent, skill_stories, story_line


def format_gib(nbytes: float) -> str:
    return f"{nbytes / GiB:,.2f}"


def format_seconds(s: float) -> str:
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:,.2f} s"


def render_estimate(result: Estimate, min_compute_fraction: float) -> None:
    mem, t, thr = result.memory, result.time, result.throughput
    lay = result.layout
    console.print(
        f"[bold]{lay.short()}[/bold] on {result.devices} x {result.hardware} ({result.nodes} node"
        f"{'s' if result.nodes != 1 else ''}); {result.model.params / 1e9:,.3f} B params, "
        f"{result.model.trainable_params / 1e9:,.3f} B trainable"
    )
    mem_table = Table(title=f"memory per device (GiB), pipeline stage {mem.stage}", title_justify="left")
    mem_table.add_column("part")
    mem_table.add_column("GiB", justify="right")
    for name in ("weights", "gradients", "optimizer", "activations", "other"):
        mem_table.add_row(name, format_gib(getattr(mem, name)))
    verdict = "[green]fits[/green]" if mem.fits else "[red]does not fit[/red]"
    mem_table.add_row("[bold]peak[/bold]", f"[bold]{format_gib(mem.peak)}[/bold]")
    mem_table.add_row("capacity", f"{format_gib(mem.capacity)}  {verdict}")

    time_table = Table(title="time per optimizer step", title_justify="left")
    time_table.add_column("part")
    time_table.add_column("time", justify="right")
    time_table.add_column("share", justify="right")
    for name, value in (("compute", t.compute_s), ("exposed comm", t.comm_exposed_s),
                        ("pipeline bubble", t.bubble_s), ("optimizer", t.optimizer_s),
                        ("offload", t.offload_s)):
        time_table.add_row(name, format_seconds(value), f"{100 * value / t.step_s:.1f}%" if t.step_s else "")
    time_table.add_row("[bold]step[/bold]", f"[bold]{format_seconds(t.step_s)}[/bold]", "")
    console.print(mem_table)
    console.print(time_table)
    rule = ("[green]ok[/green]" if result.compute_fraction >= min_compute_fraction
            else f"[yellow]below the {100 * min_compute_fraction:.0f}% rule[/yellow]")
    console.print(
        f"throughput {thr.tokens_per_s:,.0f} tokens/s, {thr.model_tflops_per_device:,.1f} model TFLOP/s per "
        f"device, MFU {100 * thr.mfu:.1f}%; compute {100 * result.compute_fraction:.1f}% of the step ({rule})"
    )
    for note in result.notes:
        console.print(f"note: {note}", style="dim")


def table_layout(layout: Layout, shared: tuple[str, ...]) -> str:
    """A layout for a table cell: every key that differs from its default (tp, pp 1, ZeRO 0, no
    recomputation) and is not `shared` by every row (named in the title instead), ", "-separated so
    that a narrow console wraps the cell instead of cutting it."""
    defaults = {"tp=1", "pp=1", "zero=0", "recompute=none", *shared}
    return ", ".join(kv for kv in layout.short().split(",") if kv not in defaults)


def render_plan(result) -> None:
    planned = [result.chosen, *result.alternatives]
    shared = tuple(kv for kv in planned[0].layout.short().split(",") if kv.startswith(("dtype=", "seq="))
                   and all(kv in p.layout.short().split(",") for p in planned))
    table = Table(title=f"plans for {result.model.name} on {result.nodes} x {result.gpus_per_node} "
                        f"{result.hardware.name}, {' '.join(shared)} (best first)", title_justify="left")
    for column in ("#", "layout", "peak GiB", "step", "tokens/s", "MFU", "compute"):
        table.add_column(column, justify="left" if column == "layout" else "right",
                         overflow="fold" if column == "layout" else "ellipsis", min_width=20 if column == "layout" else None,
                         no_wrap=column != "layout")
    for i, p in enumerate(planned, 1):
        e = p.estimate
        flag = "" if p.meets_compute_rule else " [yellow]<rule[/yellow]"
        table.add_row(str(i), table_layout(p.layout, shared), format_gib(e.memory.peak), format_seconds(e.time.step_s),
                      f"{e.throughput.tokens_per_s:,.0f}", f"{100 * e.throughput.mfu:.0f}%",
                      f"{100 * e.compute_fraction:.0f}%{flag}")
    console.print(table)
    console.print(f"[bold]why #1[/bold]: {result.chosen.why}")
    for i, p in enumerate(result.alternatives, 2):
        console.print(f"why #{i}: {p.why}", style="dim")
    if result.stages:
        stages = Table(title="curriculum stages", title_justify="left")
        for column in ("stage", "method", "devices", "tokens", "steps", "hours", "ckpt every", "overhead", "flags"):
            stages.add_column(column)
        for s in result.stages:
            stages.add_row(s.name, s.method, str(s.devices), f"{s.tokens:,}", f"{s.steps:,}", f"{s.hours:.2f}",
                           f"{s.checkpoint_every_steps} steps", f"{100 * s.overhead_fraction:.1f}%",
                           "; ".join(s.flags))
        console.print(stages)
    for note in result.notes:
        console.print(f"note: {note}")
    solver = result.solver
    console.print(f"solver: {solver.get('status')}, {solver.get('ilps')} ILPs over {solver.get('shapes')} shapes "
                  f"in {solver.get('seconds', 0):.2f} s", style="dim")


def compact_layout(text: str) -> str:
    """A layout string without the keys that are at their defaults here (tp, pp 1; dtype; seq)."""
    keep = [kv for kv in text.split(",") if kv not in ("tp=1", "pp=1") and not kv.startswith(("dtype=", "seq="))]
    return ",".join(keep)


def render_verification(verification) -> None:
    table = Table(title="verification: the top plans, predicted against a few measured steps", title_justify="left")
    for column in ("#", "layout", "predicted step", "measured step", "error", "measured tokens/s", "harness"):
        table.add_column(column, justify="left" if column in ("layout", "harness") else "right")
    for t in verification.trials:
        chosen = " [green]<- trained[/green]" if t.rank == verification.chosen_rank else ""
        measured = format_seconds(t.measured_step_s) if t.measured_step_s else f"[red]{t.error or 'failed'}[/red]"
        error = f"{100 * t.step_error:+.0f}%" if t.step_error is not None else "-"
        tps = f"{t.measured_tokens_per_s:,.0f}" if t.measured_tokens_per_s else "-"
        table.add_row(f"{t.rank}", compact_layout(t.layout) + chosen, format_seconds(t.predicted_step_s), measured, error, tps,
                      f"{t.harness}, {t.steps} steps")
    console.print(table)


def render_profile(result, out: Path) -> None:
    inv, hw = result.inventory, result.hardware
    table = Table(title=f"profile of {result.fingerprint.hostname} ({'quick, ' if result.quick else ''}"
                        f"{result.duration_s:.0f} s)", title_justify="left")
    table.add_column("what")
    table.add_column("measured", justify="right")
    table.add_column("repeats", justify="right")
    table.add_row("devices", f"{inv.nodes} node x {inv.devices_per_node} {inv.device_type} ({inv.backend})", "")
    table.add_row("device", f"{inv.device_name}, {inv.threads_per_device} thread(s)" if inv.device_type == "cpu"
                  else inv.device_name, "")
    table.add_row("memory per device", f"{inv.device_memory_gib:,.1f} GiB ({inv.device_reserved_gib:,.2f} reserved)", "")
    table.add_row("host", f"{inv.cpu_cores} cores, {inv.host_memory_gib:,.1f} GiB RAM", "")
    table.add_row("links", f"{inv.intra_node_link}; across nodes: {inv.inter_node_link}", "")
    for m in result.measurements:
        if m.name.startswith("gemm/"):
            table.add_row(f"GEMM {m.name[5:]}", f"{m.value * 1e3:,.1f} GFLOP/s", str(m.repeats))
        elif m.name in ("memory_bandwidth", "host_device/h2d", "host_device/d2h"):
            table.add_row(m.name.replace("_", " "), f"{m.value:,.1f} GB/s", str(m.repeats))
        elif m.name == "cpu_adam":
            table.add_row("CPU AdamW step", f"{m.value / 1e6:,.0f} M params/s", str(m.repeats))
        elif m.name == "deepspeed_cpu_adam":
            table.add_row("DeepSpeed CPU Adam (offload)", f"{m.value / 1e6:,.0f} M params/s", str(m.repeats))
        elif m.name == "host_op":
            table.add_row("host time per launched op", f"{m.value:,.1f} µs", str(m.repeats))
        elif m.name.startswith("cpu_adam/tensor_"):
            table.add_row(f"  tensors of {int(m.name.split('_')[-1]):,} params", f"{m.value / 1e6:,.0f} M params/s", "")
        elif m.name.startswith("attention/"):
            table.add_row(f"attention, seq {int(m.name.split('/')[-1]):,}", f"{m.value * 1e3:,.1f} GFLOP/s", "")
        elif m.name.startswith("head_gemm/"):
            table.add_row(f"LM head GEMMs, vocab {int(m.name.split('/')[-1]):,}", f"{m.value * 1e3:,.1f} GFLOP/s", "")
        elif m.name.endswith("/bandwidth"):
            op, ranks, scope, _ = m.name.split("/")
            table.add_row(f"{op.replace('_', '-')} x{ranks} {scope}",
                          f"{m.value:,.2f} GB/s bus, {getattr(m, 'latency_us', 0):,.0f} µs", "fit")
    if result.cluster and len(result.cluster.devices) > 1:
        _cluster_rows(table, result.cluster)
    if result.calibration:
        cal = result.calibration
        for step in cal.steps:
            keys = [kv for kv in step.layout.split(",") if kv.split("=")[0] in ("dp", "mbs", "gas", "seq", "method",
                                                                                 "recompute")]
            table.add_row("step " + " ".join(k for k in keys if k not in ("method=full", "recompute=none", "dp=1",
                                                                          "gas=1")),
                          f"{format_seconds(step.measured_s)} (model {format_seconds(step.predicted_after_s)})", str(step.steps))
        eff = hw.efficiency
        table.add_row("fitted efficiency", f"gemm {eff.gemm:.2f}, memory {eff.memory_bandwidth:.2f}, "
                      f"LoRA adapters {eff.adapter_gemm or eff.gemm:.2f}", f"{cal.model}, {cal.layers} layers")
        table.add_row("fitted overheads", f"{format_seconds(eff.micro_batch_overhead_s)} per micro-batch, "
                      f"+{100 * eff.node_contention:.0f}% with the node busy, GEMMs {100 * eff.gemm_tokens_slope:+.0f}% "
                      "per doubling of tokens per micro-batch", "")
    console.print(table)
    for note in inv.notes:
        console.print(f"note: {note}", style="dim")
    for key, where in hw.assumed.items():
        console.print(f"note: {key} {getattr(hw, key):g} is {where} (one node: profile several to measure it)",
                      style="dim")
    console.print(f"wrote {out}: use it as --hardware {out}")


def _cluster_rows(table: Table, cluster) -> None:
    """Every device measured at once: each figure's pace (what the hardware prices: a straggler's,
    else the median) and its slowest device, the links between node pairs, the bisection."""
    def paced(label: str, rates: dict[str, float], unit: str, scale: float) -> None:
        slowest = min(rates, key=rates.get)
        priced = pace(list(rates.values()), cluster.straggler_threshold)
        rule = "straggler" if straggles(rates[slowest], statistics.median(rates.values()),
                                        cluster.straggler_threshold) else "median"
        table.add_row(label, f"{priced * scale:,.1f} {unit} (slowest {slowest}: {rates[slowest] * scale:,.1f})",
                      f"priced, {rule}")

    for figure in ("fp32", "bf16"):
        rates = {d.name: d.gemm_tflops[figure] for d in cluster.devices if d.gemm_tflops.get(figure, 0) > 0}
        if rates:
            paced(f"GEMM {figure}, {len(rates)} devices", rates, "GFLOP/s", 1e3)
    paced(f"memory, {len(cluster.devices)} devices", {d.name: d.memory_gbs for d in cluster.devices}, "GB/s", 1.0)
    for link in cluster.links:
        table.add_row(f"send/recv {link.name}", f"{link.bandwidth_gbs:,.2f} GB/s, {link.latency_us:,.0f} µs", "fit")
    if cluster.bisection_gbs:
        table.add_row("bisection (all-to-all)", f"{cluster.bisection_gbs:,.2f} GB/s", "")


def render_capacity(report, written: list[Path]) -> None:
    table = Table(title=f"capacity options for {report.request.model.name} (planned in {report.seconds:.1f} s)",
                  title_justify="left")
    for column in ("option", "days", "GPU-h", "cost", "MFU", "free mem", "ckpt+fail"):
        table.add_column(column, justify="left" if column == "option" else "right", no_wrap=column == "option")
    chosen = report.recommendation.option.key if report.recommendation.option else None
    for o in report.options:
        label = f"{o.gpus} {o.hardware} {o.method}"
        if not o.fits:
            table.add_row(label, "[red]does not fit[/red]", "", "", "", "", "")
            continue
        ov = o.overhead
        table.add_row(f"[bold]{label}[/bold]" if o.key == chosen else label, f"{o.wall_days:,.2f}",
                      f"{o.gpu_hours:,.0f}", f"${o.cost:,.0f}" if o.cost is not None else "-",
                      f"{100 * o.mfu:.0f}%", f"{100 * o.headroom:.0f}%",
                      f"{100 * (ov.checkpoint_fraction + ov.failure_fraction):.1f}%")
    console.print(table)
    console.print(f"[bold]recommendation[/bold]: {report.recommendation.text}", highlight=False)
    console.print(f"[bold]main risk[/bold]: {report.recommendation.main_risk}", highlight=False)
    band, engine = report.error_band, report.request.priced_engine
    if band:
        console.print(f"[bold]accuracy[/bold]: priced for {engine}; within {band['p90']:.0%} of published runs' "
                      f"throughput for 90% of {band['rows']:.0f} (median {band['median']:.0%})", highlight=False)
    comparison = report.against_megatron
    if comparison and comparison.slower > 0.10:
        console.print(f"[bold]against Megatron-LM[/bold]: ours {comparison.slower:.0%} slower; {comparison.why}",
                      highlight=False)
    for path in written[:2]:
        console.print(f"wrote {path}")
    console.print(f"wrote {len(written) - 2} charts in {written[0].parent / 'charts'}", style="dim")


def render_partial_prepare(report: dict[str, Any]) -> None:
    """A prepare that has not finished (trainer/data/partial.py): parts and rows scanned per source."""
    parts = report["parts"]
    of_total = f"/{parts['total']}" if parts["total"] is not None else ""
    table = Table(title=f"PARTIAL: the prepare of {report['folder']} has not finished (stopped or still running; "
                        f"{report['phase']}, "
                        f"{parts['done']}{of_total} parts scanned)", title_justify="left")
    for column in ("source", "parts done", "rows scanned"):
        table.add_column(column, justify="left" if column == "source" else "right")
    for source in report["sources"]:
        table.add_row(source["path"], f"{source['parts_done']}/{source['parts']}", f"{source['rows_scanned']:,}")
    rows_total = f" of {report['rows_total']:,}" if report["rows_total"] is not None else ""
    table.add_row("all", f"{parts['done']}{of_total}", f"{report['rows_scanned']:,}{rows_total}", style="bold")
    console.print(table)
    console.print("kept and dropped documents: not yet known (duplicates are judged over the whole task once every "
                  f"part is scanned); shards written so far: {report['shards_written']}", highlight=False)
    console.print(f"work folder: {report['work']}; a prepare that was stopped resumes from it when the same "
                  "`advisor data prepare` command runs again", style="dim", soft_wrap=True)


def render_data_manifest(manifest: dict[str, Any]) -> None:
    table = Table(title=f"prepared data for task {manifest['task']} (seq {manifest['seq_len']}, "
                        f"micro-batch {manifest['micro_batch_tokens']:,} tokens)", title_justify="left")
    for column in ("stage", "split", "documents", "samples", "tokens", "padding", "1 bucket"):
        table.add_column(column, justify="left" if column in ("stage", "split") else "right")
    buckets = Table(title="length buckets", title_justify="left")
    for column in ("stage", "split", "edge", "micro-batch", "samples", "tokens", "padding"):
        buckets.add_column(column, justify="left" if column in ("stage", "split") else "right")
    notes = []
    for stage in manifest["stages"]:
        for split in ("train", "eval"):
            info = stage.get(split)
            if not info:
                continue
            table.add_row(stage["name"], split, f"{info['documents']:,}", f"{info['samples']:,}", f"{info['tokens']:,}",
                          f"{100 * info['padding']['bucketed']:.1f}%", f"{100 * info['padding']['one_bucket']:.1f}%")
            for b in info["buckets"]:
                buckets.add_row(stage["name"], split, str(b["edge"]), str(b["micro_batch_size"]), f"{b['samples']:,}",
                                f"{b['tokens']:,}", f"{100 * b['padding_fraction']:.1f}%")
            if list(info["groups"]) != ["all"]:
                notes.append(f"{stage['name']} {split} shards by group: "
                             + ", ".join(f"{g} {v['tokens']:,}" for g, v in info["groups"].items()))
            dropped = ", ".join(f"{k} {v:,}" for k, v in info["dropped"].items()) or "none"
            notes.append(f"{stage['name']} {split}: read {info['read']:,} documents, dropped {dropped}")
    console.print(table)
    console.print(buckets)
    for note in notes:
        console.print(note, highlight=False)
    planner = {s["name"]: s.get("tokens_with_replay") for s in manifest["stages"]}
    console.print("tokens per stage for the planner (replay included): "
                  + ", ".join(f"{k} {v:,}" if v is not None else f"{k} -" for k, v in planner.items()), style="dim")


def stage_results_lines(summary: dict[str, Any]) -> list[str]:
    """One line per finished stage: greedy exact match and eval loss per skill (n/a: no answers to
    score) and the epochs it made over its sources; why exact match was not scored, where it was not;
    then, per skill, what the later stages forgot of it and what the closing mixed stage healed."""
    lines = []
    stages = summary.get("stages") or []
    for stage in stages:
        scores = stage.get("exact_match") or {}
        losses = stage.get("eval") or {}
        epochs = stage.get("epochs") or {}
        if scores or epochs or losses:
            scored = ", ".join(f"{skill} {percent(value)}" for skill, value in scores.items())
            loss = ", ".join(f"{skill} {value:.3f}" for skill, value in losses.items()
                             if isinstance(value, (int, float)))
            passes = ", ".join(f"{source} {value:.2f}" for source, value in epochs.items())
            lines.append(f"after {stage['name']}: exact match {scored or '-'}" + (f"; eval loss {loss}" if loss else "")
                         + (f"; epochs {passes}" if passes else ""))
        cut = rows_cut_line(stage)
        if cut:
            lines.append(cut)
    if summary.get("exact_match_note"):
        lines.append(f"exact match {summary['exact_match_note']}")
    lines += [story_line(story) for story in skill_stories(stages)]
    return lines


def rows_cut_line(stage: dict[str, Any]) -> str | None:
    """What reading a stage's examples cost them, when anything: rows cut at the sequence length
    (their ends untrained) and rows dropped (a prompt that fills the sequence leaves no answer)."""
    rows = stage.get("rows") or {}
    truncated, dropped = rows.get("truncated", 0), rows.get("dropped", 0)
    if not truncated and not dropped:
        return None
    return (f"{stage['name']}: {truncated} rows truncated at the sequence length, {dropped} rows dropped with "
            "nothing left to train (a longer --seq-len keeps them)")
