"""One progress display for a whole `advisor run` or `advisor train`: a bar for the run with its time
left, and a bar for the part running now (profiling, a verification trial, training).

The workers print nothing to the console (advisor/cli/quiet.py), so the display is drawn here, in
the CLI process, from what the run writes anyway: a part that trains follows the last line of its
metrics.jsonl (rank 0 appends one per optimizer step, in this process or in a torchrun worker). The
run's length is estimated in seconds from the plan (predicted step time x steps, plus a start-up
guess per part). The time left scales the estimate still ahead by how long the finished share
actually took, and takes the part running now at its measured step time (metrics.jsonl's step_s),
so a cost model that is off by 2x gives an ETA that is right once a few steps ran.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn

from specs.run_dir import last_json_line

POLL_S = 0.5  # how often metrics.jsonl is read; redraws of the live display hold the GIL
TRAIN_STARTUP_S = 20.0  # a guess at training's start-up (processes, imports, engine) and evaluations


def training_work(plan: Any, max_steps_per_stage: int | None) -> tuple[int, float, float]:
    """A plan's training: its steps (after the cap), predicted step time and start-up guess."""
    steps = sum(min(stage.steps, max_steps_per_stage or stage.steps) for stage in plan.stages)
    return steps, plan.chosen.estimate.time.step_s, TRAIN_STARTUP_S


def training_estimate_s(plan: Any, max_steps_per_stage: int | None) -> float:
    steps, step_s, startup_s = training_work(plan, max_steps_per_stage)
    return startup_s + steps * step_s


class RunProgress:
    """The display; `part` blocks advance it. Disabled, it draws nothing and costs nothing."""

    def __init__(self, console: Console, enabled: bool, title: str) -> None:
        self.enabled = enabled
        self.bars = Progress(TextColumn("{task.description:<26}"), BarColumn(bar_width=32),
                             TextColumn("{task.fields[detail]}"), console=console, disable=not enabled,
                             transient=False, refresh_per_second=2,
                             # rich would send sys.stdout/err, where third-party prints go, to the terminal
                             redirect_stdout=False, redirect_stderr=False)
        self.run = self.bars.add_task(title, total=None, detail="")
        self.estimate_s = 0.0  # the whole run's work, in estimated seconds
        self.done_s = 0.0  # estimated seconds of the parts finished
        self.clock: float | None = None  # when the estimated work began

    def __enter__(self) -> "RunProgress":
        self.bars.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.clock is not None and exc[0] is None:  # the display's last frame stays on the console
            self.bars.update(self.run, detail=f"took {_clock(time.perf_counter() - self.clock)}")
        self.bars.__exit__(*exc)

    def expect(self, estimate_s: float) -> None:
        """The work ahead, in estimated seconds: from here on the run bar shows its share and an ETA."""
        self.estimate_s, self.done_s, self.clock = estimate_s, 0.0, time.perf_counter()
        self.bars.update(self.run, total=estimate_s, completed=0)

    @contextlib.contextmanager
    def part(self, name: str, steps: int, step_s: float, startup_s: float,
             metrics: Path | None = None) -> Iterator[None]:
        """A part of `steps` steps estimated at `startup_s + steps * step_s`; when `metrics` is given
        its steps are followed there as they happen, else the part counts once it is over."""
        bar = self.bars.add_task(name, total=steps, detail=f"{steps} steps")
        watcher = _Watcher(self, bar, steps, step_s, startup_s, metrics) if metrics and self.enabled else None
        try:
            yield
        finally:
            if watcher is not None:
                watcher.stop()
            self.done_s += startup_s + steps * step_s
            self._show_run(self.done_s)
            self.bars.remove_task(bar)

    def training(self, plan: Any, max_steps_per_stage: int | None, metrics: Path) -> contextlib.AbstractContextManager:
        """Training `plan` as a part, followed in its run's metrics.jsonl."""
        return self.part("train", *training_work(plan, max_steps_per_stage), metrics)

    @contextlib.contextmanager
    def profiling(self) -> Iterator["ProfileBar"]:
        """A bar for the profiler's own progress callbacks (before the plan, so outside the estimate)."""
        bar = ProfileBar(self.bars)
        try:
            yield bar
        finally:
            self.bars.remove_task(bar.task)

    def _show_run(self, done_s: float, part_left: tuple[float, float] | None = None) -> None:
        """The run bar at `done_s` estimated seconds done. Time left: the estimate still ahead, scaled
        by elapsed / done; or, within a part whose steps are measured (`part_left`: its estimated
        and its measured seconds left), that part's measured rest plus the scaled parts after it."""
        if self.clock is None or not self.estimate_s:
            return
        elapsed = time.perf_counter() - self.clock
        detail = ""
        if done_s > 0:
            ahead_s, measured_s = part_left or (0.0, 0.0)
            left = max(0.0, self.estimate_s - done_s - ahead_s) * elapsed / done_s + measured_s
            detail = f"about {_clock(left)} left"
        self.bars.update(self.run, completed=min(done_s, self.estimate_s), detail=detail)


class ProfileBar:
    """The profiler's progress callbacks (`total`, `step`) drawn as one bar of the display."""

    def __init__(self, bars: Progress) -> None:
        self.bars, self.task = bars, bars.add_task("profile", total=None, detail="")

    def total(self, units: int) -> None:
        self.bars.update(self.task, total=units)

    def step(self, what: str) -> None:
        self.bars.update(self.task, advance=1, detail=what)


class _Watcher:
    """A thread following one part's metrics.jsonl until stopped."""

    def __init__(self, display: RunProgress, bar: TaskID, steps: int, step_s: float, startup_s: float,
                 metrics: Path) -> None:
        self.display, self.bar, self.steps, self.step_s, self.startup_s = display, bar, steps, step_s, startup_s
        self.metrics = metrics
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="progress", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()

    def _follow(self) -> None:
        while not self.stopped.wait(POLL_S):
            record = last_record(self.metrics)
            if record is None:
                continue
            step = min(int(record.get("step", 0)), self.steps)
            detail = (f"step {step}/{self.steps}  {record.get('stage', '')}  loss {record.get('loss', float('nan')):.3f}"
                      f"  {record.get('tokens_per_s') or 0:,.0f} tok/s")
            self.display.bars.update(self.bar, completed=step, detail=detail)
            ahead = self.steps - step
            measured_s = ahead * float(record.get("step_s") or self.step_s)  # the last step's own time
            self.display._show_run(self.display.done_s + self.startup_s + step * self.step_s,
                                   (ahead * self.step_s, measured_s))


def last_record(path: Path) -> dict[str, Any] | None:
    """The last whole JSON line of `path` (None while there is none)."""
    return last_json_line(path)


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    return f"{minutes}:{secs:02d}"
