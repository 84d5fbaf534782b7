"""Pipeline parallelism through ``torch.distributed.pipelining``, with FSDP2 over the
data-parallel sub-mesh for DP x PP and tensor parallelism inside each stage for tp > 1.

``micro_step`` defers the work: the schedule runs all of a step's micro-batches at once, on the
gas-th call, and returns their mean loss there (None before). Checkpoints are DCP folders whose
parameter names do not depend on the split.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist

from advisor.specs import Layout, layers_per_stage
from profiler.hardware_bench import TORCH_DTYPES
from trainer.engines.base import DTensorState, device
from trainer.engines.optimizer import adamw, clip_sharded_grad_norm, optimizer_step
from trainer.materialize import materialize, pending_init
from trainer.parallelize import ParallelMesh, check_parallel_layout, decoder_layers, parallelize


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


class PipelineEngine(DTensorState):
    """This rank's stage, the 1F1B schedule over ``gas`` micro-batches of ``mbs`` sequences (GPipe
    when gas < pp, which 1F1B cannot fill), FSDP2 over the data-parallel sub-mesh and TP inside
    the stage.

    With data parallelism the stage keeps its parameters gathered between forward and backward:
    resharding after forward would make every micro-batch pay another all-gather (torchtitan).
    """

    def __init__(self, model: torch.nn.Module, layout: Layout, clip: float, weight_decay: float = 0.0):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # loaded for PP only

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

        split = layers_per_stage(len(decoder_layers(model)), layout)
        stage = PipelineStageModule(model, self.stage_index, split)
        parallelize(stage, self.mesh, layout, layers=lambda: stage.model.layers,
                    fsdp_units=lambda: list(stage.model.layers.children()), reshard_after_forward=False)
        materialize(stage, pending_init(model), device())  # only this stage's modules, and their local shards
        self.activation_dtype = TORCH_DTYPES[layout.dtype]
        self.params = [p for p in stage.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, weight_decay)
        pipeline_stage = PipelineStage(stage, self.stage_index, layout.pp, device(), group=self.pp_group)
        schedule = Schedule1F1B if layout.gas >= layout.pp else ScheduleGPipe
        # loss_fn returns each micro-batch's mean; the schedule divides gradients by gas
        self.schedule = schedule(pipeline_stage, n_microbatches=layout.gas, loss_fn=self.loss_fn)
        self.module = stage
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
        mean = torch.stack(losses).mean().detach().float() if self.is_last else torch.zeros((), device=device())
        dist.broadcast(mean, src=self.last_stage_rank, group=self.pp_group)
        return float(mean)

    def optimizer_step(self, lr: float) -> float:
        return optimizer_step(self.optimizer, lr,
                              lambda: clip_sharded_grad_norm(self.params, self.clip, self.pp_group))
