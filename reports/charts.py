"""Charts as PNG bytes (matplotlib, Agg backend, no pyplot global state).

Figures are drawn at a width that stays legible when a phone shrinks them to ~360 px: few
series, large fonts, legends outside the data.
"""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any, Callable

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

if TYPE_CHECKING:
    from reports.capacity import Option, Scaling

GiB = 1024**3
WIDTH = 5.6  # inches: at 140 dpi, 11 pt text stays ~11 CSS px on a 390 px phone screen
PALETTE = ["#2f5fb3", "#c7591a", "#2e8b57", "#8e44ad", "#b8860b", "#c0392b", "#16a085", "#7f8c8d"]
METHOD_HATCH = {"full": None, "lora": "//", "qlora": ".."}
STYLE: dict[str, Any] = {"font.size": 12, "axes.titlesize": 12, "axes.labelsize": 12, "legend.fontsize": 11,
                         "xtick.labelsize": 11, "ytick.labelsize": 11,
                         "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
                         "grid.alpha": 0.3}


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=140, metadata={"Software": None})
    return buf.getvalue()


def _figure(width: float, height: float) -> Figure:
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(width, height), layout="constrained")
    return fig


def _colors(names: list[str]) -> dict[str, str]:
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(dict.fromkeys(names))}


def _short(v: float) -> str:
    """A bar label: 1,234 or 12.3 or 0.0456."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _log_axis(axis: Any) -> None:
    """Ticks at 1, 2 and 5 per decade, labelled 2k / 5k / 10k: readable over one or many decades."""
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(_thousands))
    axis.set_minor_formatter(NullFormatter())


def _thousands(x: float, _pos: int) -> str:
    if x >= 1e6:
        return f"{x / 1e6:g}M"
    if x >= 1e3:
        return f"{x / 1e3:g}k"
    return f"{x:g}"


# ------------------------------------------------------------------------------------------------
# capacity report


def option_bars(options: list["Option"], metric: str, xlabel: str, title: str, chosen: str | None) -> bytes:
    """One horizontal bar per fitting option (wall-clock days, GPU-hours or dollars)."""
    with matplotlib.rc_context(STYLE):
        fitting = [o for o in options if o.fits and math.isfinite(o.wall_s)]
        colors = _colors([o.hardware for o in options])
        fig = _figure(WIDTH, 1.2 + 0.32 * max(1, len(fitting)))
        ax = fig.add_subplot()
        labels = [f"{o.gpus} x {o.hardware} {o.method}" for o in fitting]
        values = [getattr(o, metric) for o in fitting]
        bars = ax.barh(range(len(fitting)), values, color=[colors[o.hardware] for o in fitting],
                       hatch=None, edgecolor="white")
        for bar, o in zip(bars, fitting):
            if METHOD_HATCH.get(o.method):
                bar.set_hatch(METHOD_HATCH[o.method])
            if o.key == chosen:
                bar.set_edgecolor("black")
                bar.set_linewidth(2)
        ax.set_yticks(range(len(fitting)), labels)
        ax.invert_yaxis()
        positive = [v for v in values if v > 0]
        if positive and max(positive) / min(positive) > 20:
            ax.set_xscale("log")
            _log_axis(ax.xaxis)
            xlabel += " (log scale)"
        else:
            ax.xaxis.set_major_formatter(FuncFormatter(_thousands))
        ax.set_xlabel(xlabel)
        ax.set_title(title, loc="left")
        for i, v in enumerate(values):
            ax.annotate(_short(v), (v, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=10)
        ax.margins(x=0.25)
        ax.grid(axis="y", visible=False)
        return _png(fig)


def scaling_chart(curves: list["Scaling"], rule: float) -> bytes:
    """Tokens/s against GPUs (log-log) per hardware, one panel per method, with the linear ideal
    from the smallest fitting count and the knee ringed."""
    with matplotlib.rc_context(STYLE):
        methods = list(dict.fromkeys(c.method for c in curves))
        colors = _colors([c.hardware for c in curves])
        fig = _figure(WIDTH, 3.6 * max(1, len(methods)))
        axes = fig.subplots(max(1, len(methods)), 1, squeeze=False)[:, 0]
        for ax, method in zip(axes, methods):
            for curve in (c for c in curves if c.method == method):
                gpus = [g for g, _, _ in curve.points]
                tps = [t for _, t, _ in curve.points]
                color = colors[curve.hardware]
                ax.plot(gpus, tps, "o-", color=color, label=curve.hardware, lw=2)
                ideal = [tps[0] * g / gpus[0] for g in gpus]
                ax.plot(gpus, ideal, ":", color=color, lw=1.5)
                if curve.knee is not None:
                    knee_tps = next(t for g, t, _ in curve.points if g == curve.knee)
                    ax.plot([curve.knee], [knee_tps], "o", ms=14, mfc="none", mec=color, mew=2)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _p: f"{x:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            _log_axis(ax.yaxis)
            ax.set_xlabel("GPUs")
            ax.set_ylabel("tokens/s")
            ax.set_title(f"{method}: predicted (solid), linear (dotted), knee (ring)", loc="left")
            ax.legend(loc="upper left", frameon=False)
        return _png(fig)


def method_chart(options: list["Option"], methods: list[str]) -> bytes:
    """GPU-hours of each method side by side for every (hardware, GPU count)."""
    with matplotlib.rc_context(STYLE):
        groups = list(dict.fromkeys((o.hardware, o.gpus) for o in options
                                    if o.fits and math.isfinite(o.wall_s)))
        fig = _figure(WIDTH, 1.4 + 0.42 * max(1, len(groups)) * max(1, len(methods)) / 2)
        ax = fig.add_subplot()
        height = 0.8 / max(1, len(methods))
        mcolors = _colors(methods)
        for j, method in enumerate(methods):
            ys, xs = [], []
            for i, (hw, gpus) in enumerate(groups):
                match = [o for o in options if (o.hardware, o.gpus, o.method) == (hw, gpus, method) and o.fits
                         and math.isfinite(o.wall_s)]
                if match:
                    ys.append(i + (j - (len(methods) - 1) / 2) * height)
                    xs.append(match[0].gpu_hours)
            ax.barh(ys, xs, height=height * 0.95, color=mcolors[method], label=method)
        ax.set_yticks(range(len(groups)), [f"{g} x {hw}" for hw, g in groups])
        ax.invert_yaxis()
        hours = [o.gpu_hours for o in options if o.fits and math.isfinite(o.wall_s)]
        xlabel = "GPU-hours (incl. checkpoints and failures)"
        if hours and max(hours) / min(hours) > 20:
            ax.set_xscale("log")
            _log_axis(ax.xaxis)
            xlabel = "GPU-hours, log scale (incl. overheads)"
        else:
            ax.xaxis.set_major_formatter(FuncFormatter(_thousands))
        ax.set_xlabel(xlabel)
        ax.set_title("GPU-hours by method", loc="left")
        fig.legend(loc="outside lower center", ncols=len(methods), frameon=False)
        ax.grid(axis="y", visible=False)
        return _png(fig)


def memory_chart(options: list["Option"], margin: float) -> bytes:
    """Predicted peak as a share of usable memory per fitting option."""
    with matplotlib.rc_context(STYLE):
        fitting = [o for o in options if o.fits]
        colors = _colors([o.hardware for o in options])
        fig = _figure(WIDTH, 1.2 + 0.32 * max(1, len(fitting)))
        ax = fig.add_subplot()
        shares = [100 * o.peak_bytes / o.capacity_bytes for o in fitting]
        ax.barh(range(len(fitting)), shares, color=[colors[o.hardware] for o in fitting])
        ax.axvline(100, color="#8a1c1c", lw=1.5)
        ax.axvline(100 * (1 - margin), color="#8a1c1c", lw=1, ls="--")
        ax.set_yticks(range(len(fitting)), [f"{o.gpus} x {o.hardware} {o.method}" for o in fitting])
        ax.invert_yaxis()
        ax.set_xlim(0, 105)
        ax.set_xlabel("peak, % of usable memory")
        ax.set_title("memory headroom", loc="left")
        ax.grid(axis="y", visible=False)
        return _png(fig)


# ------------------------------------------------------------------------------------------------
# run report


def _plot_by_stage(ax: Any, steps: list[int], values: list[float], stages: list[str]) -> None:
    """One line per curriculum stage, in the stage's colour."""
    colors = _colors(stages)
    for stage in colors:
        xs = [s for s, st in zip(steps, stages) if st == stage]
        ys = [v for v, st in zip(values, stages) if st == stage]
        ax.plot(xs, ys, "-", color=colors[stage], lw=1.6, label=stage)


