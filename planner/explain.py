"""Why a layout ranks where it does: its binding constraint and what it trades against the next."""

from __future__ import annotations

from specs.core import GiB, Estimate, HardwareSpec, Layout

_FIELDS = ("dp", "tp", "pp", "vpp", "sp", "zero", "offload", "mbs", "gas", "recompute", "method")


def binding_constraint(est: Estimate, capacity: float, min_fraction: float) -> str:
    """The constraint that stops this layout from going faster."""
    headroom = 1 - est.memory.peak / capacity
    t = est.time
    if headroom < 0.05:
        return f"memory (stage {est.memory.stage} at {100 * (1 - headroom):.0f}% of the usable capacity)"
    if est.compute_fraction < min_fraction + 0.02:
        return f"the compute rule ({100 * est.compute_fraction:.0f}% of the step computes; floor {100 * min_fraction:.0f}%)"
    parts = {"communication": t.comm_exposed_s, "pipeline bubble": t.bubble_s,
             "optimizer/offload": t.optimizer_s + t.offload_s}
    # what the named parts leave of the step: the host's launches and per-micro-batch overheads
    parts["host and launch overhead"] = max(t.step_s - t.compute_s - sum(parts.values()), 0.0)
    worst = max(parts, key=parts.get)  # type: ignore[arg-type]
    if parts[worst] < 0.01 * t.step_s:  # no overhead worth naming: the FLOPs themselves bind
        return (f"compute ({100 * est.compute_fraction:.0f}% of the step computes; only fewer FLOPs or faster "
                "kernels shorten it)")
    return f"{worst} ({100 * parts[worst] / t.step_s:.0f}% of the step)"


def describe(layout: Layout, est: Estimate) -> str:
    mem, t = est.memory, est.time
    pieces = [f"{100 * est.compute_fraction:.0f}% compute"]
    if t.comm_exposed_s:
        pieces.append(f"{100 * t.comm_exposed_s / t.step_s:.0f}% exposed comm")
    if t.bubble_s:
        pieces.append(f"{100 * t.bubble_s / t.step_s:.0f}% bubble")
    recompute = "no recomputation"
    if layout.recompute != "none":
        counts = layout.recompute_layers
        recompute = f"{layout.recompute} recomputation" + (
            f" on {'/'.join(map(str, counts))} layers per stage" if counts else "")
    return (f"peak {mem.peak / GiB:.1f} of {mem.capacity / GiB:.1f} GiB, {recompute}; step {t.step_s:.3g} s "
            f"({', '.join(pieces)}), MFU {100 * est.throughput.mfu:.0f}%")


def why(layout: Layout, est: Estimate, capacity: float, min_fraction: float,
        best: tuple[Layout, Estimate] | None) -> str:
    text = f"{describe(layout, est)}; bound by {binding_constraint(est, capacity, min_fraction)}"
    if best is None:
        return "best under the cost model: " + text
    other_layout, other = best
    changed = [f"{f} {getattr(other_layout, f)}->{getattr(layout, f)}" for f in _FIELDS
               if getattr(layout, f) != getattr(other_layout, f)]
    slower = est.time.step_s / other.time.step_s - 1
    return (f"{100 * slower:.1f}% slower than the best ({', '.join(changed) or 'same shape, other split'}): "
            + text)


def preset_note(hw: HardwareSpec) -> str | None:
    """What a plan priced on a hardware preset (datasheet peaks, typical efficiencies), not on a
    profile of the machine, should say about it: how far the preset was off where it was checked."""
    if hw.source != "preset":
        return None
    check = hw.checked
    record = (f"where checked ({check.rows} {check.against}), its prices were off by {100 * check.median_abs_error:.0f}% "
              f"at the median and {100 * check.worst_error:+.0f}% at worst" if check else
              "it has never been checked against measured runs")
    return (f"priced on the {hw.name} preset, not on a profile of this machine; {record}. `advisor profile --out profile.json` on the machine, then --hardware profile.json, "
            "prices it from measurements")
