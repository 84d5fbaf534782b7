"""What `advisor train` runs: the one declaration that the planner's search and the trainer's checks
both read, so that what the planner may choose is exactly what the trainer runs.

Every layout runs on exactly one engine (`engine_for`). Each engine declares, in `ENGINES`, the
features it runs *as the cost model prices them*; a feature that would run as something else
(selective recomputation run as full, QLoRA run as 16-bit LoRA) is absent until it runs as priced.
`runnable_problem` is the single judge: the structural rules of `specs.layout_rules` (does the
model split this way at all?), then the engine's declaration (does this trainer run it?). The
planner skips every layout it refuses; the trainer refuses the same layouts with the same line.
Whoever teaches an engine a new feature adds it here, and both sides follow.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

from specs.engine_traits import FSDP_BF16, MEGATRON, PURE16_PLAIN, TRAITS, EngineName, runs_as, traits
from specs.errors import UsageError
from specs.layout_rules import ModelShape, config_value, layout_problem
from specs.core import DTYPE_BYTES, Layout

EngineChoice = Literal["auto", "deepspeed", "fsdp2"]
ENGINE_CHOICES: tuple[str, ...] = ("auto", "deepspeed", "fsdp2")


@dataclass(frozen=True)
class EngineCapability:
    """The features one engine runs as priced."""

    name: EngineName
    description: str
    zero_stages: frozenset[int]
    offloads: frozenset[str]
    methods: frozenset[str]
    recompute: frozenset[str]
    dtypes: frozenset[str]
    tensor_parallel: bool = False
    sequence_parallel: bool = False
    max_vpp: int = 1
    tied_embeddings: bool = True
    # tensor parallelism with fewer key/value heads than tp (each head replicated on tp/kv ranks)
    replicated_kv_heads: bool = False
    qlora_devices: frozenset[str] = frozenset()
    # zero=0 across data-parallel replicas runs as priced: whole replicas, one gradient all-reduce
    replicas_without_zero: bool = True
    # the loss runs chunked (trainer/chunked_loss.py, `chunked_loss`); otherwise HF's whole-logits loss
    chunked_loss: bool = False


ENGINES: dict[EngineName, EngineCapability] = {
    "plain": EngineCapability(
        "plain", "one process, or DDP across data-parallel replicas",
        zero_stages=frozenset({0}), offloads=frozenset({"none"}), methods=frozenset({"full", "lora"}),
        recompute=frozenset({"none", "selective", "full"}), dtypes=frozenset({"bf16", "fp32"}),
        # a bitsandbytes NF4 base (trainer/adapters.py), tested on CPU; CUDA runs bitsandbytes' own kernels (untested here)
        qlora_devices=frozenset({"cpu", "cuda"}), chunked_loss=True),
    # No QLoRA: ZeRO 1-3 do train a 4-bit base, but DeepSpeed casts the module to its dtype (the fp32
    # embeddings, norms and adapters of the recipe become bf16, with fp32 master copies), which is not
    # what planner/memory.py prices for QLoRA.
    "deepspeed": EngineCapability(
        "deepspeed", "DeepSpeed ZeRO 1-3, optionally offloaded to host memory",
        zero_stages=frozenset({1, 2, 3}), offloads=frozenset({"none", "optimizer", "optimizer+params"}),
        methods=frozenset({"full", "lora"}), recompute=frozenset({"none", "selective", "full"}),
        dtypes=frozenset({"bf16", "fp16", "fp32"}), chunked_loss=True),
    "fsdp2": EngineCapability(
        "fsdp2", "DTensor tensor parallelism and/or FSDP2 over the data-parallel replicas",
        zero_stages=frozenset({0, 1, 2, 3}), offloads=frozenset({"none"}), methods=frozenset({"full"}),
        recompute=frozenset({"none", "selective", "full"}), dtypes=frozenset({"bf16", "fp32"}), tensor_parallel=True,
        sequence_parallel=True, chunked_loss=True),
    "pipeline": EngineCapability(
        "pipeline", "torch.distributed.pipelining 1F1B or interleaved 1F1B stages, FSDP2 across replicas, "
        "TP inside a stage",
        zero_stages=frozenset({0, 1, 2, 3}), offloads=frozenset({"none"}), methods=frozenset({"full"}),
        recompute=frozenset({"none", "selective", "full"}), dtypes=frozenset({"bf16", "fp32"}), tensor_parallel=True,
        sequence_parallel=True, max_vpp=4, tied_embeddings=False, replicas_without_zero=False),
}


# The engine whose behaviour a price is for (`--engine` of estimate, plan and report capacity):
# ours, what `advisor train` runs (the engine `engine_for` picks per layout), or one that produced
# published runs, priced here and never run (specs.engine_traits: MEGATRON, FSDP_BF16).
OURS = "ours"
PRICED_ENGINES: dict[str, str] = {
    "ours": "our engines, as advisor train runs the layout (plain/DDP, DeepSpeed, FSDP2, pipeline)",
    "megatron": "Megatron-LM (fused kernels, 4 TP all-reduces per layer, fp32 master in the optimizer), priced only",
    "fsdp": "PyTorch FSDP with bf16 reductions, as llm-foundry and fms-fsdp run it, priced only",
}
_COST_ENGINES = {"megatron": MEGATRON, "fsdp": FSDP_BF16}
# What a published engine's runs choose from, where that is less than every layout the cost model
# prices (the planner's search space keys): FSDP's published runs shard data parallelism alone.
PRICED_ENGINE_LIMITS: dict[str, dict[str, tuple]] = {
    "fsdp": {"tp_degrees": (1,), "pp_degrees": (1,), "offloads": ("none",), "sequence_parallel": (False,)},
}


def priced_engine_problem(priced: str, layout: Layout) -> str | None:
    """Why `--engine priced` cannot price `layout` (None: it can)."""
    limits = PRICED_ENGINE_LIMITS.get(priced, {})
    given = {"tp_degrees": layout.tp, "pp_degrees": layout.pp, "offloads": layout.offload,
             "sequence_parallel": layout.sp}
    broken = [key for key, allowed in limits.items() if given[key] not in allowed]
    if not broken:
        return None
    return (f"--engine {priced} prices data-parallel sharding only (tp=1, pp=1, no offload); the layout asks "
            f"for tp={layout.tp}, pp={layout.pp}, offload={layout.offload}")


def cost_engine(priced: str, choice: str = "auto") -> str:
    """What the cost model is asked to price for `--engine priced`: our engine choice, or a
    published engine's name. One line and exit 2 for an unknown one."""
    if priced not in PRICED_ENGINES:
        raise UsageError(f"--engine {priced!r}: choose {', '.join(PRICED_ENGINES)}")
    return choice if prices_ours(priced) else _COST_ENGINES[priced]


