"""`advisor train PLAN --dry-run`: the trainer's checks of every stage's layout, and what each
rank holds (trainer/dry_run.py), shown next to the cost model's prediction."""

from __future__ import annotations

import json
from typing import TextIO

from rich.table import Table

from advisor.cli.common import console
from advisor.cli.render import format_gib
from specs.plan_file import Plan
from trainer.dry_run import LayoutCheck, dry_run, where


def run_dry(plan: Plan, as_json: bool, terminal: TextIO) -> None:
    """Check and show; a layout the trainer cannot run raises UsageError (exit 2) naming its stage."""
    checks = dry_run(plan)
    if as_json:
        print(json.dumps({"ok": True, "engine_choice": plan.engine, "stages": [c.as_json() for c in checks]}),
              file=terminal)
        return
    for check in checks:
        _render(check)
    console.print(f"dry run: {len(checks)} layout{'s' if len(checks) != 1 else ''} checked on the meta device; "
                  "advisor train runs this plan as shown")


def _render(check: LayoutCheck) -> None:
    table = Table(title=f"{where(check.stage)}: {check.layout.short()} on {check.devices} device"
                        f"{'s' if check.devices != 1 else ''}, engine {check.engine}", title_justify="left")
    for column in ("pp stage", "layers", "GiB per rank", "parameters", "gradients", "optimizer", "host"):
        table.add_column(column, justify="left" if column == "GiB per rank" else "right")
    for rank in check.ranks:
        p = rank.predicted
        table.add_row(str(rank.pipeline_stage), str(rank.decoder_layers), "holds", format_gib(rank.parameters),
                      format_gib(rank.gradients), format_gib(rank.optimizer), format_gib(rank.host))
        table.add_row("", "", "cost model", format_gib(p["weights"]), format_gib(p["gradients"]),
                      format_gib(p["optimizer"]), format_gib(p["host"]), style="dim")
    console.print(table)