def loss_chart(steps: list[int], losses: list[float], stages: list[str], spikes: list[tuple[int, float]],
               rollbacks: list[int]) -> bytes:
    """Training loss per optimizer step, coloured by stage; spikes crossed, rollbacks as lines."""
    with matplotlib.rc_context(STYLE):
        fig = _figure(WIDTH, 3.8)
        ax = fig.add_subplot()
        _plot_by_stage(ax, steps, losses, stages)
        if spikes:
            ax.plot([s for s, _ in spikes], [v for _, v in spikes], "x", color="#c0392b", ms=9, mew=2,
                    label="spike (rejected)")
        for i, step in enumerate(rollbacks):
            ax.axvline(step, color="#c0392b", ls="--", lw=1, label="rollback" if i == 0 else None)
        finite = [v for v in losses + [v for _, v in spikes] if math.isfinite(v) and v > 0]
        if finite and max(finite) / min(finite) > 20:
            ax.set_yscale("log")
            # the data's own decades, within 1e-30..1e30 (a loss beyond is off the chart, in the tables):
            # left to itself, a log axis over zeros beside a 1e265 spike, or from 1e-12 to 1e300, reached
            # past float range and its tick locator overflowed (found by test_report_extremes)
            ax.set_ylim(max(min(finite) / 2, 1e-30), min(max(finite) * 2, 1e30))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("training loss")
        ax.set_title("loss per stage", loc="left")
        ax.legend(loc="best", frameon=False, ncols=2, fontsize=10)
        return _png(fig)


