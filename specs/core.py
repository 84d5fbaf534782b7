"""Shared pydantic specs: the files and strings a user writes or reads.

Everything that crosses a package boundary (hardware, model, layout, estimate) is one of these
models, validated once at the edge. Validation errors name the field and the allowed values.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, SequenceNode

from specs.errors import UsageError

GiB = 1024**3

DType = Literal["bf16", "fp16", "fp32"]
Recompute = Literal["none", "selective", "full"]
# What "selective" recomputation is: torch's op-level selective activation checkpointing, as FSDP
# users run it (torchtitan). Inside a checkpointed decoder layer the outputs of these aten ops are
# kept for backward and every other op (norms, rotary, activations, residual adds) runs again. The
# trainer's policy (trainer/recompute.py) and the trace's measurement of what it keeps
# (profiler/model_trace.py) both read this one list.
SELECTIVE_SAVED_OPS: tuple[str, ...] = (
    "mm", "addmm", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
)
SELECTIVE_POLICY = (
    "selective = op-level activation checkpointing: keep matmul and attention outputs, recompute element-wise ops")
Offload = Literal["none", "optimizer", "optimizer+params"]
Method = Literal["full", "lora", "qlora"]
# The loss a run computes: "chunked" is what `advisor train` runs (trainer/chunked_loss.py wherever
# specs.capabilities `chunked_loss` allows it, HF's loss elsewhere); "hf" is transformers' own
# `ForCausalLMLoss` over the whole logits, what a user's HF Trainer or accelerate script runs.
LossKind = Literal["chunked", "hf"]

# Every file a user writes or edits: unknown keys and non-finite numbers (`.nan`, `inf`, which pass
# every `gt`/`le` bound) are refused; READ_CONFIG for parts that tolerate keys of newer writers.
SPEC_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)
READ_CONFIG = ConfigDict(allow_inf_nan=False)

DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
# dtype=bf16 is bf16-mixed: fp32 weights, gradients and Adam moments, bf16 compute (how each engine
# runs it: specs/capabilities.py `precision`). Pure bf16 training (Lightning's "bf16-true": bf16
# weights and bf16 Adam moments, no fp32 master) is refused: an AdamW update below half of bf16's
# spacing at a weight rounds away (2e-5 on a weight of 0.02, where the spacing is 2^-13 = 1.2e-4),
# and the stochastic rounding that would keep it (torchao) is not installed here.
REFUSED_DTYPES: dict[str, str] = {
    "bf16-true": ("dtype=bf16-true (bf16 weights and Adam moments, no fp32 master) is refused: AdamW updates below "
                  "half of bf16's spacing at a weight round away (2e-5 on 0.02) and no stochastic rounding is "
                  "installed; use dtype=bf16 (fp32 master weights, bf16 compute)"),
}


def check_dtype(name: str) -> None:
    """A dtype the user named: one that trains, or the one line that says why not."""
    if name in REFUSED_DTYPES:
        raise UsageError(REFUSED_DTYPES[name])

# The source article's rule: every device should spend at least this share of the step computing
# (the rest is exposed communication, pipeline bubbles, offload traffic); the planner's default.
MIN_COMPUTE_FRACTION = 0.8
# Upper bounds of what users write: far beyond any machine or run, low enough that no product of
# them overflows a float or an int64 (`memory_gib: 1e308` times GiB is infinite).
MAX_GIB = 1e6  # a device's or a host's memory
MAX_GBS = 1e6  # a link's or a memory's bandwidth, GB/s
MAX_LATENCY_US = 1e7
MAX_TFLOPS = 1e6
MAX_DEVICES_PER_NODE = 4096
MAX_NODES = 1 << 17
MAX_CORES = 1 << 20  # CPU cores, threads, streaming multiprocessors
MAX_DEGREE = 1 << 20  # a parallel degree (dp, tp, pp, vpp)
MAX_BATCH = 1 << 20  # sequences per micro-batch, micro-batches per step
MAX_SEQ = 1 << 24  # tokens per sequence
MAX_LORA_RANK = 1 << 16
MAX_TOKENS = 10**16  # a run's or a stage's token budget
MAX_STEPS = 10**12

# Share of usable device memory the planner keeps free for allocator fragmentation.
MEMORY_MARGIN = 0.05


class LinkFigures(BaseModel):
    """A collective's measured bus bandwidth and latency on one kind of link (alpha-beta fit)."""

    model_config = SPEC_CONFIG

    bandwidth_gbs: float = Field(gt=0, le=MAX_GBS, description="bus bandwidth, GB/s (nccl-tests' busbw definition)")
    latency_us: float = Field(ge=0, le=MAX_LATENCY_US)


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


