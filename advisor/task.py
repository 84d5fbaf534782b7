"""The task file: a curriculum of training stages, each with its data and its token budget.

A task says *what* to train (stages, data, budgets, learning rates); the plan says *how*
(layout, devices, checkpoint cadence). `advisor plan --task` sizes each stage from its tokens;
`advisor train` runs the stages in order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from advisor.errors import UsageError
from advisor.specs import Method, validate


class DataSource(BaseModel):
    """One input of a stage: local files read through `datasets` (nothing is fetched)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="file, glob or folder, relative to the task file")
    format: Literal["jsonl", "json", "parquet", "text", "arrow"] = "jsonl"
    text_field: str = "text"
    weight: float = Field(1.0, gt=0, description="mixture weight within the stage")
    domain: str | None = None


class StageSpec(BaseModel):
    """One sub-task of the curriculum (e.g. general language, reasoning, instructions, mixed)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    sources: list[DataSource] = Field(default_factory=list)
    replay: dict[str, float] = Field(
        default_factory=dict, description="earlier stage name -> share of this stage's tokens replayed from it")
    tokens: int | None = Field(None, gt=0, description="token budget of the stage")
    steps: int | None = Field(None, gt=0, description="optimizer steps (instead of tokens)")
    lr: float = Field(3e-4, gt=0)
    warmup_steps: int = Field(20, ge=0, description="learning-rate re-warm-up at the stage start")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay floor, share of lr")
    method: Method | None = Field(None, description="override the plan's full/lora/qlora for this stage")
    eval_sources: list[DataSource] = Field(default_factory=list)
    eval_tokens: int = Field(0, ge=0, description="tokens evaluated at each evaluation")

    @model_validator(mode="after")
    def _budget(self) -> "StageSpec":
        if (self.tokens is None) == (self.steps is None):
            raise ValueError(f"stage '{self.name}': give exactly one of tokens or steps")
        return self


class TaskSpec(BaseModel):
    """A curriculum: stages run in order; the last is usually a mixed stage that replays earlier
    data so that later stages do not make the model forget (the source article's advice)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    model: str | None = Field(None, description="model preset or config path, if the task fixes one")
    seq_len: int = Field(2048, ge=8)
    global_batch: int | None = Field(None, ge=1, description="sequences per optimizer step")
    stages: list[StageSpec] = Field(min_length=1)
    eval_every_steps: int = Field(0, ge=0, description="0: evaluate at stage ends only")
    base_dir: str = Field(".", description="where relative data paths start (set when loading)")

    @model_validator(mode="after")
    def _unique_names(self) -> "TaskSpec":
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique: {names}")
        for i, stage in enumerate(self.stages):
            unknown = set(stage.replay) - set(names[:i])
            if unknown:
                raise ValueError(f"stage '{stage.name}' replays {sorted(unknown)}, which do not come before it")
        return self

    def stage_tokens(self, stage: StageSpec, tokens_per_step: int) -> int:
        return stage.tokens if stage.tokens is not None else stage.steps * tokens_per_step  # type: ignore[operator]


def load_task(ref: str) -> TaskSpec:
    """A task preset name (e.g. `demo`) or a path to a task YAML."""
    from presets import PRESETS_DIR, preset_names

    path = Path(ref)
    if not path.is_file():
        if ref.endswith((".yaml", ".yml")) or "/" in ref:
            raise UsageError(f"task file not found: {ref}")
        if ref not in preset_names("tasks"):
            raise UsageError(f"unknown task preset '{ref}'; available: {', '.join(preset_names('tasks'))}")
        path = PRESETS_DIR / "tasks" / f"{ref}.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"cannot read task file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"task file {path}: expected a mapping")
    data.setdefault("base_dir", str(path.resolve().parent))
    return validate(TaskSpec, data, f"task file {path}")
