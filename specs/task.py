"""The task file: a curriculum of training stages, each with its data and its token budget.

A task says *what* to train (stages, data, budgets, learning rates); the plan says *how*
(layout, devices, checkpoint cadence). `advisor plan --task` sizes each stage from its tokens;
`advisor train` runs the stages in order.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union, get_args

from pydantic import AfterValidator, BaseModel, Field, model_validator

from specs.core import (MAX_BATCH, MAX_DEGREE, MAX_SEQ, MAX_STEPS, MAX_TOKENS, SPEC_CONFIG, Method,
                        read_user_mapping, validate)

MAX_TEXT = 10**12  # characters or tokens of one document
MAX_ROWS = 10**12  # rows of one source
MAX_EPOCHS = 1e6

# --- data preparation (`advisor data prepare`): all optional, with defaults --------------------------


class QualityFilters(BaseModel):
    """Thresholds a document must meet to be kept; `null` turns a check off.

    Set them task-wide under `data.filters`; a stage's or a source's `filters` overrides only the
    keys it names (e.g. arithmetic data turns `min_alpha_ratio` off)."""

    model_config = SPEC_CONFIG

    min_chars: Optional[int] = Field(1, ge=0, le=MAX_TEXT, description="characters, after stripping outer whitespace")
    max_chars: Optional[int] = Field(None, ge=1, le=MAX_TEXT)
    min_tokens: Optional[int] = Field(2, ge=0, le=MAX_TEXT, description="tokens, end-of-text included")
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TEXT, description="documents above are dropped, not split")
    min_alpha_ratio: Optional[float] = Field(None, ge=0, le=1, description="letters / non-space characters")
    max_digit_ratio: Optional[float] = Field(None, ge=0, le=1, description="digits / non-space characters")
    max_bad_char_ratio: Optional[float] = Field(
        0.01, ge=0, le=1, description="(U+FFFD replacement + control characters) / characters")
    max_top_word_ratio: Optional[float] = Field(
        None, gt=0, le=1, description="most frequent word / words (catches repetition spam)")


class DedupSpec(BaseModel):
    """Exact duplicates (same text after case and whitespace folding) and near duplicates
    (MinHash over word n-gram shingles, LSH banding, verified against `threshold`)."""

    model_config = SPEC_CONFIG

    exact: bool = True
    near: bool = True
    threshold: float = Field(0.8, gt=0, le=1, description="estimated Jaccard similarity of shingle sets")
    shingle_words: int = Field(5, ge=1, le=1000, description="words per shingle")
    num_perm: int = Field(128, ge=8, le=1 << 16, description="MinHash permutations")
    bands: int = Field(16, ge=1, description="LSH bands (num_perm / bands rows each)")

    @model_validator(mode="after")
    def _bands_divide(self) -> "DedupSpec":
        if self.num_perm % self.bands:
            raise ValueError(f"dedup: bands ({self.bands}) must divide num_perm ({self.num_perm})")
        return self


class DifficultySpec(BaseModel):
    """How a document is graded and how grades are cut into named bands.

    `by`: length (tokens), field (a numeric field of the row), rule (a built-in rule name,
    `numbers` or `words`, or `module:function` taking the text and returning a number), loss (mean
    next-token loss of a small local reference model). Bands: `edges` [e1, e2] give
    [-inf, e1), [e1, e2), [e2, inf)."""

    model_config = SPEC_CONFIG

    by: Literal["length", "field", "rule", "loss"] = "length"
    field: Optional[str] = None
    rule: Optional[str] = None
    reference_model: Optional[str] = Field(None, description="local model folder, relative to the task file")
    edges: list[float] = Field(default_factory=list)
    names: Optional[list[str]] = Field(None, description="band names (default easy/medium/hard for 3 bands)")


class BucketSpec(BaseModel):
    """Length buckets: edges chosen from the length histogram to minimise padding."""

    model_config = SPEC_CONFIG

    micro_batch_tokens: Optional[int] = Field(
        None, ge=8, le=1 << 30, description="token budget of one micro-batch (mbs x seq); default 8 x seq_len")
    max_buckets: int = Field(8, ge=1, le=64)
    pad_multiple: int = Field(8, ge=1, le=1 << 16,
                              description="bucket edges are multiples of this (tensor-core friendly)")


class DataPrepSpec(BaseModel):
    """Task-wide data preparation settings (`data:` in the task file)."""

    model_config = SPEC_CONFIG

    tokenizer: Optional[str] = Field(
        None, description="local tokenizer folder or tokenizer.json, relative to the task file "
                          "(default: the task model's shipped tokenizer)")
    out: str = Field("prepared", description="output folder, relative to the task file")
    append_eos: bool = True
    filters: QualityFilters = Field(default_factory=QualityFilters)
    dedup: DedupSpec = Field(default_factory=DedupSpec)
    difficulty: DifficultySpec = Field(default_factory=DifficultySpec)
    buckets: BucketSpec = Field(default_factory=BucketSpec)


TimeBound = Union[float, dt.datetime, dt.date, str]
RowFormat = Literal["text", "prompt_completion", "chat", "alpaca", "sharegpt"]
ROW_FORMATS: tuple[str, ...] = ("text", "prompt_completion", "chat", "alpaca", "sharegpt")
FileType = Literal["jsonl", "json", "parquet", "text", "arrow"]
LEGACY_FILE_TYPES = ("jsonl", "json", "parquet", "arrow")  # what `format` named before row formats  # a number, or an ISO date (YAML may parse it to a date)


class DataSource(BaseModel):
    """One input of a stage: local files read through `datasets` (nothing is fetched)."""

    model_config = SPEC_CONFIG

    path: str = Field(description="file, glob or folder, relative to the task file")
    format: Optional[RowFormat] = Field(
        None, description="row format: text, prompt_completion, chat (OpenAI-style `messages`), alpaca or sharegpt "
                          "(default: detected from the first rows' fields)")
    file_type: Optional[FileType] = Field(
        None, description="default: told from each file's content (a folder or glob: from the files' extensions)")
    fields: dict[str, str] = Field(
        default_factory=dict, description="the format's field names as the rows spell them, e.g. {prompt: question}")
    text_field: str = "text"
    weight: float = Field(1.0, gt=0, le=1e6, description="mixture weight within the stage")
    domain: str | None = None
    # which tokens a supervised row trains (LLaMA-Factory's and Axolotl's switches of the same names)
    train_on_prompt: bool = Field(False, description="loss on every token, prompts and system included")
    mask_history: bool = Field(False, description="a multi-turn row trains only its last answer")
    roles_to_train: Optional[list[str]] = Field(
        None, min_length=1, description="the chat roles whose turns are trained (default: assistant)")
    # data preparation (optional): per-source overrides and the selection of rows for this stage
    filters: Optional[QualityFilters] = Field(None, description="overrides of the stage's filters")
    domain_field: Optional[str] = Field(None, description="row field holding the domain (default: `domain`)")
    time_field: Optional[str] = Field(None, description="row field holding a time (ISO date or number)")
    domains: Optional[list[str]] = Field(None, description="keep only rows of these domains")
    bands: Optional[list[str]] = Field(None, description="keep only rows in these difficulty bands")
    time_window: Optional[tuple[TimeBound, TimeBound]] = Field(
        None, description="keep only rows with start <= time < end")
    val_size: Optional[float] = Field(None, gt=0, le=MAX_ROWS, description="rows held out for validation: a count "
                                      "(a whole number >= 1) or a share (< 1) of the source's rows, drawn by a "
                                      "fixed seed")
    split: Literal["train", "val"] = Field("train", description="with val_size: read the rows kept for training, "
                                           "or the held-out ones (an eval source)")

    @model_validator(mode="after")
    def _whole_count(self) -> "DataSource":
        if self.val_size is not None and self.val_size >= 1 and self.val_size != int(self.val_size):
            raise ValueError(f"val_size {self.val_size:g}: a count of rows is a whole number (a share is < 1)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _legacy_file_type(cls, data: Any) -> Any:
        """Task files written before row formats put the file type in `format` (jsonl, json, parquet,
        arrow; `text` is both a file type and a row format, and reads the same either way): it moves
        to `file_type`. A `text_field` of its own names the text format's field."""
        if isinstance(data, dict) and data.get("format") in LEGACY_FILE_TYPES:
            data = {**data, "file_type": data.get("file_type") or data["format"], "format": None}
        if isinstance(data, dict) and not data.get("format") and data.get("text_field", "text") != "text":
            data = {**data, "format": "text"}
        return data

    @model_validator(mode="after")
    def _one_loss_rule(self) -> "DataSource":
        if self.train_on_prompt and self.mask_history:  # LLaMA-Factory refuses the pair too
            raise ValueError(f"source {self.path}: mask_history (train the last answer only) and train_on_prompt "
                             "(train every token) exclude each other")
        return self

    def field_names(self) -> dict[str, str]:
        """The overridden field names, with `text_field` as the text format's `text`."""
        return {"text": self.text_field, **self.fields}