class SizeCurve(BaseModel):
    """How a measured rate changes with the size of what it runs on: (size, rate relative to the
    base figure) points, read linearly in log2(size) between them and flat beyond the ends."""

    model_config = SPEC_CONFIG

    sizes: list[float] = Field(min_length=1, description="increasing sizes the rate was measured at")
    relative: list[float] = Field(min_length=1, description="the rate at each size / the base figure")

    @model_validator(mode="after")
    def _points(self) -> "SizeCurve":
        if len(self.sizes) != len(self.relative):
            raise ValueError(f"{len(self.sizes)} sizes but {len(self.relative)} relative rates")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])) or self.sizes[0] <= 0:
            raise ValueError("sizes must be positive and increasing")
        if min(self.relative) <= 0 or max(self.relative) > 100:
            raise ValueError("relative rates must be > 0 and <= 100")
        if self.sizes[-1] > 1e18:
            raise ValueError("sizes must be <= 1e18")
        return self

    def at(self, size: float) -> float:
        if size <= self.sizes[0]:
            return self.relative[0]
        for (a, ra), (b, rb) in zip(zip(self.sizes, self.relative), zip(self.sizes[1:], self.relative[1:])):
            if size <= b:
                share = math.log2(size / a) / math.log2(b / a)
                return ra + share * (rb - ra)
        return self.relative[-1]


class PresetCheck(BaseModel):
    """How far a hardware preset's prices were off where they were held against measured runs: the
    plan says so when it is priced on the preset rather than on a profile of the machine."""

    model_config = SPEC_CONFIG

    against: str = Field(description="what the preset was checked against")
    rows: int = Field(ge=1, le=100_000, description="measured runs compared")
    median_abs_error: float = Field(ge=0, le=100, description="median |predicted/measured - 1| of throughput")
    worst_error: float = Field(ge=-1, le=100, description="the signed error of the worst row")


class Efficiency(BaseModel):
    """Fractions of datasheet peak that real kernels reach (the cost model's calibration knobs)."""

    model_config = SPEC_CONFIG

    # A measured profile's "peak" is its own micro-benchmark, which real kernels may beat: up to 2.
    gemm: float = Field(0.6, gt=0, le=2, description="large dense GEMM / datasheet dense peak")
    intra_node_collective: float = Field(0.7, gt=0, le=1, description="NCCL bus bandwidth / link peak")
    inter_node_collective: float = Field(0.7, gt=0, le=1, description="NCCL bus bandwidth / NIC peak")
    memory_bandwidth: float = Field(0.8, gt=0, le=2, description="streaming copy / datasheet bandwidth")
    adapter_gemm: float | None = Field(
        None, gt=0, le=2, description="LoRA adapters' skinny GEMMs (rank r on one side) / dense peak; "
        "unset: as gemm")
    node_contention: float = Field(
        0.0, ge=0, le=4, description="compute slow-down when every device of a node computes at once, "
        "over one alone (CPU cores share caches and memory bandwidth; 0 for GPUs)")
    comm_overlap: float = Field(
        0.5, ge=0, le=1, description="share of DP/ZeRO collective time hidden behind compute"
    )
    micro_batch_overhead_s: float = Field(
        0.0, ge=0, le=60, description="fixed time per micro-batch per stage (kernel launches, Python) that FLOPs miss"
    )
    host_op_s: float = Field(
        0.0, ge=0, le=0.01, description="host time per kernel an eager step launches (Python, autograd, dispatch, "
        "launch): a GPU idles after each kernel shorter than it (planner/host_floor.py); 0: no floor (a CPU, "
        "whose host is its device)")
    gemm_tokens_slope: float = Field(
        0.0, ge=-0.5, le=2, description="relative change of GEMM time per doubling of the tokens a micro-batch "
        "feeds each GEMM, from 256 on (a CPU's working set leaves its caches: > 0; fitted by calibration "
        "from steps at several micro-batch sizes); 0: none")
    tp_collective_wait_s: float = Field(
        0.0, ge=0, le=1, description="seconds each tensor-parallel collective of a micro-batch costs beyond its "
        "transfer at the profiled link rate: the ranks' skew at every synchronisation and DTensor's work "
        "around it (fitted by calibration from a tp=2 step; 0: none)")


