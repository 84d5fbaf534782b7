"""Loss-spike guard: decide, identically on every rank, whether a step went bad.

A step is a spike when its loss or gradient norm is not finite, or (after a warm-up window) the
loss or the gradient norm crosses its threshold: its running mean plus so many running standard
deviations, and so many times that mean (gradient norms are noisy early in a stage: both margins
must be crossed). The margins are the task's `spike_guard` (specs/task.py `SpikeGuardSpec`).
Running statistics are exponential moving averages updated with good steps only, so a spike does
not excuse the next.
The decision is taken from values already all-reduced (the loss is averaged over data-parallel
ranks before it reaches the guard), so every rank agrees without another collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specs.task import SpikeGuardSpec


@dataclass
class _RunningStat:
    """Exponential moving mean, and a noise scale from successive differences: a falling loss
    (the normal trend early in a stage) does not inflate it, as a deviation from the mean would."""

    decay: float
    mean: float = 0.0
    var: float = 0.0  # EMA of (x_t - x_{t-1})^2 / 2: the step-to-step noise variance
    last: float = 0.0
    count: int = 0

    def update(self, value: float) -> None:
        if self.count == 0:
            self.mean = value
        else:
            self.mean = self.decay * self.mean + (1 - self.decay) * value
            diff2 = (value - self.last) ** 2 / 2
            self.var = diff2 if self.count == 1 else self.decay * self.var + (1 - self.decay) * diff2
        self.last = value
        self.count += 1

    @property
    def std(self) -> float:
        return math.sqrt(max(self.var, 0.0))


@dataclass(frozen=True)
class _Threshold:
    """A value is out of line when it exceeds its running mean by `sigmas` deviations *and* by
    `ratio` times the mean (one margin alone trips on the noise early in a stage). A margin that is
    None is not applied; with neither, nothing finite is out of line."""

    sigmas: float | None
    ratio: float | None

    def limit(self, stat: _RunningStat) -> float:
        margins = [stat.mean + self.sigmas * stat.std] if self.sigmas is not None else []
        margins += [stat.mean * self.ratio] if self.ratio is not None else []
        return max(margins, default=math.inf)


_DEFAULTS = SpikeGuardSpec()


@dataclass
class SpikeGuard:
    warmup_steps: int = 20
    loss_threshold: _Threshold = _Threshold(sigmas=_DEFAULTS.loss_sigmas, ratio=_DEFAULTS.loss_ratio)
    grad_threshold: _Threshold = _Threshold(sigmas=_DEFAULTS.grad_norm_sigmas, ratio=_DEFAULTS.grad_norm_ratio)
    decay: float = 0.8  # ~5-step memory: the reference follows a falling loss closely
    loss: _RunningStat = field(init=False)
    grad: _RunningStat = field(init=False)

    def __post_init__(self) -> None:
        self.loss = _RunningStat(self.decay)
        self.grad = _RunningStat(self.decay)

    @classmethod
    def for_task(cls, spec: SpikeGuardSpec, warmup_steps: int) -> "SpikeGuard":
        """The guard a task's `spike_guard` setting asks for."""
        return cls(warmup_steps=warmup_steps,
                   loss_threshold=_Threshold(sigmas=spec.loss_sigmas, ratio=spec.loss_ratio),
                   grad_threshold=_Threshold(sigmas=spec.grad_norm_sigmas, ratio=spec.grad_norm_ratio))

    def check(self, loss: float, grad_norm: float) -> str | None:
        """The reason this step is a spike, or None (and the statistics absorb the step)."""
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"non-finite loss {loss} or gradient norm {grad_norm}"
        if self.loss.count >= self.warmup_steps:
            loss_limit = self.loss_threshold.limit(self.loss)
            if loss > loss_limit:
                return f"loss {loss:.4g} above {loss_limit:.4g} (running mean {self.loss.mean:.4g})"
            grad_limit = self.grad_threshold.limit(self.grad)
            if grad_norm > grad_limit:
                return f"gradient norm {grad_norm:.4g} above {grad_limit:.4g} (running mean {self.grad.mean:.4g})"
        self.loss.update(loss)
        self.grad.update(grad_norm)
        return None

    def state_dict(self) -> dict:
        return {"loss": vars(self.loss).copy(), "grad": vars(self.grad).copy()}

    def load_state_dict(self, state: dict) -> None:
        self.loss = _RunningStat(**state["loss"])
        self.grad = _RunningStat(**state["grad"])