# A stage's name becomes folder names (RUN/stages/<name>/model/, prepared shards): so it is one path
# component that cannot climb out (`..`, `/`, an absolute path) or hide (a leading dot).
STAGE_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
STAGE_NAME_RULE = ("1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit, without '..' "
                   "(it names the stage's folders)")


def check_stage_name(name: str) -> str:
    if not STAGE_NAME_PATTERN.fullmatch(name) or ".." in name:
        raise ValueError(f"stage name {name!r}: use {STAGE_NAME_RULE}")
    return name


StageName = Annotated[str, AfterValidator(check_stage_name)]


class StageSpec(BaseModel):
    """One sub-task of the curriculum (e.g. general language, reasoning, instructions, mixed)."""

    model_config = SPEC_CONFIG

    name: StageName
    sources: list[DataSource] = Field(default_factory=list)
    replay: dict[str, float] = Field(
        default_factory=dict, description="earlier stage name -> share of this stage's tokens replayed from it")
    tokens: int | None = Field(None, gt=0, le=MAX_TOKENS, description="token budget of the stage")
    steps: int | None = Field(None, gt=0, le=MAX_STEPS, description="optimizer steps (instead of tokens)")
    epochs: float | None = Field(None, gt=0, le=MAX_EPOCHS, description="passes over the stage's own data (instead of "
                                 "tokens or steps): the trainer turns them into steps from the data's row count")
    lr: float = Field(3e-4, gt=0, le=1)
    warmup_steps: int = Field(20, ge=0, le=MAX_STEPS, description="learning-rate re-warm-up at the stage start")
    warmup_ratio: float | None = Field(None, ge=0, lt=1, description="warm-up as a share of the stage's steps as "
                                       "finally sized (instead of warmup_steps), rounded up to whole steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="decay floor, share of lr")
    ramp_steps: int = Field(0, ge=0, le=MAX_STEPS, description="steps over which the data mixture moves linearly from "
                            "the previous stage's data to this stage's mix (0: a hard switch)")
    method: Method | None = Field(None, description="override the plan's full/lora/qlora for this stage")
    seq_len: int | None = Field(None, ge=8, le=MAX_SEQ, description="tokens per sequence in this stage (default: the "
                                "task's), e.g. short to long; the stage keeps the task's tokens per step "
                                "(global_batch x seq_len), so its global batch in sequences scales inversely")
    eval_sources: list[DataSource] = Field(default_factory=list)
    eval_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="tokens evaluated at each evaluation")
    # data preparation (optional): overrides of the task-wide `data` settings, and how shards split
    filters: Optional[QualityFilters] = Field(None, description="overrides of the task's data.filters")
    difficulty: Optional[DifficultySpec] = Field(None, description="overrides of the task's data.difficulty")
    split_by: Literal["none", "domain", "difficulty", "time"] = Field(
        "none", description="shard the stage by domain, difficulty band or time window")
    time_windows: dict[str, tuple[TimeBound, TimeBound]] = Field(
        default_factory=dict, description="name -> [start, end) for split_by: time")

    @model_validator(mode="after")
    def _budget(self) -> "StageSpec":
        if sum(budget is not None for budget in (self.tokens, self.steps, self.epochs)) != 1:
            raise ValueError(f"stage '{self.name}': give exactly one of tokens, steps or epochs")
        if self.split_by == "time" and not self.time_windows:
            raise ValueError(f"stage '{self.name}': split_by time needs time_windows")
        for earlier, share in self.replay.items():
            if not 0 <= share < 1:
                raise ValueError(f"stage '{self.name}': replay share of '{earlier}' is {share}, must be in [0, 1)")
        if sum(self.replay.values()) >= 1:
            raise ValueError(f"stage '{self.name}': replay shares sum to {sum(self.replay.values()):g}, must be < 1 "
                             "(the rest is the stage's own data)")
        return self

    def warmup_for(self, steps: int) -> int:
        """Warm-up steps of this stage when it runs `steps` steps: its share of them (`warmup_ratio`),
        else `warmup_steps`; at most all but its last step (the schedule's clamp)."""
        wanted = math.ceil(self.warmup_ratio * steps) if self.warmup_ratio is not None else self.warmup_steps
        return min(wanted, max(steps - 1, 0))


