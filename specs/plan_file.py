"""The plan file that `advisor plan --out plan.yaml` writes and `advisor train plan.yaml` runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, Field

from specs.errors import UsageError
from specs.core import (MAX_DEGREE, MAX_DEVICES_PER_NODE, MAX_NODES, MAX_STEPS, MAX_TOKENS, MIN_COMPUTE_FRACTION,
                        SPEC_CONFIG, Estimate, FiniteDict, HardwareSpec, Layout, ModelSpec, read_user_mapping,
                        refuse_non_finite, validate)
from specs.task import StageName, TaskSpec

PLAN_VERSION = 1
MAX_SECONDS = 1e12  # a step, a checkpoint write, a stage in hours: beyond any run, yet finite


class PlannedLayout(BaseModel):
    """One candidate: the layout, its predicted cost, and the reason it ranks where it does."""

    model_config = SPEC_CONFIG

    layout: Layout
    estimate: Estimate
    why: str
    meets_compute_rule: bool = True


class StagePlan(BaseModel):
    """How one curriculum stage runs: its budget in steps and its checkpoint cadence."""

    model_config = SPEC_CONFIG

    name: StageName
    method: str
    devices: int = Field(ge=1, le=MAX_DEGREE ** 2)
    layout: Layout
    tokens: int = Field(ge=0, le=MAX_TOKENS)
    steps: int = Field(ge=0, le=MAX_STEPS)
    step_s: float = Field(ge=0, le=MAX_SECONDS)
    hours: float = Field(ge=0, le=MAX_SECONDS)
    checkpoint_every_steps: int = Field(ge=1, le=MAX_STEPS,
                                        description="the trainer checkpoints when steps % this == 0")
    checkpoint_write_s: float = Field(ge=0, le=MAX_SECONDS)
    overhead_fraction: float = Field(ge=0, le=1e6, description="checkpoint + evaluation time over training time")
    flags: list[str] = Field(default_factory=list)


# What a plan assumes beyond the hardware and the model (the planner's defaults; `advisor plan` flags).
DEFAULT_MTBF_HOURS = 2000.0  # per node; large fleets report ~1 failure per 1-3k node-hours
DEFAULT_CHECKPOINT_WRITE_GBS = 2.0  # per node, to the checkpoint file system
DEFAULT_RESTART_S = 600.0  # re-queue, reload the last checkpoint, rebuild NCCL communicators


class PlanAssumptions(BaseModel):
    """The failure and checkpoint assumptions the plan's stages were sized with. Whoever sizes a
    stage again (the trainer's one-stage plans, `advisor run`'s verification trials) reads these, so
    that `--mtbf-hours 500` holds through the run, not the planner's defaults."""

    model_config = SPEC_CONFIG

    mtbf_hours: float = Field(DEFAULT_MTBF_HOURS, gt=0, le=1e7, description="mean time between failures of one node")
    checkpoint_write_gbs: float = Field(DEFAULT_CHECKPOINT_WRITE_GBS, gt=0, le=1e5,
                                        description="checkpoint write bandwidth per node, GB/s")
    restart_s: float = Field(DEFAULT_RESTART_S, ge=0, le=1e6, description="seconds a restart after a failure takes")


class Plan(BaseModel):
    model_config = SPEC_CONFIG

    version: int = PLAN_VERSION
    model: ModelSpec
    hardware: HardwareSpec
    nodes: int = Field(ge=1, le=MAX_NODES)
    gpus_per_node: int = Field(ge=1, le=MAX_DEVICES_PER_NODE)
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
                            "(specs.capabilities.attention_implementation): advisor_documents trains "
                            "packed rows through varlen FlashAttention, with no s x s mask")
    runnable_here: bool = Field(
        True, description="false: planned with --any-engine over every engine the cost model prices "
                          "(Megatron/NeMo layouts); `advisor train` refuses it")
    assumptions: PlanAssumptions = Field(default_factory=PlanAssumptions)
    priced_engine: str = Field(
        "ours", description="whose behaviour the plan's figures price (specs.capabilities PRICED_ENGINES): ours, "
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
    data = read_user_mapping(path, "plan file")
    if data.get("version") != PLAN_VERSION:
        raise UsageError(f"plan file {path}: version {data.get('version')} is not {PLAN_VERSION}; plan again")
    plan = validate(Plan, data, f"plan file {path}")
    refuse_non_finite(plan.model_dump(mode="python"), f"plan file {path}")  # the estimates take NaN when computed
    return plan