def lr_chart(steps: list[int], lrs: list[float], stages: list[str]) -> bytes:
    with matplotlib.rc_context(STYLE):
        fig = _figure(WIDTH, 3.0)
        ax = fig.add_subplot()
        _plot_by_stage(ax, steps, lrs, stages)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("learning rate")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax.set_title("learning rate: re-warmed at each stage start, then decayed", loc="left")
        ax.legend(loc="upper right", frameon=False, ncols=2)
        return _png(fig)


def predicted_measured_chart(rows: list[tuple[str, float | None, float | None]]) -> bytes:
    """One small panel per quantity: predicted and measured side by side."""
    with matplotlib.rc_context(STYLE):
        shown = [r for r in rows if r[1] is not None or r[2] is not None]
        fig = _figure(WIDTH, 2.8)
        axes = fig.subplots(1, max(1, len(shown)), squeeze=False)[0]
        for ax, (name, predicted, measured) in zip(axes, shown):
            values = [predicted or 0.0, measured or 0.0]
            ax.bar([0, 1], values, color=["#9bb3dd", "#2f5fb3"])
            ax.set_xticks([0, 1], ["predicted", "measured"])
            ax.set_title(name, fontsize=10)
            ax.yaxis.set_major_formatter(FuncFormatter(_thousands))
            for i, v in enumerate(values):
                ax.annotate(_short(v), (i, v), xytext=(0, 2), textcoords="offset points", ha="center", fontsize=10)
            ax.margins(y=0.15)
            ax.grid(axis="x", visible=False)
        return _png(fig)


def _grouped_bars(ax: Any, groups: list[str], series: list[str],
                  value_of: Callable[[str, str], tuple[float, float] | None]) -> None:
    """One bar per series in each group, side by side; value_of(group, series) gives the height and an
    error bar (0: none), or None for no bar."""
    colors = _colors(series)
    width = 0.8 / max(1, len(series))
    for j, name in enumerate(series):
        bars = [(i + (j - (len(series) - 1) / 2) * width, found) for i, group in enumerate(groups)
                if (found := value_of(group, name)) is not None]
        ax.bar([x for x, _ in bars], [v for _, (v, _e) in bars], width=width * 0.95, color=colors[name], label=name,
               yerr=[e for _, (_v, e) in bars] if any(e for _, (_v, e) in bars) else None, capsize=2)
    ax.set_xticks(range(len(groups)), groups)
    ax.grid(axis="x", visible=False)


def eval_chart(after_stage: list[str], skills: list[str], losses: dict[tuple[str, str], float]) -> bytes:
    """Eval loss per skill after each stage: forgetting shows as a bar that grows later."""
    with matplotlib.rc_context(STYLE):
        fig = _figure(WIDTH, 3.4)
        ax = fig.add_subplot()
        _grouped_bars(ax, after_stage, skills,
                      lambda stage, skill: (losses[(stage, skill)], 0.0) if (stage, skill) in losses else None)
        ax.set_xlabel("evaluated after stage")
        ax.set_ylabel("eval loss")
        ax.set_title("per-skill evaluation (lower is better)", loc="left")
        fig.legend(loc="outside lower center", frameon=False, ncols=min(4, len(skills)), title="skill")
        return _png(fig)


def exact_match_chart(after_stage: list[str], skills: list[str], shares: dict[tuple[str, str], float]) -> bytes:
    """Exact match per skill after each stage: a skill learned in its stage, forgotten later, healed."""
    with matplotlib.rc_context(STYLE):
        fig = _figure(WIDTH, 3.4)
        ax = fig.add_subplot()
        _grouped_bars(ax, after_stage, skills,
                      lambda stage, skill: (100 * shares[(stage, skill)], 0.0) if (stage, skill) in shares else None)
        ax.set_xlabel("evaluated after stage")
        ax.set_ylabel("exact match (%)")
        ax.set_ylim(0, 100)
        ax.set_title("per-skill exact match (higher is better)", loc="left")
        fig.legend(loc="outside lower center", frameon=False, ncols=min(4, len(skills)), title="skill")
        return _png(fig)


def variant_chart(variants: list[str], skills: list[str], values: dict[tuple[str, str], tuple[float, float]]) -> bytes:
    """Final eval loss per skill for each curriculum variant: mean over seeds, the spread as an error bar."""
    with matplotlib.rc_context(STYLE):
        fig = _figure(WIDTH, 3.6)
        ax = fig.add_subplot()
        _grouped_bars(ax, skills, variants, lambda skill, variant: values.get((variant, skill)))
        ax.set_xlabel("skill")
        ax.set_ylabel("final eval loss")
        ax.set_title("curriculum variants at equal tokens (lower is better)", loc="left")
        fig.legend(loc="outside lower center", frameon=False, ncols=min(3, len(variants)))
        return _png(fig)
