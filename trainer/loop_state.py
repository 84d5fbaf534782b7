"""What a resume needs besides the engine: where the curriculum and its data stand.

One `LoopState` object is shared by the loop's components for the whole run; a restore fills it in
place (`take`), so that no component holds a stale copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class LoopState:
    stage: int = 0
    step_in_stage: int = 0
    global_step: int = 0
    positions: list[int] = field(default_factory=list)
    skips: list[list[int]] = field(default_factory=list)  # [stage, start, end) data windows skipped
    lr_scale: float = 1.0
    rollbacks: int = 0  # written at each save for the checkpoint's readers; the count is Recovery.rollbacks
    spike: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] | None = None  # the layout an OOM fallback switched to (None: the plan's)
    oom_fallbacks: int = 0
    padding: dict[str, list[int]] = field(default_factory=dict)  # stage -> [tokens, slots, slots unbucketed]
    engine_layout: dict[str, Any] | None = None  # the layout whose engine wrote the checkpoint (None: before this key)
    stage_steps: list[int] = field(default_factory=list)  # each started stage's steps, as the run sized it

    def take(self, saved: dict[str, Any]) -> None:
        """Become the state a checkpoint saved (keys it lacks: their defaults)."""
        loaded = LoopState(**saved)
        for f in fields(self):
            setattr(self, f.name, getattr(loaded, f.name))


def advance(position: int, count: int, stage: int, skips: list[list[int]]) -> int:
    """The data position after consuming `count` sequences, jumping over skipped windows (in the
    order they were skipped: a jump may land in a later window, which is jumped too)."""
    position += count
    for s, start, end in skips:
        if s == stage and start <= position < end:
            position = end
    return position


def first_position(position: int, stage: int, skips: list[list[int]]) -> int:
    """`position`, or the end of the skipped window of `stage` it falls in."""
    for s, start, end in skips:
        if s == stage and start <= position < end:
            return end
    return position