class HardwareSpec(BaseModel):
    """One kind of accelerator (per device figures) and how devices are wired.

    Bandwidths are GB/s (1e9 bytes), unidirectional, per device. Presets carry datasheet peaks and
    typical efficiencies; `advisor profile` writes the same schema with measured figures.
    """

    model_config = SPEC_CONFIG

    name: str
    description: str = ""
    device_type: Literal["cuda", "cpu"] = "cuda"
    memory_gib: float = Field(gt=0, le=MAX_GIB, description="memory per device")
    reserved_gib: float = Field(
        0.0, ge=0, le=MAX_GIB, description="taken by the runtime (CUDA context, NCCL, allocator) before tensors"
    )
    peak_tflops: dict[str, float] = Field(description="dense peak per dtype: bf16, fp16, fp32")
    memory_bandwidth_gbs: float = Field(gt=0, le=MAX_GBS)
    intra_node_bandwidth_gbs: float = Field(gt=0, le=MAX_GBS, description="device-to-device link, one direction")
    inter_node_bandwidth_gbs: float = Field(gt=0, le=MAX_GBS, description="network per device, one direction")
    intra_node_latency_us: float = Field(5.0, ge=0, le=MAX_LATENCY_US)
    inter_node_latency_us: float = Field(10.0, ge=0, le=MAX_LATENCY_US)
    devices_per_node: int = Field(8, ge=1, le=MAX_DEVICES_PER_NODE)
    host_memory_gib: float = Field(
        512.0, gt=0, le=MAX_GIB, description="host RAM per node, shared by its devices (holds offloaded states)")
    host_to_device_gbs: float = Field(25.0, gt=0, le=MAX_GBS, description="pinned host<->device copy")
    cpu_adam_params_per_s: float = Field(
        1.0e9, gt=0, le=1e15, description="host Adam update rate per device for optimizer offload"
    )
    head_gemm: SizeCurve | None = Field(
        None, description="the LM head's GEMMs (forward, input and weight gradients) over the dense rate "
        "`peak_tflops`, by the vocabulary one device holds (a measured profile: a CPU runs a 64k-wide head "
        "at ~70% of its decoder GEMMs' rate); unset: the dense rate")
    attention: SizeCurve | None = Field(
        None, description="the fused attention kernel's counted FLOPs (forward and backward) over the dense rate "
        "`peak_tflops`, by sequence length (a measured profile: a CPU runs it at 65% of its GEMMs' rate at seq "
        "256, 93% at 1024); unset: the dense rate")
    cpu_adam_by_tensor: SizeCurve | None = Field(
        None, description="host AdamW rate over `cpu_adam_params_per_s`, by the parameters of the tensor it "
        "updates (a measured profile: a tensor whose states leave the caches updates ~3x slower); unset: flat")
    collective_links: dict[str, LinkFigures] = Field(
        default_factory=dict, description="'<op>/intra' or '<op>/inter' (op: all_gather, reduce_scatter, "
        "send_recv) -> that collective's own measured fit, where a profile measured it (gloo's all-gather "
        "runs at a third of its all-reduce's bus bandwidth); absent: the link's all-reduce figures above")
    threads_per_device: int | None = Field(
        None, ge=1, le=MAX_CORES, description="CPU: the threads one device (rank) runs, as the profile measured it; "
        "advisor train pins every rank to it (unset: the node's cores shared out over its ranks)")
    cpu_cores: int | None = Field(
        None, ge=1, le=MAX_CORES, description="CPU: cores per node; more ranks x threads than cores time-share them")
    sm_count: int | None = Field(
        None, ge=1, le=MAX_CORES, description="streaming multiprocessors: how many GEMM output tiles run at once "
        "(one wave); None where wave quantization does not apply or is not known (CPUs, measured profiles)")
    gemm_tile: tuple[int, int] | None = Field(
        None, description="output tile (rows, columns) of the tensor-core GEMM kernels that reach "
        "`efficiency.gemm`, one per SM at a time; used with sm_count")
    efficiency: Efficiency = Field(default_factory=Efficiency)
    source: str = Field("preset", description="'preset' or the profile file it was measured into")
    checked: PresetCheck | None = Field(
        None, description="a preset's record against measured runs (None: never checked); plans priced on the "
        "preset quote it")
    assumed: dict[str, str] = Field(
        default_factory=dict, description="figures of a measured profile that were not measured here: "
        "field -> where the value comes from (e.g. inter-node figures of a one-node profile)")

    @field_validator("peak_tflops")
    @classmethod
    def _peaks_not_negative(cls, value: dict[str, float]) -> dict[str, float]:
        negative = sorted(k for k, v in value.items() if v < 0)
        if negative:
            raise ValueError(f"peak_tflops of {', '.join(negative)} must be >= 0 (0: not supported)")
        huge = sorted(k for k, v in value.items() if v > MAX_TFLOPS)
        if huge:
            raise ValueError(f"peak_tflops of {', '.join(huge)} must be <= {MAX_TFLOPS:g}")
        return value

    @model_validator(mode="after")
    def _reserve_below_memory(self) -> "HardwareSpec":
        if self.reserved_gib >= self.memory_gib:
            raise ValueError(f"reserved_gib ({self.reserved_gib}) leaves nothing of memory_gib ({self.memory_gib})")
        if (self.sm_count is None) != (self.gemm_tile is None):
            raise ValueError("sm_count and gemm_tile go together: set both or neither")
        if self.gemm_tile is not None and not 1 <= min(self.gemm_tile) <= max(self.gemm_tile) <= 4096:
            raise ValueError(f"gemm_tile {list(self.gemm_tile)} must be two sizes from 1 to 4096")
        return self

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GiB)

    @property
    def usable_bytes(self) -> int:
        return int((self.memory_gib - self.reserved_gib) * GiB)

    def supports(self, dtype: str) -> bool:
        return self.peak_tflops.get(dtype, 0.0) > 0

    def peak_flops(self, dtype: str) -> float:
        if not self.supports(dtype):
            raise UsageError(
                f"hardware '{self.name}' has no {dtype} throughput; "
                f"supported: {', '.join(k for k, v in self.peak_tflops.items() if v > 0)}"
            )
        return self.peak_tflops[dtype] * 1e12

    def threads_per_rank(self, ranks_on_node: int, cores: int) -> int:
        """CPU threads each of `ranks_on_node` ranks runs: the profile's device when it defines one
        (what the plan was priced on), else the node's `cores` shared out evenly."""
        return self.threads_per_device or max(1, cores // max(ranks_on_node, 1))

    def oversubscription(self, ranks_on_node: int) -> float:
        """How many times over `ranks_on_node` ranks ask for the node's CPU cores (1: they fit; on
        GPUs and wherever the cores are unknown, 1). Time-shared cores run each rank that much slower."""
        if self.device_type != "cpu" or not self.cpu_cores:
            return 1.0
        return max(1.0, ranks_on_node * self.threads_per_rank(ranks_on_node, self.cpu_cores) / self.cpu_cores)

    @property
    def default_dtype(self) -> DType:
        return "fp32" if self.device_type == "cpu" or not self.supports("bf16") else "bf16"


def _non_finite_key(value: Any, where: str) -> str | None:
    """The first key path under `value` holding NaN or an infinity (JSON's `NaN`, `Infinity`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite_key(item, f"{where}.{key}")
        if found:
            return found
    return None


def _finite_values(value: dict[str, Any]) -> dict[str, Any]:
    bad = _non_finite_key(value, "")
    if bad:
        raise ValueError(f"{bad.lstrip('.')} is not a finite number")
    return value


def refuse_non_finite(data: Any, what: str) -> None:
    """One line naming the first NaN or infinity anywhere in a user's file: the parts the planner writes
    (estimates) accept them when computed, never when read back (summary.json would hold bare `NaN`)."""
    bad = _non_finite_key(data, "")
    if bad:
        raise UsageError(f"invalid {what}: {bad.lstrip('.')} is not a finite number")


# A free-form mapping (a model's HF config, a solver record) whose numbers must still be finite:
# JSON's NaN and Infinity parse, and `allow_inf_nan` does not reach inside `Any`.
FiniteDict = Annotated[dict[str, Any], AfterValidator(_finite_values)]


class ModelSpec(BaseModel):
    """A model given as its Hugging Face config (any architecture transformers knows)."""

    model_config = SPEC_CONFIG

    name: str
    hf_config: FiniteDict
    source: str = Field("preset", description="'preset', or the config path it was read from")

    @property
    def model_type(self) -> str:
        return str(self.hf_config.get("model_type", "?"))


def max_positions(model: ModelSpec) -> int | None:
    """The longest sequence the model's position embeddings cover, where its config says."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = model.hf_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_seq_fits(model: ModelSpec, seq: int, flag: str = "--seq-len") -> None:
    limit = max_positions(model)
    if limit is not None and seq > limit:
        raise UsageError(f"{flag} {seq} exceeds model {model.name}'s max_position_embeddings {limit}")


class Layout(BaseModel):
    """How one training step is split across devices: the single source of truth for degrees.

    Parsed from strings like ``dp=8,tp=8,pp=16,zero=1,mbs=1,gas=16,recompute=selective``.
    """

    model_config = SPEC_CONFIG

    dp: int = Field(1, ge=1, le=MAX_DEGREE, description="data-parallel replicas")
    tp: int = Field(1, ge=1, le=MAX_DEGREE, description="tensor-parallel degree (Megatron column/row split)")
    pp: int = Field(1, ge=1, le=MAX_DEGREE, description="pipeline stages")
    vpp: int = Field(1, ge=1, le=MAX_DEGREE, description="virtual stages per device (interleaved 1F1B)")
    sp: bool = Field(False, description="Megatron sequence parallelism inside the TP group")
    zero: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage: 1 optimizer, 2 +grads, 3 +weights")
    offload: Offload = "none"
    mbs: int = Field(1, ge=1, le=MAX_BATCH, description="micro-batch size, sequences per device per micro-step")
    gas: int = Field(1, ge=1, le=MAX_BATCH, description="gradient-accumulation steps per optimizer step")
    recompute: Recompute = "none"
    method: Method = "full"
    lora_rank: int = Field(16, ge=1, le=MAX_LORA_RANK, description="LoRA rank r (method lora/qlora)")
    dtype: DType = "bf16"
    seq: int = Field(2048, ge=1, le=MAX_SEQ, description="tokens per sequence")
    stage_layers: list[int] | None = Field(
        None, description="decoder layers per pipeline stage (default: even, remainder on later stages)")
    recompute_layers: list[int] | None = Field(
        None, description="per stage, how many of its layers use `recompute` (default: all of them)")
    loss: LossKind = Field(
        "chunked", description="chunked: the trainer's chunked cross-entropy where it runs (HF's loss elsewhere); "
        "hf: transformers' loss over the whole logits, as a user's own HF Trainer or accelerate script runs it")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.mbs * self.gas

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    @field_validator("dtype", mode="before")
    @classmethod
    def _refuse_pure_16_bit(cls, value: Any) -> Any:
        # a plan or a dict as well as a layout string (`parse_layout_string`); a list or a dict here is
        # not hashable, and pydantic's own type check refuses it after this
        if isinstance(value, str) and value in REFUSED_DTYPES:
            raise ValueError(REFUSED_DTYPES[value])
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> "Layout":
        if self.sp and self.tp == 1:
            raise ValueError("sp=1 needs tp>1: sequence parallelism splits the TP group's replicated work")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("vpp>1 needs pp>1: virtual stages interleave a pipeline")
        if self.offload != "none" and self.zero == 0:
            raise ValueError("offload needs zero>=1 (DeepSpeed offloads ZeRO partitions)")
        if self.offload == "optimizer+params" and self.zero != 3:
            raise ValueError("offload=optimizer+params needs zero=3")
        if self.method == "qlora" and self.dtype == "fp32":
            raise ValueError("method=qlora computes in bf16/fp16; set dtype=bf16 or fp16")
        for name in ("stage_layers", "recompute_layers"):
            value = getattr(self, name)
            if value is not None and (len(value) != self.pp or min(value) < 0 or max(value) > MAX_DEGREE):
                raise ValueError(f"{name} needs pp={self.pp} non-negative counts, one per stage")
        if self.stage_layers and min(self.stage_layers) < 1:
            raise ValueError("stage_layers: every pipeline stage needs at least one decoder layer")
        if self.stage_layers and self.recompute_layers:
            if any(r > n for r, n in zip(self.recompute_layers, self.stage_layers)):
                raise ValueError("recompute_layers: a stage cannot recompute more layers than it holds")
        return self

    def short(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        if self.sp:
            parts.append("sp=1")
        parts += [f"zero={self.zero}", f"mbs={self.mbs}", f"gas={self.gas}", f"recompute={self.recompute}"]
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if self.method != "full":
            parts.append(f"method={self.method}")
            if self.lora_rank != Layout.model_fields["lora_rank"].default:
                parts.append(f"lora_rank={self.lora_rank}")
        parts += [f"dtype={self.dtype}", f"seq={self.seq}"]
        if self.stage_layers:
            parts.append("stage_layers=" + "/".join(map(str, self.stage_layers)))
        if self.recompute_layers:
            parts.append("recompute_layers=" + "/".join(map(str, self.recompute_layers)))
        if self.loss != "chunked":
            parts.append(f"loss={self.loss}")
        return ",".join(parts)


LAYOUT_KEYS_HELP: dict[str, str] = {
    "dp": "data-parallel replicas (default: devices / (tp*pp))",
    "tp": "tensor-parallel degree; must divide attention heads and stay inside a node",
    "pp": "pipeline stages (1F1B); must not exceed the number of decoder layers",
    "vpp": "virtual stages per device for the interleaved 1F1B schedule (shrinks the bubble)",
    "sp": "0/1: Megatron sequence parallelism (needs tp>1); shards LayerNorm/dropout activations",
    "zero": "0-3: ZeRO stage; 1 shards optimizer states, 2 also gradients, 3 also weights",
    "offload": "none | optimizer | optimizer+params: move ZeRO partitions to host memory",
    "mbs": "micro-batch size (sequences per device per forward/backward)",
    "gas": "gradient-accumulation steps; global batch = dp*mbs*gas",
    "recompute": ("none | selective (op-level: keep matmul outputs, recompute element-wise) "
                  "| full (whole decoder layer)"),
    "method": "full | lora | qlora (LoRA on 4-bit NF4 frozen weights)",
    "lora_rank": "LoRA rank r (default 16), adapters on all linear projections",
    "dtype": ("bf16 (mixed: fp32 master weights, bf16 compute) | fp16 | fp32 (default: bf16 where the hardware "
              "has it, fp32 on CPU); bf16-true (pure bf16) is refused"),
    "seq": "tokens per sequence (also --seq-len)",
    "stage_layers": "decoder layers per pipeline stage, '/'-separated, e.g. 19/20/21/20 (default: even)",
    "recompute_layers": "per stage, how many layers use `recompute`, e.g. 4/3/1/0 (default: all)",
    "loss": ("chunked (default: what advisor train runs, the chunked cross-entropy where it can) | hf "
             "(transformers' loss over the whole logits, as your own HF Trainer or accelerate script runs it)"),
}


def layers_per_stage(n_layers: int, layout: Layout) -> list[int]:
    """Decoder layers per pipeline stage: the layout's own split, else even with any remainder on
    the later stages (the first stage already holds the embedding and the most micro-batches in
    flight, the last the LM head and loss). The planner's cost model and the trainer's stage cut
    both read this, so what is predicted is what runs."""
    if layout.stage_layers:
        return list(layout.stage_layers)
    base, extra = divmod(n_layers, layout.pp)
    return [base + (1 if stage >= layout.pp - extra else 0) for stage in range(layout.pp)]


def chunk_layers(n_layers: int, layout: Layout) -> list[range]:
    """The decoder layers of each model chunk (virtual stage) of a pipeline, by virtual stage id:
    device d holds chunks d, d + pp, ..., d + (vpp - 1)pp, and the model's layers run through the
    ids in order. Each device's `layers_per_stage` share splits into its vpp chunks as evenly as
    possible, any remainder on its later chunks: they hold fewer micro-batches in flight than its
    first, so the cost model's whole-device pricing of the activations (planner/memory.py
    `micro_batches_in_flight`) is exact when the device's layers divide by vpp and an upper bound
    otherwise (a remainder on the earlier chunks would exceed it). The trainer's cut and its choice
    of recomputed layers read this. With vpp = 1 the chunks are the stages of `layers_per_stage`."""
    vpp = layout.vpp
    sizes = [0] * (layout.pp * vpp)
    for device, held in enumerate(layers_per_stage(n_layers, layout)):
        base, extra = divmod(held, vpp)
        for k in range(vpp):
            sizes[device + k * layout.pp] = base + (1 if k >= vpp - extra else 0)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def safe_name(name: str, max_chars: int = 80) -> str:
    """A file or folder name (or a Slurm job name) from a user's name: letters, digits, dot, dash and
    underscore. A name that cleaning changed gets `+` and a hash of the original, so `a b` and `a_b`
    stay apart (a clean name has no `+`, so it cannot meet a hashed one)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._")[:max_chars] or "_"
    if cleaned == name:
        return cleaned
    return f"{cleaned}+{hashlib.sha256(name.encode('utf-8', 'surrogatepass')).hexdigest()[:8]}"


def check_number(value: float | None, flag: str, *, gt: float | None = None, ge: float | None = None,
                 le: float | None = None) -> None:
    """A command-line number: finite and within its bounds, or one line naming the flag (None: not given)."""
    if value is None:
        return
    if not math.isfinite(value):
        raise UsageError(f"{flag} {value}: must be a finite number")
    if gt is not None and not value > gt:
        raise UsageError(f"{flag} {value:g}: must be > {gt:g}")
    if ge is not None and not value >= ge:
        raise UsageError(f"{flag} {value:g}: must be >= {ge:g}")
    if le is not None and not value <= le:
        raise UsageError(f"{flag} {value:g}: must be <= {le:g}")


def _format_validation_error(exc: ValidationError, what: str) -> str:
    messages = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or what
        msg = err["msg"]
        if err["type"] == "literal_error":
            allowed = err.get("ctx", {}).get("expected", "")
            msg = f"must be one of {allowed}"
        elif err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "value_error" and "error" in err.get("ctx", {}):
            msg = str(err["ctx"]["error"])  # our validators' own sentence, without pydantic's "Value error, "
        messages.append(f"{loc}: {msg}" if loc != what else msg)
    return f"invalid {what}: " + "; ".join(messages)


def validate(model_cls: type[BaseModel], data: dict[str, Any], what: str) -> Any:
    """Build a spec or raise a UsageError whose one line names the field and the allowed values."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise UsageError(_format_validation_error(exc, what)) from None
    except UnicodeEncodeError:  # pydantic-core cannot take a lone surrogate, e.g. a YAML "\ud800" escape
        raise UsageError(f"invalid {what}: it holds text that is not valid Unicode (a lone surrogate)") from None


# Python's int() also reads "1_0" and other scripts' digits ("\u0661\u0662" is 12); a layout is written in ASCII
_ASCII_INT = re.compile(r"[+-]?[0-9]+")
_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def parse_layout_string(text: str) -> dict[str, Any]:
    """Parse ``key=value,key=value`` (or space-separated) into a dict, rejecting unknown keys with the
    allowed list and empty items (``dp=8,,tp=1`` is a slip that a value went missing). Blank text is
    no keys: the callers that take it mean "all defaults" (`advisor estimate` without --layout)."""
    out: dict[str, Any] = {}
    items = re.split(r"\s*,\s*|\s+", text.strip()) if text.strip() else []
    if "" in items:
        raise UsageError(f"layout {text.strip()!r} has an empty item: separate key=value items by one comma")
    for raw in items:
        if "=" not in raw:
            raise UsageError(f"malformed layout item '{raw}': expected key=value, e.g. 'tp=2'")
        key, value = (s.strip() for s in raw.split("=", 1))
        if key not in LAYOUT_KEYS_HELP:
            raise UsageError(f"unknown layout key '{key}'; allowed: {', '.join(LAYOUT_KEYS_HELP)}")
        if key in out:
            raise UsageError(f"layout key '{key}' given twice")
        if key in ("stage_layers", "recompute_layers"):
            if not all(_ASCII_INT.fullmatch(v) for v in value.split("/")):
                raise UsageError(f"layout {key}={value}: expected '/'-separated integers, e.g. 10/12")
            out[key] = [int(v) for v in value.split("/")]
        elif key == "sp":
            if value.lower() not in _BOOL_WORDS:
                raise UsageError(f"layout sp={value}: must be 0 or 1")
            out[key] = _BOOL_WORDS[value.lower()]
        elif key in {"dp", "tp", "pp", "vpp", "zero", "mbs", "gas", "seq", "lora_rank"}:
            if not _ASCII_INT.fullmatch(value):
                raise UsageError(f"layout {key}={value}: must be an integer")
            out[key] = int(value)
        else:
            if key == "dtype":
                check_dtype(value)
            out[key] = value
    return out


def resolve_layout(
    text: str, devices: int, hardware: HardwareSpec, seq_len: int | None = None
) -> Layout:
    """Fill defaults (dp from the device count, dtype from the hardware) and validate."""
    fields = parse_layout_string(text)
    if seq_len is not None:
        if "seq" in fields and fields["seq"] != seq_len:
            raise UsageError(f"--seq-len {seq_len} contradicts layout seq={fields['seq']}")
        fields["seq"] = seq_len
    tp, pp = fields.get("tp", 1), fields.get("pp", 1)
    if "dp" not in fields:
        if tp < 1 or pp < 1 or devices % (tp * pp):
            raise UsageError(f"layout tp*pp = {tp * pp} does not divide the {devices} devices")
        fields["dp"] = devices // (tp * pp)
    fields.setdefault("dtype", hardware.default_dtype)
    layout: Layout = validate(Layout, fields, "layout")
    if layout.devices != devices:
        raise UsageError(
            f"dp*tp*pp = {layout.dp}*{layout.tp}*{layout.pp} = {layout.devices} "
            f"but there are {devices} devices (--nodes x --gpus-per-node)"
        )
    if not hardware.supports(layout.dtype):
        raise UsageError(f"hardware '{hardware.name}' does not run {layout.dtype}")
    return layout


# ------------------------------------------------------------------------------------------------
# Reading a YAML file a user wrote (plan, task, hardware), bounded before any validation sees it.
#
# YAML aliases let a file of a few hundred bytes stand for billions of values ("billion laughs":
# nine anchors of nine aliases each); PyYAML builds the shared objects cheaply, but every walk over
# them afterwards (pydantic, the finite-number check, a JSON dump) pays the expanded size. So the
# file's size is capped and the values that aliases add are counted while the document is composed:
# past MAX_ALIASED_VALUES the file is refused in one line, before anything else reads it.

MAX_YAML_BYTES = 4 * 1024**2
# Values that aliases may add beyond those written out: room for anchors reused by hand (a shared
# filter block in each stage), far below what makes validation slow (it walks ~1e6 values a second).
MAX_ALIASED_VALUES = 10_000


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, counting the values each alias stands for."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._weights: dict[int, int] = {}  # id(node) -> values under it, aliases expanded
        self._aliased = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            node = super().compose_node(parent, index)
            weight = self._weights.get(id(node))
            if weight is None:  # the anchor is still open: the alias points into itself
                raise UsageError(f"recursive YAML alias *{event.anchor}")
            self._aliased += weight
            if self._aliased > MAX_ALIASED_VALUES:
                raise UsageError(f"YAML aliases expand to more than {MAX_ALIASED_VALUES:,} values (an alias bomb?); "
                                 "write the values out")
            return node
        node = super().compose_node(parent, index)
        self._weights[id(node)] = 1 + sum(self._weights.get(id(child), 1) for child in _children(node))
        return node


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def parse_user_yaml(text: str, what: str) -> Any:
    """The document in `text`, or one UsageError line naming `what` (a file, in words)."""
    if len(text) > MAX_YAML_BYTES:
        raise UsageError(f"{what} is larger than {MAX_YAML_BYTES // 1024**2} MiB")
    loader = None
    try:
        loader = _BoundedLoader(text)  # its reader refuses non-printable characters already
        return loader.get_single_data()
    except UsageError as exc:
        raise UsageError(f"{what}: {exc}") from None
    except (ValueError, yaml.YAMLError) as exc:
        raise UsageError(f"{what} is not valid YAML: {exc}") from None
    except RecursionError:  # thousands of nested brackets
        raise UsageError(f"{what} nests too deep") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_user_yaml(path: Path, what: str) -> Any:
    """Read and parse a user's YAML file: at most MAX_YAML_BYTES of UTF-8, aliases bounded.
    Raises FileNotFoundError for a missing file (callers word that themselves), else UsageError."""
    try:
        size = path.stat().st_size
        if size > MAX_YAML_BYTES:
            raise UsageError(f"{what} is {size / 1024**2:.1f} MiB, larger than {MAX_YAML_BYTES // 1024**2} MiB")
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot read {what}: {exc.strerror or exc}") from None
    return parse_user_yaml(text, what)



def read_user_mapping(path: Path, what: str) -> dict[str, Any]:
    """A user's YAML file that must hold a mapping (a plan, a task): one line for a missing file or
    any other top level."""
    try:
        data = read_user_yaml(path, f"{what} {path}")
    except FileNotFoundError:
        raise UsageError(f"{what} not found: {path}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{what} {path}: expected a mapping")
    return data

# ------------------------------------------------------------------------------------------------
# estimate results (the JSON contract of `advisor estimate`, see docs/architecture.md)

# A plan file carries them: a key the model does not know is a typo or an edit that would be lost.
# Non-finite figures are refused when a plan is read (`refuse_non_finite`), not when computed.
ESTIMATE_CONFIG = ConfigDict(extra="forbid")


class ModelSize(BaseModel):
    model_config = ESTIMATE_CONFIG

    params: int
    trainable_params: int


class MemoryEstimate(BaseModel):
    """Bytes on the most loaded device at its peak moment."""

    model_config = ESTIMATE_CONFIG

    weights: int
    gradients: int
    optimizer: int
    activations: int
    other: int = Field(description="transients: logits/loss buffers, comm buckets, gathered ZeRO-3 "
                                   "layers, optimizer-step temporaries")
    peak: int
    capacity: int = Field(description="device memory less the runtime's reserve")
    fits: bool
    stage: int = Field(0, description="pipeline stage of the most loaded device")
    host_offload: int = Field(0, description="bytes per device kept in host RAM by offload")
    host_fits: bool = Field(True, description="offloaded states of a node's devices fit its host RAM")


class TimeEstimate(BaseModel):
    """Seconds per optimizer step on the slowest pipeline stage."""

    model_config = ESTIMATE_CONFIG

    step_s: float
    compute_s: float = Field(description="FLOP time incl. recomputation and memory-bound kernels")
    comm_exposed_s: float = Field(description="TP, PP and DP/ZeRO communication not hidden")
    bubble_s: float
    optimizer_s: float
    offload_s: float = 0.0
    tp_comm_s: float = 0.0
    pp_comm_s: float = 0.0
    dp_comm_s: float = Field(0.0, description="DP/ZeRO collectives before overlap")


class ThroughputEstimate(BaseModel):
    model_config = ESTIMATE_CONFIG

    tokens_per_s: float
    model_tflops_per_device: float = Field(description="model FLOPs only (no recomputation)")
    mfu: float


class Estimate(BaseModel):
    model_config = ESTIMATE_CONFIG

    model: ModelSize
    memory: MemoryEstimate
    time: TimeEstimate
    throughput: ThroughputEstimate
    compute_fraction: float
    layout: Layout
    hardware: str
    devices: int
    nodes: int
    notes: list[str] = Field(default_factory=list)
    engine: str | None = Field(
        None, description="the engine whose behaviour was priced: one of ours (plain, deepspeed, fsdp2, "
                          "pipeline) or a published one (megatron); specs.capabilities PRICED_ENGINES")
