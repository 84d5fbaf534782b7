"""The plan file that `advisor plan --out plan.yaml` writes and `advisor train plan.yaml` runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, Field

from advisor.errors import UsageError
from advisor.specs import (MIN_COMPUTE_FRACTION, READ_CONFIG, SPEC_CONFIG, Estimate, FiniteDict, HardwareSpec, Layout,
                           ModelSpec, validate)
from advisor.task import TaskSpec

PLAN_VERSION = 1


class PlannedLayout(BaseModel):
    """One candidate: the layout, its predicted cost, and the reason it ranks where it does."""

    model_config = READ_CONFIG

    layout: Layout
    estimate: Estimate
    why: str
    meets_compute_rule: bool = True


class StagePlan(BaseModel):
    """How one curriculum stage runs: its budget in steps and its checkpoint cadence."""

    model_config = READ_CONFIG

    name: str
    method: str
    devices: int = Field(ge=1)
    layout: Layout
    tokens: int = Field(ge=0)
    steps: int = Field(ge=0)
    step_s: float = Field(ge=0)
    hours: float = Field(ge=0)
    checkpoint_every_steps: int = Field(ge=1, description="the trainer checkpoints when steps % this == 0")
    checkpoint_write_s: float = Field(ge=0)
    overhead_fraction: float = Field(ge=0, description="checkpoint + evaluation time over training time")
    flags: list[str] = Field(default_factory=list)


class Plan(BaseModel):
    model_config = SPEC_CONFIG

    version: int = PLAN_VERSION
    model: ModelSpec
    hardware: HardwareSpec
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    objective: Literal["throughput", "cost"] = "throughput"
    min_compute_fraction: float = Field(MIN_COMPUTE_FRACTION, ge=0, le=1)
    engine: Literal["auto", "deepspeed", "fsdp2"] = Field(
        "auto", description="back-end for sharded data parallelism (ZeRO): auto = DeepSpeed, or FSDP2 when tp>1")
    chosen: PlannedLayout
    alternatives: list[PlannedLayout] = Field(
        default_factory=list, description="next best layouts with the same global batch (OOM fallback)")
    task: TaskSpec | None = None
    stages: list[StagePlan] = Field(default_factory=list)
    solver: FiniteDict = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    attention: str = Field(
        "sdpa", description="the attention kernel advisor train's models run on this hardware "
                            "(advisor.capabilities.attention_implementation): advisor_documents trains "
                            "packed rows through varlen FlashAttention, with no s x s mask")
    runnable_here: bool = Field(
        True, description="false: planned with --any-engine over every engine the cost model prices "
                          "(Megatron/NeMo layouts); `advisor train` refuses it")
    priced_engine: str = Field(
        "ours", description="whose behaviour the plan's figures price (advisor.capabilities PRICED_ENGINES): ours, "
                            "or a published engine (megatron), planned for that engine and not runnable here")

    def stage_layouts(self) -> list[tuple[str | None, Layout]]:
        """What `advisor train` runs: each stage's name and layout, or (None, the chosen layout) for a
        plan without stages."""
        if self.stages:
            return [(s.name, s.layout) for s in self.stages]
        return [(None, self.chosen.layout)]

    def write(self, path: Path) -> None:
        """Write aside, then rename: a crash never leaves half a plan."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, width=110))
        tmp.replace(path)


@dataclass(frozen=True)
class Segment:
    """Consecutive curriculum stages that run one layout (devices, method and degrees): one launch
    of the trainer's ranks. At a boundary the trainer hands the full weights on (trainer/handoff.py)
    and the next segment starts its ranks with its own layout and a fresh optimizer."""

    first: int
    end: int  # one past the last stage
    layout: Layout


def stage_segments(plan: Plan) -> list[Segment]:
    """The plan's stages grouped into segments of equal layout, in order. When every stage has the
    same layout, the plan's chosen layout runs them all: it is the one `advisor run`'s verification,
    an OOM relaunch or a user's edit of the plan changes (the stages' copies are then stale)."""
    if not plan.stages or len({stage.layout.model_dump_json() for stage in plan.stages}) == 1:
        return [Segment(0, len(plan.stages), plan.chosen.layout)]
    segments: list[Segment] = []
    for index, stage in enumerate(plan.stages):
        if segments and segments[-1].layout == stage.layout:
            last = segments.pop()
            segments.append(Segment(last.first, index + 1, last.layout))
        else:
            segments.append(Segment(index, index + 1, stage.layout))
    return segments


def segment_of(plan: Plan, stage: int) -> Segment:
    """The segment that runs stage `stage` (the last one once every stage is done)."""
    segments = stage_segments(plan)
    return next((s for s in segments if s.first <= stage < s.end), segments[-1])


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"plan file not found: {path}") from None
    except (OSError, ValueError, yaml.YAMLError) as exc:  # ValueError: not UTF-8
        raise UsageError(f"cannot read plan file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"plan file {path}: expected a mapping")
    if data.get("version") != PLAN_VERSION:
        raise UsageError(f"plan file {path}: version {data.get('version')} is not {PLAN_VERSION}; plan again")
    return validate(Plan, data, f"plan file {path}")