def prices_ours(priced: str) -> bool:
    """Whether `--engine priced` prices the engines `advisor train` runs (not a published one)."""
    return priced == OURS


def tf32_gemms(engine: str) -> bool:
    """Whether fp32 GEMMs on a GPU run on TF32 tensor cores: our engines' workers allow it on
    Ampere and later (profiler.ranks `allow_tf32`); the pre-issue-28 trainer did not."""
    return engine not in TRAITS or traits(engine).tf32


PrecisionMode = Literal["fp32", "autocast", "fsdp", "deepspeed", "master16", "frozen16", "cast16"]


@dataclass(frozen=True)
class Precision:
    """How a layout's dtype runs on its engine: what the trainer builds (trainer/model.py,
    trainer/engines, trainer/parallelize.py) and what the cost model prices (planner/memory.py).

    A 16-bit dtype is always mixed precision (issue 28): the weights the optimizer updates and its
    Adam moments are fp32, the GEMMs run in 16 bits. The modes:
    - ``fp32``: everything in fp32;
    - ``autocast`` (plain, DDP, tensor or pipeline parallelism without FSDP2): fp32 parameters,
      gradients and moments; forward and loss run under ``torch.autocast``, which keeps a 16-bit copy
      of every weight it casts until that weight's backward (Lightning's bf16-mixed, torchtitan
      without FSDP);
    - ``fsdp`` (FSDP2 across data-parallel replicas): fp32 shards, gradients and moments; each unit
      is gathered in 16 bits and its gradients reduced in fp32 (``MixedPrecisionPolicy``);
    - ``deepspeed``: DeepSpeed casts the module to 16 bits and keeps fp32 master partitions and
      moments in its ZeRO optimizer (ZeRO paper, section 3.1: K = 12);
    - ``frozen16`` (LoRA, QLoRA without DeepSpeed): the frozen base in 16 bits, the adapters, their
      gradients and moments in fp32: no update is small against a 16-bit weight;
    - ``cast16``: fp16 outside DeepSpeed, which no other engine runs (no loss scaling there,
      `engine_problem`): the module cast to fp16, priced as pure 16-bit for published tables;
    - ``master16``: Megatron-LM, priced only: its module in the layout's 16-bit dtype and an fp32
      master copy in its optimizer. Under bf16 it accumulates and all-reduces the gradients in fp32
      buffers (`--accumulate-allreduce-grads-in-fp32`, on for bf16 by default); under fp16 its
      gradients stay fp16 and the optimizer takes an fp32 copy of them. Megatron-LM's README
      ("Distributed Optimizer"): 20 bytes per parameter for fp16, 18 for bf16, 16 for fp32 (no
      master), and 4 + 16/d, 6 + 12/d, 8 + 8/d with the distributed optimizer (ZeRO-1 here).
    """

    mode: PrecisionMode
    # bytes per element of the trainable weights as the model holds them
    weight_bytes: int
    # a separate fp32 copy of the trainable weights inside the optimizer
    master: bool
    # bytes per element of their gradients as the engine keeps and reduces them (None: weight_bytes)
    grad_bytes: int | None = None
    # the optimizer takes an fp32 copy of the 16-bit gradients (Megatron-LM's fp16), kept and
    # partitioned with its states
    fp32_grad_copy: bool = False

    @property
    def gradient_bytes(self) -> int:
        return self.weight_bytes if self.grad_bytes is None else self.grad_bytes

    @property
    def autocast(self) -> bool:
        return self.mode == "autocast"


