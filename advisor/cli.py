"""The `advisor` command line. Thin: each verb parses, calls one function of a package, renders.

Bad input never shows a traceback: a `UsageError` prints one line and exits with code 2.
Set ADVISOR_DEBUG=1 to see tracebacks of unexpected errors.
"""

from __future__ import annotations

import contextlib
import json

import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer
from rich.console import Console
from rich.table import Table

from advisor.errors import UsageError
from advisor.specs import GiB, LAYOUT_KEYS_HELP, Estimate, parse_layout_string, resolve_layout

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="Plan, run and report task-split LLM training: will it fit, how fast, on what hardware.",
)
console = Console()
err_console = Console(stderr=True)

_LAYOUT_HELP = "Layout keys (comma-separated key=value; left-out keys take defaults):\n\n" + "\n\n".join(
    f"[bold]{k}[/bold]: {v}" for k, v in LAYOUT_KEYS_HELP.items()
)


def _run(action: Callable[[], Any]) -> Any:
    """Turn user errors into one clear line and exit code 2."""
    try:
        return action()
    except UsageError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except (KeyboardInterrupt, typer.Exit):
        raise
    except Exception as exc:  # an unexpected failure: say what, hide the traceback unless asked
        if os.environ.get("ADVISOR_DEBUG"):
            raise
        err_console.print(f"[red]internal error:[/red] {type(exc).__name__}: {exc} "
                          "(rerun with ADVISOR_DEBUG=1 for the traceback)", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


@app.command()
def presets(
    kind: Optional[str] = typer.Argument(None, help="hardware, models or tasks (default: all)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """List the hardware, model and task presets that ship with advisor."""
    from presets import KINDS, preset_data, preset_names

    def collect() -> dict[str, list[dict[str, Any]]]:
        kinds = [kind] if kind else list(KINDS)
        out: dict[str, list[dict[str, Any]]] = {}
        for k in kinds:
            rows = []
            for name in preset_names(k):
                data = preset_data(k, name)
                rows.append({"name": name, "description": data.get("description", "")})
            out[k] = rows
        return out

    listing = _run(collect)
    if as_json:
        print(json.dumps(listing))
        return
    for k, rows in listing.items():
        table = Table(title=f"{k} presets", title_justify="left")
        table.add_column("name", style="bold")
        table.add_column("description")
        for row in rows:
            table.add_row(row["name"], row["description"])
        console.print(table)


@app.command(help="Predict per-device memory and step time of one layout, before anything runs.\n\n"
             + _LAYOUT_HELP)
def estimate(
    model: str = typer.Option(..., "--model", "-m", help="model preset, HF config.json, or model folder"),
    hardware: str = typer.Option(..., "--hardware", "-H", help="hardware preset or profile.json"),
    layout: str = typer.Option("", "--layout", "-l", help="e.g. 'tp=8,pp=4,zero=1,mbs=1,gas=16,recompute=selective'"),
    nodes: Optional[int] = typer.Option(
        None, "--nodes", min=1, help="number of nodes (default: 1, or dp*tp*pp when the layout sets dp)"),
    gpus_per_node: Optional[int] = typer.Option(
        None, "--gpus-per-node", min=1, help="devices per node (default: the hardware's)"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="tokens per sequence (layout seq)"),
    attention: Optional[str] = typer.Option(
        None, "--attention", help="flash | sdpa | eager (default: flash on GPUs, sdpa on CPU)"),
    as_json: bool = typer.Option(False, "--json", help="print exactly one JSON object (the contract)"),
) -> None:
    from planner.cost_model import estimate as run_estimate
    from presets import load_hardware, load_model

    def compute() -> Estimate:
        hw = load_hardware(hardware)
        spec = load_model(model)
        if attention not in (None, "flash", "sdpa", "eager"):
            raise UsageError(f"--attention must be flash, sdpa or eager (got {attention})")
        per_node = gpus_per_node or hw.devices_per_node
        given = parse_layout_string(layout)
        if nodes is None and gpus_per_node is None and "dp" in given:  # the layout names the devices
            devices = given["dp"] * given.get("tp", 1) * given.get("pp", 1)
        else:
            devices = (nodes or 1) * per_node
        if gpus_per_node:
            hw = hw.model_copy(update={"devices_per_node": gpus_per_node})
        lay = resolve_layout(layout, devices, hw, seq_len)
        return run_estimate(spec, hw, lay, attention=attention)

    result: Estimate = _run(compute)
    if as_json:
        print(result.model_dump_json())
        return
    render_estimate(result)


@app.command()
def plan(
    model: str = typer.Option(..., "--model", "-m", help="model preset, HF config.json, or model folder"),
    hardware: str = typer.Option(..., "--hardware", "-H", help="hardware preset or profile.json"),
    nodes: int = typer.Option(1, "--nodes", min=1, help="nodes available (the cost objective may use fewer)"),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", min=1, help="default: the hardware's"),
    task: Optional[str] = typer.Option(None, "--task", help="task preset (e.g. demo) or task YAML: sizes stages"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="tokens per sequence"),
    global_batch: Optional[int] = typer.Option(
        None, "--global-batch", min=1, help="sequences per optimizer step, held fixed (= dp*mbs*gas)"),
    method: str = typer.Option("full", "--method", help="full | lora | qlora | auto (full if it fits, then LoRA, QLoRA)"),
    objective: str = typer.Option("throughput", "--objective", help="throughput | cost (fewest GPU-hours by --deadline)"),
    deadline: Optional[str] = typer.Option(None, "--deadline", help="for --objective cost: e.g. 14d, 36h"),
    tokens: Optional[float] = typer.Option(None, "--tokens", help="for --objective cost without --task: tokens to train"),
    price: Optional[float] = typer.Option(None, "--price-per-gpu-hour", help="adds the cost in dollars"),
    min_compute_fraction: float = typer.Option(
        0.8, "--min-compute-fraction", help="Amdahl rule: compute share of every device's step"),
    top: int = typer.Option(5, "--top", min=1, help="how many plans to rank"),
    mtbf_hours: float = typer.Option(2000.0, "--mtbf-hours", help="mean time between failures of one node"),
    per_stage_devices: bool = typer.Option(
        False, "--per-stage-devices", help="let stages run on different device counts (e.g. LoRA on fewer)"),
    allow_cross_node_tp: bool = typer.Option(False, "--allow-cross-node-tp", help="let tp span nodes"),
    attention: Optional[str] = typer.Option(None, "--attention", help="flash | sdpa | eager"),
    out: Optional[Path] = typer.Option(None, "--out", help="write plan.yaml for `advisor train`"),
    export_dir: Optional[Path] = typer.Option(
        None, "--export", help="write deepspeed.json, accelerate.yaml, torchrun.sh, slurm.sbatch there"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object: plans best first, solver"),
) -> None:
    """Choose the layout (dp/tp/pp/vpp/sp, ZeRO, offload, micro-batch and accumulation, per-stage
    recomputation, layer split, method) with an ILP, rank the best, and say why.

    Infeasible requests exit with code 2 and list the nearest feasible changes.
    """
    from planner.export import export
    from planner.plan import PlanOptions, make_plan, parse_duration
    from presets import load_hardware, load_model, load_task
    from trainer.data.manifest import manifest_stage_tokens

    def compute():
        spec_task = load_task(task) if task else None
        opts = PlanOptions(
            model=load_model(model), hardware=load_hardware(hardware), nodes=nodes, gpus_per_node=gpus_per_node,
            task=spec_task, stage_tokens=manifest_stage_tokens(spec_task) if spec_task else None, seq=seq_len, global_batch=global_batch, method=method, objective=objective,
            deadline_s=parse_duration(deadline) if deadline else None, tokens=tokens, price_per_gpu_hour=price,
            min_compute_fraction=min_compute_fraction, top_k=top, mtbf_hours=mtbf_hours,
            per_stage_devices=per_stage_devices, allow_cross_node_tp=allow_cross_node_tp, attention=attention,
        )
        result = make_plan(opts)
        written = []
        if out:
            result.write(out)
            written.append(out)
        if export_dir:
            written += export(result, export_dir)
        return result, written

    result, written = _run(compute)
    if as_json:
        plans = [result.chosen, *result.alternatives]
        print(json.dumps({
            "plans": [{"layout": p.layout.model_dump(mode="json"), "estimate": p.estimate.model_dump(mode="json"),
                       "why": p.why, "meets_compute_rule": p.meets_compute_rule} for p in plans],
            "solver": result.solver,
            "stages": [s.model_dump(mode="json") for s in result.stages],
            "notes": result.notes,
        }))
        return
    render_plan(result)
    for path in written:
        console.print(f"wrote {path}")


@app.command()
def train(
    plan_file: Path = typer.Argument(..., help="plan.yaml from `advisor plan --task ... --out plan.yaml`"),
    out: Path = typer.Option(Path("runs/latest"), "--out", help="run directory (metrics, events, checkpoints)"),
    resume: bool = typer.Option(False, "--resume", help="continue from the run directory's last checkpoint"),
    max_steps_per_stage: Optional[int] = typer.Option(None, "--max-steps-per-stage", min=1, help="cap (demos)"),
    seed: int = typer.Option(0, "--seed"),
    weights: Optional[str] = typer.Option(None, "--weights", help="local HF model folder to start from"),
    data: Optional[Path] = typer.Option(None, "--data", help="`advisor data prepare` folder: length-bucketed "
                                        "shards (default: the task's data.out when it is fresh, else raw files)"),
    nnodes: Optional[int] = typer.Option(None, "--nnodes", min=1, help="nodes (default: Slurm's, else 1)"),
    node_rank: int = typer.Option(0, "--node-rank", min=0),
    master_addr: str = typer.Option("127.0.0.1", "--master-addr"),
    master_port: int = typer.Option(29513, "--master-port"),
    launched: bool = typer.Option(False, "--launched", hidden=True, help="set by the launcher in each worker"),
    engine: Optional[str] = typer.Option(None, "--engine", help="sharded data-parallel back-end: auto (DeepSpeed "
                                         "for ZeRO, FSDP2 with tp>1), deepspeed or fsdp2; overrides the plan's"),
) -> None:
    """Run a plan as staged, task-split training: per-stage learning-rate re-warm-up, a checkpoint at
    every stage end and on the planned cadence, loss-spike rollback, exact --resume."""
    from advisor.plan_file import load_plan
    from trainer.launch import run
    from trainer.loop import TrainOptions

    def go():
        plan = load_plan(plan_file)
        if engine is not None:
            if engine not in ("auto", "deepspeed", "fsdp2"):
                raise UsageError(f"--engine {engine}: choose auto, deepspeed or fsdp2")
            plan = plan.model_copy(update={"engine": engine})
        options = TrainOptions(seed=seed, max_steps_per_stage=max_steps_per_stage, weights=weights,
                               data=str(data.resolve()) if data else None)
        extra = ["--seed", str(seed)] + (["--max-steps-per-stage", str(max_steps_per_stage)] if max_steps_per_stage
                                         else []) + (["--weights", weights] if weights else []) + (
                    ["--data", options.data] if options.data else []) + (["--engine", engine] if engine else [])
        return run(plan, plan_file, out, resume, options, launched, nnodes, node_rank, master_addr, master_port, extra)

    summary = _run(go)
    if summary and not launched:
        measured, predicted = summary["measured"], summary["predicted"]
        console.print(f"trained {summary['steps']} steps ({summary['rollbacks']} rollbacks); step "
                      f"{_seconds(measured['step_s'] or 0)} measured vs {_seconds(predicted['step_s'])} predicted; "
                      f"run dir {out}")


@app.command("run")
def run_all(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="default: the task's model, else demo-tiny"),
    task: Optional[str] = typer.Option(None, "--task", help="task preset or YAML (default: the generated demo)"),
    hardware: Optional[str] = typer.Option(None, "--hardware", "-H", help="default: profile this machine "
                                           "(or reuse its profile from the last week)"),
    verify: int = typer.Option(3, "--verify", min=0, help="measure the top K plans for a few steps each and "
                               "train the fastest measured (0: train the planner's choice untested)"),
    verify_steps: int = typer.Option(4, "--verify-steps", min=3, help="steps per verification trial "
                                     "(the first 2 warm up)"),
    feedback: bool = typer.Option(True, "--feedback/--no-feedback", help="refit the profile's efficiency "
                                  "factors to this run's measured steps"),
    out: Path = typer.Option(Path("runs/demo"), "--out", help="run directory"),
    max_steps_per_stage: Optional[int] = typer.Option(None, "--max-steps-per-stage", min=1, help="cap (smoke runs)"),
    seed: int = typer.Option(0, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object at the end"),
) -> None:
    """Profile, plan, verify, train, feed back and report in one command. With no options: the
    embedded demo (demo-tiny on a generated curriculum: language, arithmetic, instructions, then
    a mixed stage)."""
    from trainer.pipeline import RunOptions, run_pipeline

    def say(text: str) -> None:
        if not as_json:
            console.print(f"[bold]advisor run[/bold]: {text}", highlight=False)

    def show(verification) -> None:
        if not as_json:
            render_verification(verification)

    options = RunOptions(model=model, task=task, hardware=hardware, out=out, max_steps_per_stage=max_steps_per_stage,
                         seed=seed, verify=verify, verify_steps=verify_steps, feedback=feedback)
    if as_json:  # stdout carries the JSON alone: the trainer's and DeepSpeed's output goes to stderr
        with _stdout_to_stderr():
            result = _run(lambda: run_pipeline(options, say, show))
        print(json.dumps(result, default=str))
        return
    result = _run(lambda: run_pipeline(options, say, show))
    summary = result["summary"] or {}
    measured, predicted = summary.get("measured", {}), summary.get("predicted", {})
    console.print(f"done in {result['seconds']:.0f} s: {summary.get('steps')} steps, measured step "
                  f"{_seconds(measured.get('step_s') or 0)} (predicted {_seconds(predicted.get('step_s') or 0)}), "
                  f"run dir {result['run_dir']}" + (f", report {result['report']}" if result["report"] else ""))


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr (forked and launched workers inherit it), then restore."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _compact_layout(text: str) -> str:
    """A layout string without the keys that are at their defaults here (tp, pp 1; dtype; seq)."""
    keep = [kv for kv in text.split(",") if kv not in ("tp=1", "pp=1") and not kv.startswith(("dtype=", "seq="))]
    return ",".join(keep)


def render_verification(verification) -> None:
    table = Table(title="verification: the top plans, predicted against a few measured steps", title_justify="left")
    for column in ("#", "layout", "predicted step", "measured step", "error", "measured tokens/s", "harness"):
        table.add_column(column, justify="left" if column in ("layout", "harness") else "right")
    for t in verification.trials:
        chosen = " [green]<- trained[/green]" if t.rank == verification.chosen_rank else ""
        measured = _seconds(t.measured_step_s) if t.measured_step_s else f"[red]{t.error or 'failed'}[/red]"
        error = f"{100 * t.step_error:+.0f}%" if t.step_error is not None else "-"
        tps = f"{t.measured_tokens_per_s:,.0f}" if t.measured_tokens_per_s else "-"
        table.add_row(f"{t.rank}", _compact_layout(t.layout) + chosen, _seconds(t.predicted_step_s), measured, error, tps,
                      f"{t.harness}, {t.steps} steps")
    console.print(table)


def render_plan(result) -> None:
    table = Table(title=f"plans for {result.model.name} on {result.nodes} x {result.gpus_per_node} "
                        f"{result.hardware.name} (best first)", title_justify="left")
    for column in ("#", "layout", "peak GiB", "step", "tokens/s", "MFU", "compute"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for i, p in enumerate([result.chosen, *result.alternatives], 1):
        e = p.estimate
        flag = "" if p.meets_compute_rule else " [yellow]<rule[/yellow]"
        table.add_row(str(i), p.layout.short(), _gib(e.memory.peak), _seconds(e.time.step_s),
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


@app.command()
def profile(
    out: Path = typer.Option(Path("profile.json"), "--out", "-o", help="where to write the profile"),
    quick: bool = typer.Option(False, "--quick", help="short budgets: about a minute on a 2-core CPU"),
    model: Optional[str] = typer.Option(
        None, "--model", "-m", help="model preset, HF config.json or model folder: GEMM shapes and calibration"),
    nproc: Optional[int] = typer.Option(
        None, "--nproc", min=1, help="ranks (devices) to profile together; default: GPUs, or CPU cores"),
    device: str = typer.Option("auto", "--device", help="auto | cuda | cpu"),
    calibrate: bool = typer.Option(True, "--calibrate/--no-calibrate", help="fit efficiencies to real steps"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object: the profile"),
) -> None:
    """Measure this machine (devices, GEMM per dtype, memory, host<->device, CPU Adam, collectives),
    calibrate the cost model on a few real steps of --model, and write profile.json for --hardware.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from planner.calibration import calibrate as fit_calibration
    from presets import load_model
    from profiler.run_profile import ProfileOptions, run_profile
    from trainer.steps import prepare_parent, run_layout, time_steps

    class Bar:
        def __init__(self, bar: Progress) -> None:
            self.bar, self.task = bar, bar.add_task("starting", total=None)

        def total(self, units: int) -> None:
            self.bar.update(self.task, total=units)

        def step(self, what: str) -> None:
            self.bar.update(self.task, advance=1, description=what)

    def measure():
        from profiler.inventory import resolve_device

        resolve_device(device)  # refuse MPS and friends before drawing a progress bar
        opts = ProfileOptions(out=out, quick=quick, model=load_model(model) if model else None, nproc=nproc,
                              device=device, calibrate=calibrate)
        columns = (TextColumn("{task.description:<36}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn())
        with Progress(*columns, console=err_console, transient=as_json) as bar:
            measured = run_profile(opts, Bar(bar),
                                   step_runner=lambda layout, **kw: time_steps(run_layout(layout), **kw),
                                   prepare_forks=lambda: prepare_parent({"zero": 0}))
        if measured is None:
            return None
        fitted = measured.profile
        if measured.calibration_steps is not None:
            fitted = fit_calibration(fitted, measured.calibration_steps)
        fitted.write(out)
        return fitted

    result = _run(measure)
    if result is None:  # a torchrun job wrote it
        return
    if as_json:
        print(result.model_dump_json())
        return
    render_profile(result, out)


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
        elif m.name.endswith("/bandwidth"):
            op, ranks, scope, _ = m.name.split("/")
            table.add_row(f"{op.replace('_', '-')} x{ranks} {scope}",
                          f"{m.value:,.2f} GB/s bus, {getattr(m, 'latency_us', 0):,.0f} µs", "fit")
    if result.calibration:
        cal = result.calibration
        for step in cal.steps:
            keys = [kv for kv in step.layout.split(",") if kv.split("=")[0] in ("dp", "mbs", "gas", "seq", "method",
                                                                                 "recompute")]
            table.add_row("step " + " ".join(k for k in keys if k not in ("method=full", "recompute=none", "dp=1",
                                                                          "gas=1")),
                          f"{_seconds(step.measured_s)} (model {_seconds(step.predicted_after_s)})", str(step.steps))
        eff = hw.efficiency
        table.add_row("fitted efficiency", f"gemm {eff.gemm:.2f}, memory {eff.memory_bandwidth:.2f}, "
                      f"LoRA adapters {eff.adapter_gemm or eff.gemm:.2f}", f"{cal.model}, {cal.layers} layers")
        table.add_row("fitted overheads", f"{_seconds(eff.micro_batch_overhead_s)} per micro-batch, "
                      f"+{100 * eff.node_contention:.0f}% with the node busy", "")
    console.print(table)
    for note in inv.notes:
        console.print(f"note: {note}", style="dim")
    console.print(f"wrote {out}: use it as --hardware {out}")


report_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode="rich",
    help="Reports as one self-contained HTML page, a Markdown twin and PNG charts: capacity (before) and run (after).")
app.add_typer(report_app, name="report")


@report_app.command("capacity")
def report_capacity(
    model: str = typer.Option(..., "--model", "-m", help="model preset, HF config.json, or model folder"),
    tokens: Optional[float] = typer.Option(None, "--tokens", help="tokens to train, e.g. 2e10 (or --task)"),
    task: Optional[str] = typer.Option(None, "--task", help="task preset or task YAML: its stages' tokens"),
    hardware: str = typer.Option("h100-80g,a100-80g,rtx4090-24g", "--hardware", "-H",
                                 help="comma-separated hardware presets or profile.json files"),
    gpus: str = typer.Option("8,64,512", "--gpus", help="comma-separated GPU counts (whole nodes above one node)"),
    method: str = typer.Option("full,lora", "--method", help="comma-separated full, lora, qlora; the first is preferred"),
    price: Optional[str] = typer.Option(
        None, "--price-per-gpu-hour", help="dollars: 2.5 for all, or h100-80g=2.5,a100-80g=1.6,rtx4090-24g=0.4"),
    deadline: Optional[str] = typer.Option(None, "--deadline", help="wall-clock limit, e.g. 14d or 36h"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="tokens per sequence (default: task's or 2048)"),
    global_batch: Optional[int] = typer.Option(
        None, "--global-batch", min=1, help="sequences per step, the same for every option (default ~2M tokens)"),
    mtbf_hours: Optional[float] = typer.Option(None, "--mtbf-hours", help="mean time between failures of one node "
                                               "(default: the planner's 2000)"),
    restart_minutes: float = typer.Option(10.0, "--restart-minutes", help="time to restart after a failure (assumed)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="planner processes (default: CPU cores)"),
    out: Path = typer.Option(Path("capacity-report"), "--out", help="folder for capacity.html, capacity.md, charts/"),
    as_json: bool = typer.Option(False, "--json", help="print the table of options as one JSON object"),
) -> None:
    """For every hardware x GPU count x method: the planner's best plan, its wall-clock time, GPU-hours,
    cost, MFU, memory headroom, checkpoint and failure overhead; the scaling knee; full against
    LoRA; and a recommendation with its main risk."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from planner.plan import parse_duration
    from presets import load_hardware, load_model, load_task
    from reports.capacity import CapacityRequest, capacity_report, parse_counts, parse_prices
    from reports.pages import capacity_document
    from trainer.data.manifest import manifest_stage_tokens

    def build():
        hws = [load_hardware(h.strip()) for h in hardware.split(",") if h.strip()]
        command = ["advisor report capacity", f"--model {model}"] + (
            [f"--tokens {tokens:g}"] if tokens is not None else []) + ([f"--task {task}"] if task else []) + [
            f"--hardware {hardware}", f"--gpus {gpus}", f"--method {method}"] + [
            f"{flag} {value}" for flag, value in (("--price-per-gpu-hour", price), ("--deadline", deadline),
                                                  ("--seq-len", seq_len), ("--global-batch", global_batch),
                                                  ("--mtbf-hours", mtbf_hours)) if value is not None]
        extra = {"mtbf_hours": mtbf_hours} if mtbf_hours is not None else {}
        spec_task = load_task(task) if task else None
        req = CapacityRequest(
            model=load_model(model), hardware=hws, gpu_counts=parse_counts(gpus),
            methods=[m.strip() for m in method.split(",") if m.strip()], tokens=tokens,
            task=spec_task, stage_tokens=manifest_stage_tokens(spec_task) if spec_task else None, seq=seq_len,
            global_batch=global_batch,
            prices=parse_prices(price, hws), deadline_s=parse_duration(deadline) if deadline else None,
            restart_s=restart_minutes * 60, command=" ".join(command), **extra)
        total = len(hws) * len(req.gpu_counts) * len(req.methods)
        # no refresh thread: planner workers are forked, and a fork should not copy a running thread
        with Progress(TextColumn("planning"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                      TimeElapsedColumn(), console=err_console, transient=True, auto_refresh=False) as bar:
            job = bar.add_task("", total=total)

            def advance(option) -> None:
                bar.update(job, advance=1, description=f"{option.label} ({option.plan_seconds:.1f} s)")
                bar.refresh()

            report = capacity_report(req, advance, jobs)
        written = capacity_document(report).write(out, "capacity")
        return report, written

    report, written = _run(build)
    if as_json:
        print(json.dumps({**report.to_json(), "files": [str(p) for p in written]}))
        return
    render_capacity(report, written)


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
    for path in written[:2]:
        console.print(f"wrote {path}")
    console.print(f"wrote {len(written) - 2} charts in {written[0].parent / 'charts'}", style="dim")


@report_app.command("run")
def report_run(
    run_dir: Path = typer.Argument(..., help="a run dir from `advisor train` or `advisor run`"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for run.html, run.md, charts/ (default RUN_DIR/report)"),
    as_json: bool = typer.Option(False, "--json", help="print predicted against measured and per-stage results"),
) -> None:
    """Predicted against measured (peak memory, step time, tokens/s), loss and learning rate per
    stage, spikes and rollbacks, checkpoints, per-skill evaluation, and the plan that ran."""
    from reports.run_report import run_report

    def build():
        analysis, document = run_report(run_dir)
        return analysis, document.write(out or run_dir / "report", "run")

    analysis, written = _run(build)
    if as_json:
        print(json.dumps({
            "comparisons": [{"name": c.key, "predicted": c.predicted, "measured": c.measured, "ratio": c.ratio}
                            for c in analysis.comparisons],
            "stages": [vars(s) for s in analysis.stages], "spikes": len(analysis.spikes),
            "rollbacks": len(analysis.rollbacks), "finished": analysis.finished,
            "files": [str(p) for p in written]}))
        return
    for c in analysis.comparisons:
        if c.ratio is not None:
            console.print(f"{c.name}: measured / predicted = {c.ratio:.2f}")
    for path in written[:2]:
        console.print(f"wrote {path}")


data_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode="rich",
    help="Prepare a task's data: clean, deduplicate, grade by difficulty, bucket by length, shard into stages.",
)
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def data_prepare(
    task: str = typer.Option(..., "--task", help="task preset (e.g. demo) or task YAML"),
    out: Optional[Path] = typer.Option(None, "--out", help="output folder (default: the task's data.out, "
                                                           "relative to the task file)"),
    micro_batch_tokens: Optional[int] = typer.Option(
        None, "--micro-batch-tokens", min=8, help="token budget of one micro-batch for the bucket edges"),
    as_json: bool = typer.Option(False, "--json", help="print the manifest as one JSON object"),
) -> None:
    """Clean (exact and MinHash near-duplicate removal, length and character-quality thresholds),
    grade by difficulty, bucket by length and write tokenised stage shards plus a manifest.

    The folder is written aside and renamed at the end: it is whole or untouched.
    """
    from presets import load_task
    from trainer.data.prepare import prepare

    def compute():
        spec = load_task(task)
        log = None if as_json else (lambda message: err_console.print(message, style="dim", highlight=False))
        return prepare(spec, out, micro_batch_tokens=micro_batch_tokens, log=log)

    folder, manifest = _run(compute)
    if as_json:
        print(json.dumps(manifest))
        return
    render_data_manifest(manifest)
    console.print(f"wrote {folder}")


@data_app.command("stats")
def data_stats(
    directory: Path = typer.Argument(..., help="a folder written by `advisor data prepare` (or its manifest.json)"),
    as_json: bool = typer.Option(False, "--json", help="print the manifest as one JSON object"),
) -> None:
    """Show a prepared folder's manifest: tokens, samples, buckets and padding per stage."""
    from trainer.data.manifest import read_manifest

    manifest = _run(lambda: read_manifest(directory))
    if as_json:
        print(json.dumps(manifest))
        return
    render_data_manifest(manifest)


@data_app.command("generate-demo")
def data_generate_demo(
    out: Path = typer.Option(..., "--out", help="folder: data/*.jsonl and task.yaml go there"),
    seed: int = typer.Option(0, "--seed", help="random seed (same seed, same files)"),
    scale: float = typer.Option(1.0, "--scale", min=0.0001, help="multiply every file's size"),
) -> None:
    """Generate the embedded demo's curriculum data (language, arithmetic, instructions, eval splits)."""
    from trainer.data.demo_corpus import generate_demo_corpus

    written = _run(lambda: generate_demo_corpus(out, seed=seed, scale=scale))
    for path in written.values():
        console.print(f"wrote {path}")


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


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:,.2f}"


def _seconds(s: float) -> str:
    if s == 0:
        return "0"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:,.2f} s"


def render_estimate(result: Estimate) -> None:
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
        mem_table.add_row(name, _gib(getattr(mem, name)))
    verdict = "[green]fits[/green]" if mem.fits else "[red]does not fit[/red]"
    mem_table.add_row("[bold]peak[/bold]", f"[bold]{_gib(mem.peak)}[/bold]")
    mem_table.add_row("capacity", f"{_gib(mem.capacity)}  {verdict}")

    time_table = Table(title="time per optimizer step", title_justify="left")
    time_table.add_column("part")
    time_table.add_column("time", justify="right")
    time_table.add_column("share", justify="right")
    for name, value in (("compute", t.compute_s), ("exposed comm", t.comm_exposed_s),
                        ("pipeline bubble", t.bubble_s), ("optimizer", t.optimizer_s),
                        ("offload", t.offload_s)):
        time_table.add_row(name, _seconds(value), f"{100 * value / t.step_s:.1f}%" if t.step_s else "")
    time_table.add_row("[bold]step[/bold]", f"[bold]{_seconds(t.step_s)}[/bold]", "")
    console.print(mem_table)
    console.print(time_table)
    rule = "[green]ok[/green]" if result.compute_fraction >= 0.8 else "[yellow]below the 80% rule[/yellow]"
    console.print(
        f"throughput {thr.tokens_per_s:,.0f} tokens/s, {thr.model_tflops_per_device:,.1f} model TFLOP/s per "
        f"device, MFU {100 * thr.mfu:.1f}%; compute {100 * result.compute_fraction:.1f}% of the step ({rule})"
    )
    for note in result.notes:
        console.print(f"note: {note}", style="dim")


def main() -> None:  # pragma: no cover - entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())