class AdapterSpec(BaseModel):
    """LoRA's settings besides its rank (the rank is the plan's layout key `lora_rank`: the planner
    prices it). Neither changes what a step costs enough to re-plan: alpha is a scale, and fewer
    targets than all linears hold fewer adapter weights than the plan priced."""

    model_config = SPEC_CONFIG

    alpha: float | None = Field(None, gt=0, le=1e6, description="LoRA alpha (default: twice the rank)")
    targets: list[str] | None = Field(None, min_length=1, description="module names LoRA adapts, e.g. [q_proj, "
                                      "v_proj] (default: every linear layer)")


class SpikeGuardSpec(BaseModel):
    """When the trainer reads a step as a loss spike and rolls back (trainer/spike.py). After a warm-up
    window a value is a spike when it crosses every margin given for it: its running mean plus
    `*_sigmas` running deviations, and `*_ratio` times that mean. A null margin is not applied; both
    null turn that check off. A non-finite loss or gradient norm is always a spike.

    The defaults suit a large model's slow descent. A small model that learns a skill in a few steps
    moves its gradient norm several-fold by design; a looser `grad_norm_ratio` keeps such a task
    guarded without reading its learning as spikes."""

    model_config = SPEC_CONFIG

    loss_sigmas: Optional[float] = Field(6.0, gt=0, le=1e6, description="running deviations above the mean loss")
    loss_ratio: Optional[float] = Field(1.5, gt=1, le=1e6, description="times the running mean loss")
    grad_norm_sigmas: Optional[float] = Field(8.0, gt=0, le=1e6,
                                              description="running deviations above the mean gradient norm")
    grad_norm_ratio: Optional[float] = Field(3.0, gt=1, le=1e6, description="times the running mean gradient norm")