def fsdp_shards(layout: Layout, engine: str) -> bool:
    """FSDP2 shards weights, gradients and optimizer states across the data-parallel replicas
    whatever the ZeRO stage (ZeRO 1/2 only change when it reshards)."""
    return layout.dp > 1 and _shards_replicas(engine)


@functools.lru_cache(maxsize=None)
def _shards_replicas(engine: str) -> bool:
    return engine in TRAITS and traits(engine).shards_replicas


def precision(layout: Layout, engine: str) -> Precision:
    """How `layout.dtype` runs on `engine` (see `Precision`): the one rule both the trainer and the
    cost model read."""
    # cached on what it reads: the planner asks it ~600,000 times for one plan of 256 GPUs
    return _precision(layout.dtype, layout.method, layout.zero, fsdp_shards(layout, engine), engine)


@functools.lru_cache(maxsize=None)
def _precision(dtype: str, method: str, zero: int, fsdp: bool, engine: str) -> Precision:
    if engine == MEGATRON:
        if dtype == "fp32":
            return Precision("fp32", 4, master=False)
        if dtype == "bf16":
            return Precision("master16", 2, master=True, grad_bytes=4)
        return Precision("master16", DTYPE_BYTES[dtype], master=True, fp32_grad_copy=True)
    if engine == "deepspeed":
        if dtype == "fp32":
            # stage 3 reuses an fp32 partition as its master (stage3.py, _create_fp32_partitions);
            # stages 1-2 clone theirs into the optimizer even when the model is fp32
            return Precision("fp32", 4, master=zero != 3)
        return Precision("deepspeed", DTYPE_BYTES[dtype], master=True)
    if dtype == "fp32":
        return Precision("fp32", 4, master=False)
    if method != "full":
        return Precision("frozen16", 4, master=False)
    if dtype != "bf16" or engine == PURE16_PLAIN:
        return Precision("cast16", DTYPE_BYTES[dtype], master=False)
    if fsdp:
        return Precision("fsdp", 4, master=False)
    return Precision("autocast", 4, master=False)


def autocast_kept_dtype(layout: Layout, engine: str) -> str:
    """The dtype of what bf16-mixed keeps in fp32 where a 16-bit module holds the layout's dtype:
    under autocast the residual stream (the fp32 embedding's output plus 16-bit GEMM outputs
    promote to fp32; a pipeline's boundary activations) and a weight's gradient as backward makes it
    (cast back to its fp32 parameter); the layout's dtype elsewhere (FSDP2 and DeepSpeed compute on
    16-bit weights)."""
    return "fp32" if precision(layout, engine).autocast else layout.dtype


# The trainer's tensor-parallel plan (trainer/parallelize.py) of a Llama-style decoder layer:
# Megatron's split (Shoeybi et al. 2019, section 3), the first linear of each block split by output
# columns, the second by input rows. Unlike Megatron, which fuses q/k/v and gate/up into one GEMM
# each, every HF projection is its own column-parallel module, so without sequence parallelism
# each all-reduces its input gradient on its own: 5 all-reduces backward per layer, 2 forward
# (counted by the cost model, `planner.comm_time.tp_collectives`).
COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
# The norms that sequence parallelism runs on sequence shards (Korthikanti et al. 2022, section 4.2).
SEQUENCE_PARALLEL_NORMS = ("input_layernorm", "post_attention_layernorm")

