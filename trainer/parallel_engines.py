"""DTensor engines: tensor parallel and FSDP2 (``ShardedEngine``) and the pipeline
(``PipelineEngine``), with the same four operations as ``trainer.engine.Engine``.

``micro_step(input_ids)`` returns the micro-batch's mean token loss, or ``None`` when the engine
defers the work: a pipeline runs all of a step's micro-batches in one schedule step, on the
gas-th call, and returns their mean there. ``data_rank`` says which data-parallel shard of the
batch this rank reads (TP and PP ranks of one replica read the same sequences). Checkpoints are
torch.distributed.checkpoint folders of model and optimizer state.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist

from advisor.specs import Layout
from trainer.engine import forward_backward
from trainer.parallelize import (
    DTYPES,
    ParallelMesh,
    apply_fsdp,
    apply_tensor_parallel,
    check_parallel_layout,
    clip_grad_norm,
    decoder_layers,
    load_distributed,
    save_distributed,
    shard_units,
)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _compute_dtype(module: torch.nn.Module, layout: Layout) -> torch.dtype | None:
    """The dtype to compute in when the weights are still fp32 (ZeRO plans leave the cast to the
    engine, as DeepSpeed does); None when they already are in the layout's dtype."""
    wanted = DTYPES[layout.dtype]
    current = next(module.parameters()).dtype
    return wanted if current != wanted else None


def _adamw(params: list[torch.nn.Parameter], weight_decay: float) -> torch.optim.Optimizer:
    cuda = params[0].is_cuda
    return torch.optim.AdamW(params, lr=0.0, weight_decay=weight_decay, foreach=False if not cuda else None)


