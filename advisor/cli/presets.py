"""`advisor presets`: list the hardware, model and task presets."""

from __future__ import annotations

from typing import Any, Optional

import typer
from rich.table import Table

from advisor.cli.common import console, exit_on_error, print_or_render
from presets import KINDS, preset_data, preset_names


def presets(
    kind: Optional[str] = typer.Argument(None, help="hardware, models or tasks (default: all)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """List the hardware, model and task presets that ship with advisor."""
    print_or_render(exit_on_error(lambda: preset_listing(kind)), as_json, render_listing)


def render_listing(listing: dict[str, list[dict[str, Any]]]) -> None:
    for k, rows in listing.items():
        table = Table(title=f"{k} presets", title_justify="left")
        table.add_column("name", style="bold")
        table.add_column("description")
        for row in rows:
            table.add_row(row["name"], row["description"])
        console.print(table)


def preset_listing(kind: str | None) -> dict[str, list[dict[str, Any]]]:
    """Name and description of every preset of `kind` (every kind when None)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for k in [kind] if kind else list(KINDS):
        out[k] = [{"name": name, "description": preset_data(k, name).get("description", "")}
                  for name in preset_names(k)]
    return out