# Tokens per chunk of the chunked loss: one chunk's logits (in the layout's dtype, their fp32 up-cast
# and log-softmax) are all the loss holds at once, 256 x vocab x 4 bytes each in fp32 (125 MiB at a
# 128k vocabulary). Few enough rows to bound that, enough that the head's GEMM (256 x hidden x vocab)
# stays efficient; Liger's fused linear cross-entropy picks about as many for 8k tokens at 128k.
LOSS_CHUNK_TOKENS = 256

# Causal LMs whose forward computes `loss_function(lm_head(decoder(...).last_hidden_state), labels)`
# and nothing more (no logit soft-capping or scaling): the chunked loss reproduces their loss exactly.
CHUNKED_LOSS_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2"})


def chunked_loss(layout: Layout, engine: EngineName, model_type: str, hidden_size: int) -> bool:
    """Whether the trainer computes this layout's loss chunk by chunk (trainer/chunked_loss.py) rather
    than through HF's loss over the whole logits; the cost model prices whichever runs.

    The pipeline engine's schedule takes the last stage's logits as its output and applies the loss
    outside the stage, so it keeps HF's loss. Sequence parallelism hands the LM head a
    sequence-sharded DTensor that its input hook gathers: chunking it would split that hook's input,
    so sp keeps HF's loss too. `loss=hf` asks for HF's loss (a user's own script runs it). Elsewhere
    it runs where it holds less (`chunked_loss_holds_less`)."""
    if layout.loss == "hf":
        return False
    runs = ENGINES[runs_as(engine)].chunked_loss and not layout.sp and model_type in CHUNKED_LOSS_MODEL_TYPES
    return runs and chunked_loss_holds_less(layout, hidden_size, engine)


def chunked_loss_holds_less(layout: Layout, hidden_size: int, engine: str = "plain") -> bool:
    """Whether the chunked loss's backward holds no more than HF's, per vocabulary entry
    (planner/memory.py `logits_transient_bytes` prices both): HF three fp32 logits of the whole
    micro-batch; the chunked loss three of one chunk, and with a trainable head beside them its
    gradient's running sum, which at each chunk's accumulation is three head gradients at once
    (the sum so far, the chunk's, their sum). Short micro-batches of a wide trainable head keep
    HF's loss."""
    tokens = layout.mbs * layout.seq
    if tokens <= LOSS_CHUNK_TOKENS:
        return True  # one chunk: the same buffers
    # the head's gradient as backward makes it (fp32 under autocast)
    gradient_bytes = DTYPE_BYTES[autocast_kept_dtype(layout, engine)]
    head_gradient = hidden_size * gradient_bytes if layout.method == "full" else 0
    return max(3 * 4 * LOSS_CHUNK_TOKENS + head_gradient, 3 * head_gradient) < 3 * 4 * tokens


def engine_for(layout: Layout, choice: str = "auto") -> EngineName:
    """The engine that runs `layout`. `choice` is the plan's (or `--engine`'s) back-end for sharded
    data parallelism: "auto" takes DeepSpeed for ZeRO without tp/pp, FSDP2 or the pipeline engine
    where tensor or pipeline parallelism needs DTensor."""
    if choice not in ENGINE_CHOICES:
        raise UsageError(f"unknown engine {choice!r}: choose {', '.join(ENGINE_CHOICES)}")
    if choice == "deepspeed" and (layout.tp > 1 or layout.pp > 1):
        raise UsageError(f"engine=deepspeed runs data parallelism and ZeRO only; the layout asks for "
                         f"tp={layout.tp}, pp={layout.pp} (use --engine auto or fsdp2)")
    if layout.pp > 1:
        return "pipeline"
    if layout.tp > 1:
        return "fsdp2"
    if choice == "fsdp2" and (layout.zero or layout.dp > 1):
        return "fsdp2"
    if layout.zero:
        return "deepspeed"
    return "plain"


def config_shape(hf_config: Any) -> ModelShape:
    """The sizes the rules read, from an HF config (a dict or a PretrainedConfig), under the same
    keys and defaults as the planner's trace (`CONFIG_KEYS`), and whether its head is tied
    (`_ties_head`)."""
    heads = int(config_value(hf_config, "num_heads") or 1)
    hidden = int(config_value(hf_config, "hidden_size") or 1)
    return ModelShape(
        num_heads=heads, num_kv_heads=int(config_value(hf_config, "num_kv_heads") or heads),
        intermediate_size=int(config_value(hf_config, "intermediate_size") or 4 * hidden),
        num_layers=int(config_value(hf_config, "num_layers") or 1), tied_embeddings=_ties_head(hf_config))


