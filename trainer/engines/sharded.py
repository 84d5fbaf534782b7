"""The DTensor sharded engine: tensor parallel, FSDP2, or both on a 2-D (dp, tp) mesh."""

from __future__ import annotations

import torch

from specs.core import Layout
from trainer.batch import MicroBatch
from trainer.engines.base import DTensorState, autocast_forward, device, forward_backward, use_declared_loss
from trainer.engines.optimizer import adamw, clip_sharded_grad_norm, optimizer_step
from trainer.materialize import materialize, pending_init
from trainer.parallelize import (ParallelMesh, check_parallel_layout, decoder_layers, parallelize,
                                 reduce_partial_gradients, shard_units)


class ShardedEngine(DTensorState):
    """Tensor parallel (Megatron split through DTensor) and/or FSDP2 over the data-parallel
    sub-mesh: DP x TP on a 2-D mesh, or FSDP2 alone as the alternative to DeepSpeed ZeRO.

    ZeRO-3 reshards parameters after forward (gathered again for backward); ZeRO-1/2 keep them
    gathered from forward to backward. Accumulating micro-batches skip the gradient
    reduce-scatter below ZeRO-2 (like DDP's no_sync) and reduce every micro-batch from ZeRO-2 on,
    where unsharded accumulated gradients would defeat the point. Checkpoints are DCP folders.
    """

    def __init__(self, model: torch.nn.Module, layout: Layout, clip: float, weight_decay: float = 0.0):
        check_parallel_layout(model, layout)
        self.layout, self.clip = layout, clip
        self.mesh = ParallelMesh.build(layout)
        use_declared_loss(model, layout, "fsdp2")
        parallelize(model, self.mesh, layout, layers=lambda: decoder_layers(model),
                    fsdp_units=lambda: shard_units(model), reshard_after_forward=layout.zero == 3)
        materialize(model, pending_init(model), device())  # only the local shards
        autocast_forward(model, layout, "fsdp2")  # bf16 without FSDP2 (tp only): fp32 weights under autocast
        self.sharded = layout.dp > 1
        self.model = self.module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, weight_decay)
        self.data_rank = self.mesh.coordinate("dp")
        self._micro = 0

    def micro_step(self, batch: MicroBatch | torch.Tensor) -> float:
        self._micro += 1
        if self.sharded:
            boundary = self._micro % self.layout.gas == 0
            self.model.set_requires_gradient_sync(boundary or self.layout.zero >= 2)
        return forward_backward(self.model, batch, self.layout.gas)

    def optimizer_step(self, lr: float) -> float:
        if self.layout.sp:
            reduce_partial_gradients(self.params)
        return optimizer_step(self.optimizer, lr, lambda: clip_sharded_grad_norm(self.params, self.clip))
