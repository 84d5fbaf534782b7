"""How each engine keeps its state and what it communicates: declared once, read by the cost model,
the memory model, the exports, the dry run and the trainer instead of the engine's name.

An engine here is a name the cost model prices: the four engines `advisor train` runs (plain/DDP,
DeepSpeed, FSDP2, pipeline; which one runs a layout is `specs.capabilities.engine_for`), and the
priced-only ones: published engines (Megatron-LM as Narayanan et al. 2021 ran it; PyTorch FSDP as
llm-foundry and fms-fsdp ran theirs) and the plain engine as it trained before issue 28 (the H200
evidence was measured with it). What each engine *runs* (features, dtypes, ZeRO stages) is
`specs.capabilities.ENGINES`; how it runs them is here. No code outside these two modules compares
an engine's name (tests/test_layers.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EngineName = Literal["plain", "deepspeed", "fsdp2", "pipeline"]

# Priced only (`--engine megatron|fsdp` of estimate, plan and report capacity, and the GPU evidence).
MEGATRON = "megatron"
# PyTorch FSDP as llm-foundry (mixed precision PURE) and IBM's fms-fsdp (bfSixteen) ran their published
# runs: weights gathered and gradients reduced in bf16, where our FSDP2 engine reduces in fp32;
# otherwise priced as our FSDP2 engine.
FSDP_BF16 = "fsdp-bf16"
# The plain engine as it trained until issue 28: the module cast to 16 bits, Adam on the 16-bit
# weights with no fp32 master, TF32 off. No longer run (a 16-bit dtype is mixed precision now);
# priced only for the GPU evidence measured with it (docs/evidence/h200, tests/test_h200_evidence.py).
PURE16_PLAIN = "plain-pure16"


@dataclass(frozen=True)
class EngineTraits:
    """One engine's behaviour as the prices and the exports need it."""

    name: str
    runs_as: str  # the engine of ours whose code path it runs or is priced as (itself where it is one)
    # -- how it keeps state --------------------------------------------------------------------
    # FSDP2: weights, gradients and optimizer states sharded across data-parallel replicas (dp > 1)
    # whatever the ZeRO stage (ZeRO 1/2 only change when it reshards)
    shards_replicas: bool = False
    # at ZeRO-3, each unit is resharded after forward and gathered again for backward (FSDP2 outside a
    # pipeline; torchtitan's pipeline keeps them gathered)
    reshards_after_forward: bool = False
    # DeepSpeed: the trainable weights flattened into one fp32 partition per rank (its optimizer
    # updates one tensor; ZeRO-3 keeps a window of live gathered parameters; reduce buckets)
    flat_partition: bool = False
    # DDP across replicas: the bucket buffers persist beside the `.grad` tensors
    ddp_buckets: bool = False
    # Megatron-LM: contiguous gradient buffers kept across steps (dp > 1), each micro-batch's
    # gradients summed into them
    persistent_gradients: bool = False
    # whole `.grad` tensors below ZeRO-3 (plain, DDP, DeepSpeed ZeRO-1/2), where a tied embedding's
    # gradient copies meet at the end of backward
    whole_gradients: bool = False
    # tensor parallelism splits the embedding, the LM head and the logits too (Megatron's
    # vocab-parallel layers); our DTensor engines split the decoder layers only
    vocab_parallel: bool = True
    # passes over a rank's gradients that the step's norm and clipping make (the trainer clips at 1.0
    # unless told otherwise): torch's clip_grad_norm_ reads them once for the norm and scales them in
    # place (3: read, read, write); the sharded engines' norm squares each gradient into a temporary
    # first (5: trainer/engines/optimizer.py grad_norm_squared); DeepSpeed reads its partition for the
    # norm and scales it (3). 0: not priced (Megatron-LM's runs, priced from the paper's kernels)
    clip_passes: int = 0
    # -- what it communicates --------------------------------------------------------------------
    # ZeRO-1 all-gathers the weight partitions its ranks updated after the step (DeepSpeed)
    gathers_after_step: bool = False
    # the dtype gradients are reduced in across replicas; None: the gradients' own
    reduce_dtype: str | None = None
    # FSDP's prefetch: each unit's all-gather runs on its own stream ahead of the compute that needs it
    # (the next unit's while this one computes; in backward the previous unit's reduce-scatter too),
    # so a step's data-parallel collectives hide behind its compute but for one unit's per micro-batch
    # (Zhao et al. 2023, "PyTorch FSDP", section 3.3 on prefetching; fms-fsdp's README: "FSDP with
    # overlap in computation and communication"). Declared for the published FSDP runs; not for our
    # engines, whose overlap on a GPU has not been measured (declared on FSDP2 it priced Llama 3 70B on
    # 2048 H100s 19% below Meta's GPU-hours: tests/test_capacity_engine.py bounds it at 15%)
    prefetches_units: bool = False
    # -- kernels -----------------------------------------------------------------------------------
    # each op launched from Python (an eager step: the host floor applies); Megatron-LM 2021's fused
    # layer, tensor-parallel collectives and optimizer are counted kernel by kernel instead
    # (planner/megatron2021.py)
    eager: bool = True
    # fp32 GEMMs on TF32 tensor cores where the GPU has them (our workers allow it)
    tf32: bool = True
    # torch.distributed.pipelining: the last stage's logits are the schedule's output, kept until
    # that micro-batch's backward
    pipeline_schedule: bool = False
    # -- launching ---------------------------------------------------------------------------------
    # accelerate's distributed type for an exported accelerate.yaml ("" for several processes of the
    # plain engine, None: accelerate would run something else, so no file is written)
    accelerate_type: str | None = ""
    # the engine is DeepSpeed: its exported deepspeed.json, its native ops built before forking
    deepspeed: bool = False
    # tensor parallelism as DTensor over HF modules (trainer/parallelize.py)
    dtensor: bool = False


_PLAIN = EngineTraits("plain", "plain", ddp_buckets=True, whole_gradients=True, clip_passes=3)
_FSDP2 = EngineTraits("fsdp2", "fsdp2", shards_replicas=True, reshards_after_forward=True, vocab_parallel=False,
                      clip_passes=5, accelerate_type="FSDP", dtensor=True)

TRAITS: dict[str, EngineTraits] = {
    "plain": _PLAIN,
    "deepspeed": EngineTraits("deepspeed", "deepspeed", flat_partition=True, whole_gradients=True, clip_passes=3,
                              gathers_after_step=True, accelerate_type="DEEPSPEED", deepspeed=True),
    "fsdp2": _FSDP2,
    "pipeline": EngineTraits("pipeline", "pipeline", shards_replicas=True, vocab_parallel=False, clip_passes=5,
                             pipeline_schedule=True, accelerate_type=None, dtensor=True),
    MEGATRON: EngineTraits(MEGATRON, MEGATRON, persistent_gradients=True, eager=False, accelerate_type=None),
    FSDP_BF16: EngineTraits(**{**_FSDP2.__dict__, "name": FSDP_BF16, "reduce_dtype": "bf16", "prefetches_units": True}),
    PURE16_PLAIN: EngineTraits(**{**_PLAIN.__dict__, "name": PURE16_PLAIN, "tf32": False}),
}


def traits(engine: str) -> EngineTraits:
    """The declared traits of `engine` (one the cost model prices: see `TRAITS`)."""
    return TRAITS[engine]


def runs_as(engine: str) -> str:
    """The engine of ours whose behaviour `engine` has: itself, or the one a priced-only variant
    is priced as (the pre-issue-28 plain engine; published FSDP as our FSDP2)."""
    return TRAITS[engine].runs_as if engine in TRAITS else engine

