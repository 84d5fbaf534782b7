"""`advisor plan`: the planner's ranked layouts for a model on some hardware, and the files to launch them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from specs.capabilities import prices_ours
from specs.profile import load_profile, looks_like_profile
from advisor.cli.common import (MIN_COMPUTE_FRACTION, PRICED_ENGINE_HELP, TRUST_REMOTE_CODE, check_out_folder,
                                console, exit_on_error, stage_tokens)
from advisor.cli.render import render_plan
from specs.errors import UsageError
from specs.run_dir import PLAN_FILE
from specs.core import MAX_DEVICES_PER_NODE, MAX_LORA_RANK, MAX_NODES
from presets import load_task
from planner.export import export
from planner.fix import parse_fix
from planner.plan import PlanOptions, make_plan, parse_duration
from planner.stragglers import parse_exclude
from presets import load_hardware, load_model


def plan(
    model: str = typer.Option(..., "--model", "-m", help="model preset, HF config.json, or model folder"),
    hardware: str = typer.Option(..., "--hardware", "-H", help="hardware preset or profile.json"),
    nodes: int = typer.Option(1, "--nodes", min=1, max=MAX_NODES,
                              help="nodes available (the cost objective may use fewer)"),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", min=1, max=MAX_DEVICES_PER_NODE,
                                                help="default: the hardware's"),
    task: Optional[str] = typer.Option(None, "--task", help="task preset (e.g. demo) or task YAML: sizes stages"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="tokens per sequence"),
    global_batch: Optional[int] = typer.Option(
        None, "--global-batch", min=1, help="sequences per optimizer step, held fixed (= dp*mbs*gas)"),
    method: str = typer.Option("full", "--method", help="full | lora | qlora | auto (full if it fits, then LoRA, QLoRA)"),
    lora_rank: Optional[int] = typer.Option(None, "--lora-rank", min=1, max=MAX_LORA_RANK, help="LoRA/QLoRA "
                                            "adapters' rank (default 16), priced and run as planned"),
    objective: str = typer.Option("throughput", "--objective", help="throughput | cost (fewest GPU-hours by --deadline)"),
    deadline: Optional[str] = typer.Option(None, "--deadline", help="for --objective cost: e.g. 14d, 36h"),
    tokens: Optional[float] = typer.Option(None, "--tokens", help="for --objective cost without --task: tokens to train"),
    price: Optional[float] = typer.Option(None, "--price-per-gpu-hour", help="adds the cost in dollars"),
    min_compute_fraction: float = typer.Option(
        MIN_COMPUTE_FRACTION, "--min-compute-fraction", help="Amdahl rule: compute share of every device's step"),
    top: int = typer.Option(5, "--top", min=1, help="how many plans to rank"),
    mtbf_hours: float = typer.Option(2000.0, "--mtbf-hours", help="mean time between failures of one node"),
    per_stage_devices: bool = typer.Option(
        False, "--per-stage-devices", help="let stages run on different device counts (e.g. LoRA on fewer)"),
    allow_cross_node_tp: bool = typer.Option(False, "--allow-cross-node-tp", help="let tp span nodes"),
    attention: Optional[str] = typer.Option(None, "--attention", help="flash | sdpa | eager"),
    fix: Optional[str] = typer.Option(
        None, "--fix", help="layout keys to hold fixed, e.g. \"tp=8,zero=1\" (dp tp pp vpp sp zero offload mbs "
        "gas method dtype seq); the planner chooses the rest. Exits 2 with the reason when the trainer cannot "
        "run it"),
    exclude: Optional[str] = typer.Option(
        None, "--exclude", help="with a profile of several devices: devices (n1d0) or nodes (n1) to leave out of the "
        "pricing, comma-separated; the plan then prices the slowest device and link left (each straggler's gain "
        "is in the notes)"),
    any_engine: bool = typer.Option(
        False, "--any-engine", help="plan over every layout the cost model prices (Megatron/NeMo-style sp, "
        "interleaving...), not only what `advisor train` runs; the plan is marked not runnable here"),
    engine: str = typer.Option("ours", "--engine", help=PRICED_ENGINE_HELP + "; megatron plans as --any-engine"),
    out: Optional[Path] = typer.Option(None, "--out", help="write plan.yaml for `advisor train`"),
    export_dir: Optional[Path] = typer.Option(
        None, "--export", help="write deepspeed.json, accelerate.yaml, torchrun.sh, slurm.sbatch there"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object: plans best first, solver"),
    trust_remote_code: bool = TRUST_REMOTE_CODE,
) -> None:
    """Choose the layout (dp/tp/pp/vpp/sp, ZeRO, offload, micro-batch and accumulation, per-stage
    recomputation, layer split, method) with an ILP, rank the best, and say why.

    Infeasible requests exit with code 2 and list the nearest feasible changes.
    """
    def compute():
        spec_task = load_task(task) if task else None
        spec_model = load_model(model, trust_remote_code)
        opts = PlanOptions(
            model=spec_model, hardware=load_hardware(hardware), nodes=nodes, gpus_per_node=gpus_per_node,
            task=spec_task, stage_tokens=stage_tokens(spec_task, spec_model, seq_len), seq=seq_len, global_batch=global_batch, method=method, lora_rank=lora_rank,
            objective=objective, deadline_s=parse_duration(deadline) if deadline else None, tokens=tokens,
            price_per_gpu_hour=price, min_compute_fraction=min_compute_fraction, top_k=top, mtbf_hours=mtbf_hours,
            per_stage_devices=per_stage_devices, allow_cross_node_tp=allow_cross_node_tp, attention=attention,
            fix=parse_fix(fix) if fix is not None else {}, any_engine=any_engine, priced_engine=engine,
            cluster=profile_cluster(hardware), exclude=parse_exclude(exclude),
        )
        result = make_plan(opts)
        return result, write_plan_files(result, out, export_dir)

    result, written = exit_on_error(compute)
    if as_json:
        print(json.dumps(plan_json(result)))
        return
    render_plan(result)
    if not result.runnable_here and prices_ours(result.priced_engine):
        console.print("[yellow]planned for any engine (--any-engine): marked runnable_here: false, for "
                      "Megatron-LM, NeMo or DeepSpeed (--export); `advisor train` refuses the layouts it does not "
                      "run[/yellow]")
    for line in written:
        console.print(line, highlight=False, markup=False)


def profile_cluster(hardware: str):
    """The per-device and per-link figures of a profile given as --hardware (None for a preset or a
    HardwareSpec file)."""
    path = Path(hardware)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # load_hardware has already said what is wrong with it
    return load_profile(path).cluster if looks_like_profile(data) else None


def write_plan_files(result, out: Path | None, export_dir: Path | None) -> list[str]:
    """plan.yaml for `advisor train` and the launcher files, where asked: one line per file, written
    or left out with the reason."""
    lines = []
    if out:
        if out.is_dir():
            raise UsageError(f"--out {out} is a folder: name the plan file, e.g. {out / PLAN_FILE}")
        check_out_folder(out.parent, "--out")
        result.write(out)
        lines.append(f"wrote {out}")
    if export_dir:
        check_out_folder(export_dir, "--export")
        exported = export(result, export_dir)
        lines += [f"wrote {path}" for path in exported.written]
        lines += [f"did not write {name}: {why}" for name, why in exported.skipped.items()]
    return lines


def plan_json(result) -> dict[str, Any]:
    """The `plan --json` contract: plans best first, the solver's record, stages, notes."""
    plans = [result.chosen, *result.alternatives]
    return {
        "plans": [{"layout": p.layout.model_dump(mode="json"), "estimate": p.estimate.model_dump(mode="json"),
                   "why": p.why, "meets_compute_rule": p.meets_compute_rule} for p in plans],
        "solver": result.solver,
        "stages": [s.model_dump(mode="json") for s in result.stages],
        "notes": result.notes,
        "runnable_here": result.runnable_here,
    }