def _ties_head(hf_config: Any) -> bool:
    """Whether the model the trainer builds from `hf_config` ties its LM head to its embedding. A dict
    that does not say takes its config class's default, as `AutoConfig.for_model` builds it: a
    config.json written by `save_pretrained` leaves out every value equal to the class's default,
    and GPT-2, Gemma, OPT and BLOOM tie by default where Llama, Mistral and Qwen2 do not."""
    if not isinstance(hf_config, dict):
        return bool(getattr(hf_config, "tie_word_embeddings", False))
    if hf_config.get("tie_word_embeddings") is not None:
        return bool(hf_config["tie_word_embeddings"])
    model_type = hf_config.get("model_type")
    if not model_type:
        return False
    from transformers import AutoConfig  # deferred: only a config that leaves the choice to its class pays the import

    try:
        return bool(AutoConfig.for_model(model_type).tie_word_embeddings)
    except (KeyError, ValueError):  # a model type transformers does not know: the trace's check reports it
        return False


def engine_problem(layout: Layout, shape: ModelShape, device_type: str, engine: EngineCapability) -> str | None:
    """Why `engine` does not run `layout` as priced (None: it does)."""
    name = engine.name
    if layout.zero not in engine.zero_stages:
        return f"the {name} engine does not run zero={layout.zero}"
    if layout.zero == 0 and layout.dp > 1 and not engine.replicas_without_zero:
        return (f"the {name} engine shards across its {layout.dp} data-parallel replicas (FSDP2): plan zero>=1, "
                "not zero=0 (whole replicas)")
    if layout.offload not in engine.offloads:
        return f"the {name} engine does not run offload={layout.offload} (offload runs through DeepSpeed, without tp/pp)"
    if layout.method == "qlora":
        if device_type not in engine.qlora_devices:
            return f"method=qlora (a 4-bit NF4 base) is not run by the {name} engine on {device_type}"
    elif layout.method not in engine.methods:
        return f"method={layout.method} is not run by the {name} engine (LoRA adapters are not split by tp/pp)"
    if layout.recompute not in engine.recompute:
        return f"recompute={layout.recompute} is not run as priced by the {name} engine"
    if layout.dtype not in engine.dtypes:
        return f"dtype={layout.dtype} is not run by the {name} engine (no loss scaling there)"
    if layout.sp and not engine.sequence_parallel:
        return f"sequence parallelism (sp=1) is not run by the {name} engine; plan with sp=0"
    if layout.vpp > engine.max_vpp:
        return f"interleaved pipelines (vpp={layout.vpp}) are not run by the {name} engine; plan with vpp=1"
    if layout.pp > 1 and shape.tied_embeddings and not engine.tied_embeddings:
        return "pp>1 with tied input/output embeddings is not run (the first and last stages would share one weight)"
    if layout.tp > 1 and shape.num_kv_heads % layout.tp and not engine.replicated_kv_heads:
        return (f"tp={layout.tp} does not divide the model's {shape.num_kv_heads} key/value heads: the {name} engine "
                "keeps whole key/value heads on every tensor-parallel rank")
    return None


def runnable_problem(layout: Layout, shape: ModelShape, device_type: str = "cuda", choice: str = "auto") -> str | None:
    """Why `advisor train` cannot run `layout` on this model as priced (None: it can). The planner's
    search and the trainer's checks both call this."""
    structural = layout_problem(layout, shape)
    if structural:
        return structural
    return engine_problem(layout, shape, device_type, ENGINES[engine_for(layout, choice)])


def check_runnable(layout: Layout, shape: ModelShape, device_type: str = "cuda", choice: str = "auto") -> None:
    """`runnable_problem` as the trainer's refusal: one line, exit 2."""
    problem = runnable_problem(layout, shape, device_type, choice)
    if problem:
        raise UsageError(problem)


# The attention kernel the trainer's models run (trainer/attention.py registers it with
# transformers). On CUDA, rows that pack several documents run varlen FlashAttention with no s x s
# mask, which is what the GPU traces price (profiler.model_trace's FlashAttention contract: no mask,
# native GQA); one document per row runs SDPA's causal kernel. On a CPU the models run SDPA with
# transformers' document mask, as the CPU traces of packed rows price it (trace_model(packed=True)).
DOCUMENT_ATTENTION = "advisor_documents"


def attention_implementation(device_type: str) -> str:
    """transformers' `attn_implementation` of the trainer's models on `device_type`."""
    return DOCUMENT_ATTENTION if device_type == "cuda" else "sdpa"
