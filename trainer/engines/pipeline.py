"""Pipeline parallelism through ``torch.distributed.pipelining``, with FSDP2 over the
data-parallel sub-mesh for DP x PP and tensor parallelism inside each stage for tp > 1. With
vpp > 1 each rank holds vpp model chunks (virtual stages rank + k*pp, `specs.core.chunk_layers`)
run by the interleaved 1F1B schedule.

``micro_step`` defers the work: the schedule runs all of a step's micro-batches at once, on the
gas-th call, and returns their mean loss there (None before). Checkpoints are DCP folders whose
parameter names do not depend on the split.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Callable

import torch
import torch.distributed as dist

from specs.capabilities import autocast_kept_dtype
from specs.core import Layout, chunk_layers
from profiler.hardware_bench import TORCH_DTYPES
from trainer.batch import MicroBatch, as_micro_batch, concat
from trainer.engines.base import DTensorState, compute_context, device
from trainer.engines.optimizer import adamw, clip_sharded_grad_norm, optimizer_step
from trainer.materialize import materialize, pending_init
from trainer.parallelize import (ParallelMesh, check_parallel_layout, decoder_layers, parallelize,
                                 reduce_partial_gradients)


class PipelineChunk(torch.nn.Module):
    """One model chunk (a virtual pipeline stage) cut out of an HF causal LM: a run of decoder
    layers, with the embedding on the first chunk and the final norm and LM head on the last. It
    keeps the model's parameter names (``model.layers.5.…``), so checkpoints read the same
    whatever the split.

    Attention runs without a mask, which HF's sdpa path turns into a causal kernel
    (docs/notes-cpu-stack.md, trap 5: eager would not be causal), unless the rows are packed: the
    schedule hands every stage the micro-batch's position ids (a keyword argument of `step` reaches
    all stages), from which HF's own mask builder makes the per-document causal mask the whole
    model would (`trainer/batch.py`).
    """

    def __init__(self, model: torch.nn.Module, layer_ids: range, first: bool, last: bool):
        super().__init__()
        base = model.model
        if base.config._attn_implementation != "sdpa":
            base.config._attn_implementation = "sdpa"
        self.model = torch.nn.Module()
        self.model.embed_tokens = base.embed_tokens if first else None
        self.model.layers = torch.nn.ModuleDict({str(i): base.layers[i] for i in layer_ids})
        self.model.norm = base.norm if last else None
        self.model.rotary_emb = base.rotary_emb  # buffers only, shared by the device's chunks
        self.lm_head = model.lm_head if last else None
        self._config = [base.config]  # not a submodule

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask  # loaded for PP only

        base = self.model
        hidden = base.embed_tokens(x) if base.embed_tokens is not None else x
        mask = None  # one document per row: sdpa's causal kernel
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        else:
            # transformers renamed `past_key_values` to `cache` after 5.6, our floor
            no_cache = {"cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values": None}
            mask = create_causal_mask(config=self._config[0], inputs_embeds=hidden, attention_mask=None,
                                      position_ids=position_ids, **no_cache)
        rotary = base.rotary_emb(hidden, position_ids)
        for layer in base.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=rotary)
        if self.lm_head is None:
            return hidden
        return self.lm_head(base.norm(hidden))


def cut_chunks(model: torch.nn.Module, layout: Layout, device_index: int) -> list[PipelineChunk]:
    """This device's chunks, virtual stages device_index + k*pp for k < vpp (the layers of
    `specs.core.chunk_layers`). The HF model is pruned to what the device holds, so that it
    keeps no other layer and serves as the one module that names the device's parameters (DCP
    checkpoints, state counts)."""
    split = chunk_layers(len(decoder_layers(model)), layout)
    chunks = [PipelineChunk(model, split[i], i == 0, i == len(split) - 1)
              for i in range(device_index, len(split), layout.pp)]
    base = model.model
    base.layers = torch.nn.ModuleDict({key: layer for chunk in chunks for key, layer in chunk.model.layers.items()})
    if chunks[0].model.embed_tokens is None:
        base.embed_tokens = None
    if chunks[-1].lm_head is None:
        base.norm = None
        model.lm_head = None
    return chunks


class PipelineForward(torch.nn.Module):
    """The whole pipeline as a module for evaluation: ``forward(input_ids, labels).loss``.

    Forward only, one micro-batch of any size: hidden states go chunk to chunk in virtual-stage
    order (rank r runs stages r, r + pp, ...); the loss computed on the last chunk is broadcast so
    every rank returns the same value. Sharded parameters are released afterwards.
    """

    def __init__(self, chunks: list[PipelineChunk], engine: "PipelineEngine"):
        super().__init__()
        self.chunks = torch.nn.ModuleList(chunks)
        self._engine = [engine]  # not a submodule

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool | None = None) -> SimpleNamespace:
        engine = self._engine[0]
        with compute_context(engine.layout, "pipeline"):
            return self._forward(input_ids, labels, position_ids)

    def _forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None,
                 position_ids: torch.Tensor | None) -> SimpleNamespace:
        engine = self._engine[0]
        group, index, pp = engine.pp_group, engine.stage_index, engine.layout.pp
        out = input_ids
        for k, chunk in enumerate(self.chunks):
            stage_id = index + k * pp
            if stage_id > 0:
                out = torch.empty((*input_ids.shape, engine.hidden_size), dtype=engine.activation_dtype,
                                  device=input_ids.device)
                dist.recv(out, src=dist.get_global_rank(group, (index - 1) % pp), group=group)
            out = chunk(out, position_ids)
            if stage_id < engine.stages - 1:
                dist.send(out.contiguous(), dst=dist.get_global_rank(group, (index + 1) % pp), group=group)
        loss = torch.zeros((), dtype=torch.float32, device=input_ids.device)
        if engine.is_last and labels is not None:
            loss = engine.loss_fn(out, labels).float()
        dist.broadcast(loss, src=engine.last_stage_rank, group=group)
        engine.reshard()
        return SimpleNamespace(loss=loss)


def _sharded_stage_class(zero: int) -> type:
    """`PipelineStage` with ZeRO-2/3 as the cost model prices them (planner/cost_model.py
    `gradient_comm`, planner/memory.py `model_state_bytes`): gradients reduce-scattered after
    every micro-batch's backward (each rank keeps 1/dp of them), and under ZeRO-3 the weights
    resharded after it too, so that they are gathered for every micro-batch's forward and
    backward. torch's stage instead keeps whole gradients and gathered weights until the step's
    last backward, which is ZeRO-1 (the optimizer sharded), and what zero <= 1 runs."""
    from torch.distributed.fsdp import FSDPModule  # loaded for PP only
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._backward import stage_backward

    if zero < 2:
        return PipelineStage

    class ShardedGradientStage(PipelineStage):
        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):  # type: ignore[no-untyped-def]
            if not isinstance(self.submod, FSDPModule) or backward_type != "full":
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            # the stage's own flags, but reducing (and for ZeRO-3 resharding) every micro-batch;
            # the step's final `perform_reduce_grad` then finds nothing left to reduce
            self.submod.set_is_last_backward(False)
            self.submod.set_reshard_after_backward(zero == 3)
            self.submod.set_requires_gradient_sync(True)
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
            return grads, None

    return ShardedGradientStage


class PipelineEngine(DTensorState):
    """This rank's chunks of the pipeline, its schedule over ``gas`` micro-batches of ``mbs``
    sequences, FSDP2 over the data-parallel sub-mesh and TP inside each chunk.

    Schedules (what `specs.layout_rules.pipeline_problem` admits and planner/memory.py
    `micro_batches_in_flight` prices): 1F1B, GPipe when gas < pp (which 1F1B cannot fill), and
    with vpp > 1 chunks per rank torch's `ScheduleInterleaved1F1B` (Megatron's interleaved 1F1B,
    the schedule the bubble (pp - 1)/vpp and the warm-up memory are priced for; the zero-bubble
    and looped-BFS variants would need other prices).

    ZeRO across pipeline replicas as priced: zero 1/2 keep the weights gathered through the step
    (resharding after forward would make every micro-batch pay another all-gather, torchtitan);
    zero 3 reshards them after every micro-batch's forward and backward (`_sharded_stage_class`).
    zero 0 runs without replicas only (specs/capabilities.py): FSDP2 would shard the optimizer.
    """

    def __init__(self, model: torch.nn.Module, layout: Layout, clip: float, weight_decay: float = 0.0):
        from torch.distributed.pipelining import (  # loaded for PP only
            Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B)

        check_parallel_layout(model, layout)
        self.layout, self.clip = layout, clip
        self.mesh = ParallelMesh.build(layout)
        self.pp_group = self.mesh.group("pp")
        self.stage_index = self.mesh.coordinate("pp")
        self.stages = layout.pp * layout.vpp
        self.last_stage_rank = dist.get_global_rank(self.pp_group, layout.pp - 1)
        self.is_last = self.stage_index == layout.pp - 1
        self.hidden_size = int(model.config.hidden_size)
        vocab = int(model.config.vocab_size)
        hf_loss = model.loss_function
        self._num_items: float | None = None  # the running step's (MicroBatch.num_items); None: a mean
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = \
            lambda logits, labels: hf_loss(logits=logits, labels=labels, vocab_size=vocab,
                                           num_items_in_batch=self._num_items)

        self.chunks = cut_chunks(model, layout, self.stage_index)
        for chunk in self.chunks:
            parallelize(chunk, self.mesh, layout, layers=lambda c=chunk: c.model.layers,
                        fsdp_units=lambda c=chunk: list(c.model.layers.children()),
                        reshard_after_forward=layout.zero == 3)
        for chunk in self.chunks:  # only this rank's chunks, and their local shards
            materialize(chunk, pending_init(model), device())
        # the hidden states between stages: fp32 under autocast (the residual stream stays fp32)
        self.activation_dtype = TORCH_DTYPES[autocast_kept_dtype(layout, "pipeline")]
        self.module = model  # pruned to this rank's chunks: the parameters under their HF names
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, weight_decay)
        stage_class = _sharded_stage_class(layout.zero if layout.dp > 1 else 0)
        stages = [stage_class(chunk, self.stage_index + k * layout.pp, self.stages, device(), group=self.pp_group)
                  for k, chunk in enumerate(self.chunks)]
        # loss_fn returns each micro-batch's share of the step's loss (MicroBatch.num_items); the
        # schedule divides gradients by gas
        if layout.vpp > 1:
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=layout.gas, loss_fn=self.loss_fn)
        else:
            schedule = Schedule1F1B if layout.gas >= layout.pp else ScheduleGPipe
            self.schedule = schedule(stages[0], n_microbatches=layout.gas, loss_fn=self.loss_fn)
        self.model = PipelineForward(self.chunks, self)
        self.data_rank = self.mesh.coordinate("dp")
        self._buffer: list[MicroBatch] = []

    def reshard(self) -> None:
        """Free gathered weights (FSDP2) after a forward outside the schedule (evaluation)."""
        from torch.distributed.fsdp import FSDPModule  # loaded for PP only

        for chunk in self.chunks:
            if isinstance(chunk, FSDPModule):
                chunk.reshard()

    def micro_step(self, batch: MicroBatch | torch.Tensor) -> float | None:
        """Buffer micro-batches; on the gas-th, run the schedule (forward and backward of all of
        them) and return their mean loss, the same on every rank of the pipeline."""
        self._buffer.append(as_micro_batch(batch))
        if len(self._buffer) < self.layout.gas:
            return None
        whole = concat(self._buffer)
        self._buffer.clear()
        losses: list[torch.Tensor] = []
        args = (whole.input_ids,) if self.stage_index == 0 else ()
        target = whole.labels if self.is_last else None
        kwargs = {"position_ids": whole.position_ids} if whole.position_ids is not None else {}
        self._num_items = whole.num_items
        try:
            # bf16 without FSDP2: the whole step under one autocast, so that its micro-batches share one
            # 16-bit copy of each weight (autocast's cache) instead of one per micro-batch in flight
            with compute_context(self.layout, "pipeline"):
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        finally:
            self._num_items = None  # evaluation (PipelineForward) takes each micro-batch's mean
        mean = torch.stack(losses).mean().detach().float() if self.is_last else torch.zeros((), device=device())
        dist.broadcast(mean, src=self.last_stage_rank, group=self.pp_group)
        return float(mean)

    def optimizer_step(self, lr: float) -> float:
        if self.layout.sp:
            reduce_partial_gradients(self.params)
        return optimizer_step(self.optimizer, lr,
                              lambda: clip_sharded_grad_norm(self.params, self.clip, self.pp_group))