class ShardedEngine:
    """Tensor parallel (Megatron split through DTensor) and/or FSDP2 over the data-parallel
    sub-mesh: DP x TP on a 2-D mesh, or FSDP2 alone as the alternative to DeepSpeed ZeRO.

    ZeRO-3 reshards parameters after forward (gathered again for backward); ZeRO-1/2 keep them
    gathered from forward to backward. Accumulating micro-batches skip the gradient
    reduce-scatter below ZeRO-2 (like DDP's no_sync) and reduce every micro-batch from ZeRO-2 on,
    where unsharded accumulated gradients would defeat the point.
    """

    def __init__(self, model: torch.nn.Module, layout: Layout, clip: float, weight_decay: float = 0.0):
        check_parallel_layout(model, layout)
        self.layout, self.clip = layout, clip
        self.mesh = ParallelMesh.build(layout)
        if layout.tp > 1:
            apply_tensor_parallel(decoder_layers(model), self.mesh.mesh["tp"])
        compute_dtype = _compute_dtype(model, layout)
        self.sharded = layout.dp > 1
        if self.sharded:
            apply_fsdp(model, shard_units(model), self.mesh.mesh["dp"], reshard_after_forward=layout.zero == 3,
                       param_dtype=compute_dtype)
        elif compute_dtype is not None:
            model.to(compute_dtype)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = _adamw(self.params, weight_decay)
        self.data_rank = self.mesh.coordinate("dp")
        self._micro = 0

    def micro_step(self, input_ids: torch.Tensor) -> float:
        """Forward and backward of one micro-batch; returns its mean token loss."""
        self._micro += 1
        if self.sharded:
            boundary = self._micro % self.layout.gas == 0
            self.model.set_requires_gradient_sync(boundary or self.layout.zero >= 2)
        return forward_backward(self.model, input_ids, self.layout.gas)

    def optimizer_step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = clip_grad_norm(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save(self, directory: Path) -> None:
        save_distributed(self.model, self.optimizer, directory)

    def load(self, directory: Path) -> None:
        load_distributed(self.model, self.optimizer, directory)


def stage_layer_split(layout: Layout, n_layers: int) -> list[int]:
    """Decoder layers per pipeline stage: the plan's split, else even with the remainder on the
    later stages (the first stage also holds the embedding, the last the LM head and loss)."""
    if layout.stage_layers:
        return list(layout.stage_layers)
    base, extra = divmod(n_layers, layout.pp)
    return [base + (1 if stage >= layout.pp - extra else 0) for stage in range(layout.pp)]


def _split_padding(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels of a micro-batch whose padding is marked by ids < 0 (bucketed
    prepared data): padding becomes token 0 with label -100, as `trainer.prepared.mask_padding`
    does for whole models (a pipeline stage never runs the model's own forward)."""
    pad = batch < 0
    return batch.masked_fill(pad, 0), batch.masked_fill(pad, -100)


class PipelineStageModule(torch.nn.Module):
    """One pipeline stage cut out of an HF causal LM, keeping the model's parameter names
    (``model.layers.5.…``) so that checkpoints read the same whatever the split.

    The first stage embeds token ids; the others take hidden states. The last stage applies the
    final norm and LM head and returns logits. Attention runs without a mask, which HF's sdpa
    path turns into a causal kernel (shared/NOTES-cpu-stack.md, trap 5: eager would not be causal).
    """

    def __init__(self, model: torch.nn.Module, stage_index: int, layers_per_stage: list[int]):
        super().__init__()
        base = model.model
        if base.config._attn_implementation != "sdpa":
            base.config._attn_implementation = "sdpa"
        first = sum(layers_per_stage[:stage_index])
        keep = range(first, first + layers_per_stage[stage_index])
        kept = torch.nn.ModuleDict({str(i): base.layers[i] for i in keep})
        base.layers = kept  # drops the other stages' layers: this rank never holds them again
        last = stage_index == len(layers_per_stage) - 1
        if stage_index > 0:
            base.embed_tokens = None
        if not last:
            base.norm = None
        self.model = base
        self.lm_head = model.lm_head if last else None
        if not last:
            model.lm_head = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.model
        hidden = base.embed_tokens(x) if base.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = base.rotary_emb(hidden, positions)
        for layer in base.layers.values():
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        if self.lm_head is None:
            return hidden
        return self.lm_head(base.norm(hidden))


class PipelineForward(torch.nn.Module):
    """The whole pipeline as a module for evaluation: ``forward(input_ids, labels).loss``.

    Forward only, one micro-batch of any size, hidden states sent stage to stage; the loss
    computed on the last stage is broadcast so every rank returns the same value.
    """

    def __init__(self, stage: torch.nn.Module, engine: "PipelineEngine"):
        super().__init__()
        self.stage = stage
        self._engine = [engine]  # not a submodule

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        engine = self._engine[0]
        group, index, stages = engine.pp_group, engine.stage_index, engine.layout.pp
        input_ids, padded_labels = _split_padding(input_ids)
        if labels is not None:
            labels = padded_labels
        if index == 0:
            x = input_ids
        else:
            x = torch.empty((*input_ids.shape, engine.hidden_size), dtype=engine.activation_dtype,
                            device=input_ids.device)
            dist.recv(x, src=dist.get_global_rank(group, index - 1), group=group)
        out = self.stage(x)
        loss = torch.zeros((), dtype=torch.float32, device=input_ids.device)
        if index < stages - 1:
            dist.send(out.contiguous(), dst=dist.get_global_rank(group, index + 1), group=group)
        elif labels is not None:
            loss = engine.loss_fn(out, labels).float()
        dist.broadcast(loss, src=engine.last_stage_rank, group=group)
        return SimpleNamespace(loss=loss)


class PipelineEngine:
    """Pipeline parallel through ``torch.distributed.pipelining``: this rank's stage, the 1F1B
    schedule over ``gas`` micro-batches of ``mbs`` sequences (GPipe when gas < pp, which 1F1B
    cannot fill), and FSDP2 over the data-parallel sub-mesh for DP x PP (TP inside each stage
    for tp > 1).

    With data parallelism the stage keeps its parameters gathered between forward and backward:
    resharding after forward would make every micro-batch pay another all-gather (torchtitan).
    """

    def __init__(self, model: torch.nn.Module, layout: Layout, clip: float, weight_decay: float = 0.0):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        check_parallel_layout(model, layout)
        self.layout, self.clip = layout, clip
        self.mesh = ParallelMesh.build(layout)
        self.pp_group = self.mesh.group("pp")
        self.stage_index = self.mesh.coordinate("pp")
        self.last_stage_rank = dist.get_global_rank(self.pp_group, layout.pp - 1)
        self.is_last = self.stage_index == layout.pp - 1
        self.hidden_size = int(model.config.hidden_size)
        vocab = int(model.config.vocab_size)
        hf_loss = model.loss_function
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = \
            lambda logits, labels: hf_loss(logits=logits, labels=labels, vocab_size=vocab)

        split = stage_layer_split(layout, len(decoder_layers(model)))
        stage = PipelineStageModule(model, self.stage_index, split)
        if layout.tp > 1:
            apply_tensor_parallel(stage.model.layers, self.mesh.mesh["tp"])
        compute_dtype = _compute_dtype(stage, layout)
        self.activation_dtype = compute_dtype or next(stage.parameters()).dtype
        if layout.dp > 1:
            apply_fsdp(stage, list(stage.model.layers.children()), self.mesh.mesh["dp"],
                       reshard_after_forward=False, param_dtype=compute_dtype)
        elif compute_dtype is not None:
            stage.to(compute_dtype)
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.optimizer = _adamw(self.params, weight_decay)
        pipeline_stage = PipelineStage(stage, self.stage_index, layout.pp, _device(), group=self.pp_group)
        schedule = Schedule1F1B if layout.gas >= layout.pp else ScheduleGPipe
        # loss_fn returns each micro-batch's mean; the schedule divides gradients by gas
        self.schedule = schedule(pipeline_stage, n_microbatches=layout.gas, loss_fn=self.loss_fn)
        self.stage = stage
        self.model = PipelineForward(stage, self)
        self.data_rank = self.mesh.coordinate("dp")
        self._buffer: list[torch.Tensor] = []

    def micro_step(self, input_ids: torch.Tensor) -> float | None:
        """Buffer micro-batches; on the gas-th, run the schedule (forward and backward of all of
        them) and return their mean loss, the same on every rank of the pipeline."""
        self._buffer.append(input_ids)
        if len(self._buffer) < self.layout.gas:
            return None
        batch = torch.cat(self._buffer)
        self._buffer.clear()
        tokens, labels = _split_padding(batch)
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.stage_index == 0 else ()
        target = labels if self.is_last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        mean = torch.stack(losses).mean().detach().float() if self.is_last else torch.zeros((), device=_device())
        dist.broadcast(mean, src=self.last_stage_rank, group=self.pp_group)
        return float(mean)

    def optimizer_step(self, lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        norm = clip_grad_norm(self.params, self.clip, self.pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save(self, directory: Path) -> None:
        save_distributed(self.stage, self.optimizer, directory)

    def load(self, directory: Path) -> None:
        load_distributed(self.stage, self.optimizer, directory)
