"""One report, two renderings: a self-contained HTML page and its Markdown twin.

A report is built once as a list of blocks (headings, paragraphs, tables, figures); `to_html`
and `to_markdown` render the same blocks, so the twins cannot drift apart. Every number in a
table keeps its raw value next to its text (`data-key`, `data-value`), so that tests and scripts
can check the page against the planner without parsing prose.

The page loads nothing: charts are PNG data URIs, the CSS is inline, and a Content-Security-Policy
forbids every other source, so a stray link would fail loudly instead of leaking a request.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from pathlib import Path

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

CSS = """
:root { color-scheme: light; }
* { box-sizing: border-box; }
body { margin: 0; padding: 0 12px 40px; color: #1b1f24; background: #fff;
       font: 16px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       -webkit-text-size-adjust: 100%; }
main { max-width: 1080px; margin: 0 auto; }
h1 { font-size: 1.45rem; line-height: 1.25; margin: 1.2rem 0 .4rem; }
h2 { font-size: 1.15rem; margin: 2rem 0 .5rem; padding-bottom: .2rem; border-bottom: 1px solid #d8dde3; }
p, li { max-width: 72ch; overflow-wrap: anywhere; }
.sub { color: #57606a; margin-top: 0; }
.callout { background: #eef4ff; border-left: 4px solid #2f5fb3; padding: .6rem .9rem; border-radius: 4px; }
.risk { background: #fff6e5; border-left: 4px solid #c77800; padding: .6rem .9rem; border-radius: 4px; }
.scroll { overflow-x: auto; -webkit-overflow-scrolling: touch; margin: .5rem 0 1rem; }
table { border-collapse: collapse; font-size: .875rem; }
p.caption { color: #57606a; font-size: .875rem; margin: .6rem 0 0; }
th, td { padding: .3rem .55rem; border-bottom: 1px solid #e6e9ed; text-align: left; vertical-align: top; }
th { background: #f5f7f9; white-space: nowrap; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
td.text { white-space: normal; overflow-wrap: anywhere; }
td.wide { min-width: 13rem; }
tr.bad td { color: #8a1c1c; }
tr.chosen td { background: #eef8ee; font-weight: 600; }
figure { margin: 1rem 0; }
figure img { display: block; width: 100%; max-width: 760px; height: auto; }
figcaption { color: #57606a; font-size: .875rem; }
code { font-size: .85em; background: #f5f7f9; padding: 0 .2em; border-radius: 3px; overflow-wrap: anywhere; }
@media (max-width: 600px) { body { font-size: 15px; padding: 0 8px 32px; } th, td { padding: .25rem .4rem; } }
"""


def format_number(x: float | None) -> str:
    """About three significant digits, thousands separated; exponent form only from 1e15 up.

    Total over every float: None is "-", nan "nan", infinities "inf"/"-inf", and a value that rounds
    to zero at eight decimals reads "0" (a fitted factor at its bound is exactly 0.0).
    """
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    ax = abs(x)
    if ax >= 1e15:
        return f"{x:.2e}"
    if ax >= 100:
        return f"{x:,.0f}"
    if ax >= 10:
        return f"{x:,.1f}"
    if ax >= 1:
        return f"{x:,.2f}"
    if ax < 5e-9:
        return "0"
    decimals = min(8, 2 - math.floor(math.log10(ax)))
    return f"{x:.{decimals}f}"


@dataclass
class Cell:
    text: str
    key: str | None = None  # data-key: what the number is, e.g. "h100-80g/64/full:gpu_hours"
    value: float | None = None  # data-value: the raw number
    numeric: bool = False
    wrap: bool = False  # long prose: let it wrap
    wide: bool = False  # prose that needs a readable column width even on a phone


def num(value: float | None, key: str | None = None) -> Cell:
    if value is None:
        return Cell("-", numeric=True)
    return Cell(format_number(value), key, float(value), numeric=True)


def pct(fraction: float | None, key: str | None = None, decimals: int = 1) -> Cell:
    """A fraction shown as a percentage; data-value keeps the fraction."""
    if fraction is None:
        return Cell("-", numeric=True)
    if not math.isfinite(fraction):
        return Cell(format_number(float(fraction)), key, float(fraction), numeric=True)
    return Cell(f"{100 * fraction:.{decimals}f}%", key, float(fraction), numeric=True)


def text(value: str, wrap: bool = False, wide: bool = False) -> Cell:
    return Cell(value, wrap=wrap or wide, wide=wide)


@dataclass
class Table:
    headers: list[str]
    rows: list[list[Cell]]
    id: str | None = None
    caption: str | None = None
    row_classes: list[str] = field(default_factory=list)


@dataclass
class Figure:
    name: str
    png: bytes
    caption: str


@dataclass
class Block:
    kind: str  # h2 | p | callout | risk | list | table | figure | code
    content: object
    id: str | None = None


class Document:
    def __init__(self, title: str, subtitle: str = ""):
        self.title, self.subtitle = title, subtitle
        self.blocks: list[Block] = []

    # -- building ------------------------------------------------------------------------------
    def h2(self, heading: str, id: str | None = None) -> None:
        self.blocks.append(Block("h2", heading, id))

    def p(self, body: str, id: str | None = None) -> None:
        self.blocks.append(Block("p", body, id))

    def callout(self, body: str, id: str | None = None, kind: str = "callout") -> None:
        self.blocks.append(Block(kind, body, id))

    def bullets(self, items: list[str], id: str | None = None) -> None:
        if items:
            self.blocks.append(Block("list", list(items), id))

    def code(self, body: str) -> None:
        self.blocks.append(Block("code", body))

    def table(self, table: Table) -> None:
        self.blocks.append(Block("table", table, table.id))

    def figure(self, name: str, png: bytes, caption: str) -> None:
        self.blocks.append(Block("figure", Figure(name, png, caption), f"chart-{name}"))

    @property
    def figures(self) -> list[Figure]:
        return [b.content for b in self.blocks if b.kind == "figure"]  # type: ignore[misc]

    # -- HTML ----------------------------------------------------------------------------------
    def to_html(self) -> str:
        esc = html.escape
        out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
               f'<meta http-equiv="Content-Security-Policy" content="{CSP}">',
               '<meta name="viewport" content="width=device-width, initial-scale=1">',
               f"<title>{esc(self.title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>", "<main>",
               f"<h1>{esc(self.title)}</h1>"]
        if self.subtitle:
            out.append(f'<p class="sub">{esc(self.subtitle)}</p>')
        for block in self.blocks:
            ident = f' id="{esc(block.id)}"' if block.id else ""
            if block.kind == "h2":
                out.append(f"<h2{ident}>{esc(str(block.content))}</h2>")
            elif block.kind == "p":
                out.append(f"<p{ident}>{_inline_html(str(block.content))}</p>")
            elif block.kind in ("callout", "risk"):
                out.append(f'<p{ident} class="{block.kind}">{_inline_html(str(block.content))}</p>')
            elif block.kind == "list":
                items = "".join(f"<li>{_inline_html(i)}</li>" for i in block.content)  # type: ignore[union-attr]
                out.append(f"<ul{ident}>{items}</ul>")
            elif block.kind == "code":
                out.append(f"<p><code>{esc(str(block.content))}</code></p>")
            elif block.kind == "table":
                out.append(_table_html(block.content))  # type: ignore[arg-type]
            elif block.kind == "figure":
                fig: Figure = block.content  # type: ignore[assignment]
                data = base64.b64encode(fig.png).decode("ascii")
                out.append(f'<figure{ident} data-chart="{esc(fig.name)}"><img alt="{esc(fig.caption)}" '
                           f'src="data:image/png;base64,{data}"><figcaption>{esc(fig.caption)}</figcaption></figure>')
        out += ["</main>", "</body>", "</html>"]
        return "\n".join(out) + "\n"

    # -- Markdown ------------------------------------------------------------------------------
    def to_markdown(self, chart_dir: str = "charts") -> str:
        out = [f"# {self.title}", ""]
        if self.subtitle:
            out += [f"_{self.subtitle}_", ""]
        for block in self.blocks:
            if block.kind == "h2":
                out += [f"## {block.content}", ""]
            elif block.kind in ("p", "callout"):
                out += [str(block.content), ""]
            elif block.kind == "risk":
                out += [f"> {block.content}", ""]
            elif block.kind == "list":
                out += [f"- {item}" for item in block.content] + [""]  # type: ignore[union-attr]
            elif block.kind == "code":
                out += [f"`{block.content}`", ""]
            elif block.kind == "table":
                out += _table_markdown(block.content) + [""]  # type: ignore[arg-type]
            elif block.kind == "figure":
                fig: Figure = block.content  # type: ignore[assignment]
                out += [f"![{fig.caption}]({chart_dir}/{fig.name}.png)", "", f"_{fig.caption}_", ""]
        return "\n".join(out).rstrip() + "\n"

    # -- files ---------------------------------------------------------------------------------
    def write(self, out_dir: Path, stem: str) -> list[Path]:
        """`<stem>.html`, `<stem>.md` and `charts/<name>.png`, each written aside and renamed."""
        out_dir.mkdir(parents=True, exist_ok=True)
        charts = out_dir / "charts"
        charts.mkdir(exist_ok=True)
        written = []
        for fig in self.figures:
            written.append(_write(charts / f"{fig.name}.png", fig.png))
        written.insert(0, _write(out_dir / f"{stem}.md", self.to_markdown("charts").encode()))
        written.insert(0, _write(out_dir / f"{stem}.html", self.to_html().encode()))
        return written


def _write(path: Path, data: bytes) -> Path:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def _inline_html(body: str) -> str:
    """Escape, then turn `code` spans into <code> (the only markup the reports use)."""
    parts = html.escape(body).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def _table_html(table: Table) -> str:
    esc = html.escape
    ident = f' id="{esc(table.id)}"' if table.id else ""
    rows = []
    for i, row in enumerate(table.rows):
        cls = table.row_classes[i] if i < len(table.row_classes) and table.row_classes[i] else ""
        cells = []
        for cell in row:
            attrs = ""
            if cell.numeric:
                attrs += ' class="num"'
            elif cell.wrap:
                attrs += ' class="text wide"' if cell.wide else ' class="text"'
            if cell.key is not None and cell.value is not None:
                attrs += f' data-key="{esc(cell.key)}" data-value="{cell.value!r}"'
            cells.append(f"<td{attrs}>{_inline_html(cell.text)}</td>")
        rows.append(f"<tr{f' class={chr(34)}{cls}{chr(34)}' if cls else ''}>{''.join(cells)}</tr>")
    head = "".join(f'<th scope="col">{esc(h)}</th>' for h in table.headers)
    # the caption sits outside the scrolling box, so that it wraps to the screen, not to the table
    caption = f'<p class="caption">{esc(table.caption)}</p>' if table.caption else ""
    return (f'{caption}<div class="scroll"><table{ident}><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def _md_cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def _table_markdown(table: Table) -> list[str]:
    lines = []
    if table.caption:
        lines += [f"_{table.caption}_", ""]
    lines.append("| " + " | ".join(_md_cell(h) for h in table.headers) + " |")
    aligns = ["---:" if table.rows and i < len(table.rows[0]) and table.rows[0][i].numeric else "---"
              for i in range(len(table.headers))]
    lines.append("| " + " | ".join(aligns) + " |")
    for row in table.rows:
        lines.append("| " + " | ".join(_md_cell(c.text) for c in row) + " |")
    return lines
