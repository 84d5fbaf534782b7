"""Build the model a plan describes and the engine that trains it: plain, DDP or DeepSpeed ZeRO
here; tensor parallel, FSDP2 and pipeline engines in `trainer.parallel_engines` (`make_engine`
dispatches).

Each engine offers the same four operations to the training loop: one micro-step (forward and
backward of one micro-batch), one optimizer step at a given learning rate (returning the global
gradient norm), and saving and loading its full state. The layout (`advisor.specs.Layout`) is the
single source of truth for degrees, as `ParallelDims` is in torchtitan.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from advisor.errors import UsageError
from advisor.specs import Layout, ModelSpec

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_model(spec: ModelSpec, layout: Layout, seed: int, weights: str | None = None) -> torch.nn.Module:
    """The HF model from its config (random init, seeded) or from a local folder of weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    if weights:
        model = AutoModelForCausalLM.from_pretrained(weights, local_files_only=True, attn_implementation="sdpa")
    else:
        config = AutoConfig.for_model(**spec.hf_config)
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if layout.dtype != "fp32" and layout.zero == 0:
        model = model.to(_DTYPES[layout.dtype])  # DeepSpeed casts itself from its config
    if layout.recompute != "none":
        apply_recomputation(model, layout)
    if layout.method in ("lora", "qlora"):
        if layout.method == "qlora" and not torch.cuda.is_available():
            raise UsageError("QLoRA needs bitsandbytes' 4-bit kernels on CUDA; this machine has none (use lora)")
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=layout.lora_rank, lora_alpha=2 * layout.lora_rank,
                                                 lora_dropout=0.0, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    return model


def apply_recomputation(model: torch.nn.Module, layout: Layout) -> None:
    """Checkpoint the first `recompute_layers` decoder layers (all when unset).

    transformers checkpoints every layer or none; the plan may recompute only some, so we flip the
    per-layer flag that its GradientCheckpointingLayer reads. Selective recomputation (attention
    core only) has no hook in HF modules: we recompute the whole layer for it and say so.
    """
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if layout.recompute_layers is None:
        return
    keep = sum(layout.recompute_layers)
    layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")
              and m.__class__.__name__.endswith("DecoderLayer")]
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < keep


def forward_backward(model: torch.nn.Module, input_ids: torch.Tensor, gas: int) -> float:
    """One micro-batch's forward and backward (the loss scaled for accumulation); its mean token loss."""
    loss = model(input_ids=input_ids, labels=input_ids).loss
    (loss / gas).backward()
    return float(loss.detach())


class Engine:
    """Plain PyTorch (one process) or DDP: AdamW, optional clipping, no_sync while accumulating."""

    def __init__(self, model: torch.nn.Module, layout: Layout, clip: float, weight_decay: float = 0.0):
        self.layout = layout
        self.clip = clip
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        params = [p for p in model.parameters() if p.requires_grad]
        cuda = next(model.parameters()).is_cuda
        self.optimizer = torch.optim.AdamW(params, lr=0.0, weight_decay=weight_decay, fused=cuda or None,
                                           foreach=False if not cuda else None)
        self.params = params
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, gradient_as_bucket_view=True)
        self.model = model
        self._micro = 0

    def micro_step(self, input_ids: torch.Tensor) -> float:
        """Forward and backward of one micro-batch; returns its mean token loss."""
        self._micro += 1
        boundary = self._micro % self.layout.gas == 0
        sync = contextlib.nullcontext() if boundary or self.world == 1 else self.model.no_sync()
        with sync:
            return forward_backward(self.model, input_ids, self.layout.gas)

    def optimizer_step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        max_norm = self.clip if self.clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def state(self) -> dict[str, Any]:
        module = self.model.module if hasattr(self.model, "module") else self.model
        trainable = {k: v for k, v in module.state_dict().items()}
        return {"model": trainable, "optimizer": self.optimizer.state_dict()}

    def save(self, directory: Path) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:  # replicas are identical
            torch.save(self.state(), directory / "engine.pt")

    def load(self, directory: Path) -> None:
        state = torch.load(directory / "engine.pt", map_location="cpu", weights_only=True)
        module = self.model.module if hasattr(self.model, "module") else self.model
        module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class DeepSpeedEngine:
    """ZeRO-1/2/3 (optionally offloaded) through DeepSpeed, with the config the planner exported."""

    def __init__(self, model: torch.nn.Module, layout: Layout, config: dict[str, Any], clip: float,
                 weight_decay: float = 0.0):
        import deepspeed

        config = dict(config)
        config["gradient_clipping"] = clip  # DeepSpeed clips at 1.0 unless told (NOTES trap 3)
        cpu = not torch.cuda.is_available()
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": weight_decay,
                                                          "torch_adam": cpu}}
        params = [p for p in model.parameters() if p.requires_grad]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        self.layout = layout
        self.model = self.engine

    def micro_step(self, input_ids: torch.Tensor) -> float:
        loss = self.engine(input_ids=input_ids, labels=input_ids).loss
        self.engine.backward(loss)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # DeepSpeed counts micro-steps; it updates only at the boundary
        return float(loss.detach())

    def optimizer_step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag="engine")

    def load(self, directory: Path) -> None:
        self.engine.load_checkpoint(str(directory), tag="engine", load_optimizer_states=True,
                                    load_lr_scheduler_states=False)


EngineChoice = Literal["auto", "deepspeed", "fsdp2"]


def select_backend(layout: Layout, engine: EngineChoice = "auto") -> str:
    """Which engine runs `layout`: "pipeline", "sharded" (DTensor TP and/or FSDP2), "deepspeed"
    or "plain" (one process or DDP). `engine` is the plan's (or `--engine`'s) choice for sharded
    data parallelism; "auto" takes DeepSpeed for ZeRO unless tensor parallelism needs FSDP2."""
    if engine not in ("auto", "deepspeed", "fsdp2"):
        raise UsageError(f"unknown engine {engine!r}: choose auto, deepspeed or fsdp2")
    if engine == "deepspeed" and (layout.tp > 1 or layout.pp > 1):
        raise UsageError(f"engine=deepspeed runs data parallelism and ZeRO only; the plan asks for tp={layout.tp}, "
                         f"pp={layout.pp} (use --engine auto or fsdp2)")
    if layout.pp > 1:
        return "pipeline"
    if layout.tp > 1:
        return "sharded"
    if engine == "fsdp2" and (layout.zero or layout.dp > 1):
        return "sharded"
    if layout.zero:
        return "deepspeed"
    return "plain"


def make_engine(model: torch.nn.Module, layout: Layout, deepspeed_config: dict[str, Any] | None, clip: float,
                engine: EngineChoice = "auto"):
    """The engine for `layout` (see `select_backend`); the DTensor engines live in
    trainer.parallel_engines."""
    backend = select_backend(layout, engine)
    if backend == "pipeline":
        from trainer.parallel_engines import PipelineEngine

        return PipelineEngine(model, layout, clip)
    if backend == "sharded":
        from trainer.parallel_engines import ShardedEngine

        return ShardedEngine(model, layout, clip)
    if backend == "deepspeed":
        assert deepspeed_config is not None
        return DeepSpeedEngine(model, layout, deepspeed_config, clip)
    return Engine(model, layout, clip)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
