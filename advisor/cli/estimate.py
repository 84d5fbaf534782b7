"""`advisor estimate`: the cost model's memory and step time for one layout."""

from __future__ import annotations

from typing import Optional

import typer

from specs.capabilities import config_shape, cost_engine, priced_engine_problem, runnable_problem, prices_ours
from advisor.cli.common import LAYOUT_HELP, MIN_COMPUTE_FRACTION, PRICED_ENGINE_HELP, TRUST_REMOTE_CODE, exit_on_error
from advisor.cli.render import render_estimate
from specs.errors import UsageError
from specs.core import (MAX_DEVICES_PER_NODE, MAX_NODES, Estimate, check_number, check_seq_fits, parse_layout_string,
                        resolve_layout)
from planner.cost_model import estimate as run_estimate
from presets import load_hardware, load_model

HELP = "Predict per-device memory and step time of one layout, before anything runs.\n\n" + LAYOUT_HELP


def estimate(
    model: str = typer.Option(..., "--model", "-m", help="model preset, HF config.json, or model folder"),
    hardware: str = typer.Option(..., "--hardware", "-H", help="hardware preset or profile.json"),
    layout: Optional[str] = typer.Option(
        None, "--layout", "-l", help="e.g. 'tp=8,pp=4,zero=1,mbs=1,gas=16,recompute=selective' (default: every key's "
        "default)"),
    nodes: Optional[int] = typer.Option(
        None, "--nodes", min=1, max=MAX_NODES,
        help="number of nodes (default: 1, or dp*tp*pp when the layout sets dp)"),
    gpus_per_node: Optional[int] = typer.Option(
        None, "--gpus-per-node", min=1, max=MAX_DEVICES_PER_NODE, help="devices per node (default: the hardware's)"),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="tokens per sequence (layout seq)"),
    attention: Optional[str] = typer.Option(
        None, "--attention", help="flash | sdpa | eager (default: flash on GPUs, sdpa on CPU)"),
    min_compute_fraction: float = typer.Option(
        MIN_COMPUTE_FRACTION, "--min-compute-fraction", help="Amdahl rule: compute share of every device's step"),
    packed: bool = typer.Option(
        False, "--packed", help="rows pack several documents, as `advisor train` packs its data: priced with "
                                "the document mask and the expanded key/value heads that SDPA then keeps"),
    engine: str = typer.Option("ours", "--engine", help=PRICED_ENGINE_HELP),
    as_json: bool = typer.Option(False, "--json", help="print exactly one JSON object (the contract)"),
    trust_remote_code: bool = TRUST_REMOTE_CODE,
) -> None:
    exit_on_error(lambda: check_number(min_compute_fraction, "--min-compute-fraction", ge=0, le=1))
    exit_on_error(lambda: _check_layout_given(layout))
    result: Estimate = exit_on_error(
        lambda: estimate_layout(model, hardware, layout or "", nodes, gpus_per_node, seq_len, attention, packed,
                                engine, trust_remote_code))
    if as_json:
        print(result.model_dump_json())
        return
    render_estimate(result, min_compute_fraction)


def _check_layout_given(layout: str | None) -> None:
    """An empty --layout is a slip (a shell variable that was not set), not a request for the defaults."""
    if layout is not None and not layout.strip():
        raise UsageError("--layout is empty: give key=value items, e.g. 'tp=2,mbs=4', or leave --layout out for "
                         "the defaults")


def estimate_layout(model: str, hardware: str, layout: str, nodes: int | None, gpus_per_node: int | None,
                    seq_len: int | None, attention: str | None, packed: bool = False, engine: str = "ours",
                    trusted: bool = False) -> Estimate:
    """Resolve the presets and the layout on its device count, then ask the cost model to price it
    as `engine` (specs.capabilities PRICED_ENGINES) runs it. `trusted`: --trust-remote-code."""
    priced = cost_engine(engine)
    hw = load_hardware(hardware)
    spec = load_model(model, trusted)
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
    if seq_len is not None or "seq" in given:  # the default 2048 is not the user's choice
        check_seq_fits(spec, lay.seq, "--seq-len" if seq_len is not None else "layout seq")
    problem = priced_engine_problem(engine, lay)
    if problem:
        raise UsageError(problem)
    result = run_estimate(spec, hw, lay, attention=attention, packed=packed, engine=priced)
    if not prices_ours(engine):
        result.notes.append(f"priced as {engine} runs it (--engine {engine}), not as advisor train would")
        return result
    problem = runnable_problem(lay, config_shape(spec.hf_config), hw.device_type)
    if problem:  # priced all the same: users of other engines estimate too, but they are told
        result.notes.append(f"advisor train does not run this layout: {problem}")
    return result