LrSchedule = Literal["rewarm_cosine", "wsd", "constant"]
LR_SCHEDULES: tuple[str, ...] = get_args(LrSchedule)


class TaskSpec(BaseModel):
    """A curriculum: stages run in order; the last is usually a mixed stage that replays earlier
    data so that later stages do not make the model forget (the source article's advice)."""

    model_config = SPEC_CONFIG

    name: str
    description: str = ""
    model: str | None = Field(None, description="model preset or config path, if the task fixes one")
    seq_len: int = Field(2048, ge=8, le=MAX_SEQ,
                         description="at most the model's max_position_embeddings (checked when planned)")
    global_batch: int | None = Field(None, ge=1, le=MAX_BATCH * MAX_DEGREE, description="sequences per optimizer step")
    stages: list[StageSpec] = Field(min_length=1)
    eval_every_steps: int = Field(0, ge=0, le=MAX_STEPS, description="0: evaluate at stage ends only")
    lr_schedule: LrSchedule = Field(
        "rewarm_cosine", description="rewarm_cosine: every stage re-warms to its lr and decays by cosine; wsd: "
        "warm up once (the first stage's warmup_steps), hold each stage's lr, decay linearly over the run's last "
        "wsd_decay_fraction of steps; constant: every stage warms up, then holds its lr (a finished run can be "
        "extended with --resume)")
    wsd_decay_fraction: float = Field(0.1, gt=0, le=1, description="wsd: share of the run's steps that decay")
    base_dir: str = Field(".", description="where relative data paths start (set when loading)")
    data: DataPrepSpec = Field(default_factory=DataPrepSpec, description="`advisor data prepare` settings")
    packing: bool = Field(True, description="several examples share a sequence (false: one example per sequence, "
                          "padded)")
    adapter: AdapterSpec = Field(default_factory=AdapterSpec, description="LoRA/QLoRA alpha and target modules")
    spike_guard: SpikeGuardSpec = Field(default_factory=SpikeGuardSpec,
                                        description="when a step is read as a loss spike (rolled back)")

    @model_validator(mode="after")
    def _unique_names(self) -> "TaskSpec":
        names = [s.name for s in self.stages]
        # case-folded: `Math` and `math` are one folder on macOS and Windows file systems
        if len({name.casefold() for name in names}) != len(names):
            raise ValueError(f"stage names must be unique (ignoring case): {names}")
        for i, stage in enumerate(self.stages):
            unknown = set(stage.replay) - set(names[:i])
            if unknown:
                raise ValueError(f"stage '{stage.name}' replays {sorted(unknown)}, which do not come before it")
        return self

    def stage_seq(self, stage: StageSpec, default: int | None = None) -> int:
        """The stage's sequence length: its own, else `default` (the plan's), else the task's."""
        return stage.seq_len or default or self.seq_len

    def stage_tokens(self, stage: StageSpec, tokens_per_step: int) -> int:
        """The stage's budget in tokens; 0 for an epochs budget, which only its data can size
        (the planner is handed those counts when the data is readable, else the trainer sizes the
        stage at run time)."""
        if stage.tokens is not None:
            return stage.tokens
        return stage.steps * tokens_per_step if stage.steps is not None else 0


def read_task_file(path: Path) -> TaskSpec:
    """Read and validate a task YAML; relative data paths start at its folder unless it says otherwise.
    (`presets.load_task` also resolves task preset names.)"""
    data = read_user_mapping(path, "task file")
    data.setdefault("base_dir", str(path.resolve().parent))
    return validate(TaskSpec, data, f"task file {path}")
