"""The plan file that `advisor plan --out plan.yaml` writes and `advisor train plan.yaml` runs."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from advisor.errors import UsageError
from advisor.specs import MIN_COMPUTE_FRACTION, Estimate, HardwareSpec, Layout, ModelSpec, validate
from advisor.task import TaskSpec

PLAN_VERSION = 1


class PlannedLayout(BaseModel):
    """One candidate: the layout, its predicted cost, and the reason it ranks where it does."""

    layout: Layout
    estimate: Estimate
    why: str
    meets_compute_rule: bool = True


class StagePlan(BaseModel):
    """How one curriculum stage runs: its budget in steps and its checkpoint cadence."""

    name: str
    method: str
    devices: int
    layout: Layout
    tokens: int
    steps: int
    step_s: float
    hours: float
    checkpoint_every_steps: int
    checkpoint_write_s: float
    overhead_fraction: float = Field(description="checkpoint + evaluation time over training time")
    flags: list[str] = Field(default_factory=list)


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = PLAN_VERSION
    model: ModelSpec
    hardware: HardwareSpec
    nodes: int
    gpus_per_node: int
    objective: Literal["throughput", "cost"] = "throughput"
    min_compute_fraction: float = MIN_COMPUTE_FRACTION
    engine: Literal["auto", "deepspeed", "fsdp2"] = Field(
        "auto", description="back-end for sharded data parallelism (ZeRO): auto = DeepSpeed, or FSDP2 when tp>1")
    chosen: PlannedLayout
    alternatives: list[PlannedLayout] = Field(
        default_factory=list, description="next best layouts with the same global batch (OOM fallback)")
    task: TaskSpec | None = None
    stages: list[StagePlan] = Field(default_factory=list)
    solver: dict = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)

    def write(self, path: Path) -> None:
        """Write aside, then rename: a crash never leaves half a plan."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, width=110))
        tmp.replace(path)


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"plan file not found: {path}") from None
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"cannot read plan file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"plan file {path}: expected a mapping")
    if data.get("version") != PLAN_VERSION:
        raise UsageError(f"plan file {path}: version {data.get('version')} is not {PLAN_VERSION}; plan again")
    return validate(Plan, data, f"plan file {path}")
