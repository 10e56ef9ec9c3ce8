"""One process, ZeRO-0 and ZeRO-1 with low-precision parameters (``bf16`` / ``fp16`` without
``torch_autocast``): the model computes in a half-precision copy (``engine.strategies.compute_copy``),
the optimizer updates the fp32 masters.

DDP is not used: its buckets would hold (and all-reduce) the half-precision gradients. Every
window's fp32 master gradients are all-reduced at its end instead, in buckets: one all-reduce
per window whatever its micro-steps, none inside a backward (so none a failing rank could leave
a peer waiting in). The price against DDP under autocast is that the all-reduce does not
overlap the last backward; docs/config.md says when autocast is the better choice.
"""

from __future__ import annotations

import contextlib

from engine.distributed.collectives import average_used_gradients_, broadcast_
from engine.strategies.base import TorchStrategy
from engine.strategies.compute_copy import ComputeCopy
from engine.strategies.zero1 import OwnedOptimizerState


class LowPrecisionReplicas(TorchStrategy):
    """The whole model on every rank (one process, or ZeRO-0)."""

    # No collective inside a window (the masters' gradients are all-reduced after its closing
    # backward): the check before that backward is its only one. After the reduction every rank
    # holds the whole master gradient, so the norm's squares ride in the window statistics.
    communicates_before_closing_backward = False
    norm_in_statistics = True

    def __init__(self, setup, dist_info):
        super().__init__(setup, dist_info)
        self.name = "single" if self.world_size == 1 else "ddp"

    def setup(self, module, optimizer):
        self.module = module.to(self.device)
        if self.world_size > 1:  # as DDP does: every rank starts from rank 0's model
            broadcast_([*self.module.parameters(), *self.module.buffers()], src=0)
        half = self.settings.precision
        self.compute_copy = ComputeCopy(self.module, half.dtype, half.grad_accum_dtype)
        self.transform(self.compute_copy.model)
        self.forward_module = self.compute_copy.module
        self.optimizer = optimizer

    def reduce_gradients(self):
        self.compute_copy.move_gradients_to_masters()
        if self.world_size == 1:
            return
        average_used_gradients_(self.module.parameters(), self.world_size, self.device,
                                bucket_bytes=self.settings.overlap.reduce_bucket_bytes)

    def optimizer_step(self):
        super().optimizer_step()
        self.compute_copy.refresh()

    @contextlib.contextmanager
    def gathered(self, modifier_rank):
        with super().gathered(modifier_rank):
            yield
        self.compute_copy.refresh()  # the masters may have changed: so does the half-precision copy

    def zero_grad(self):
        super().zero_grad()
        self.compute_copy.zero_grad()

    def held_tensors(self):
        return super().held_tensors() + self.compute_copy.held_tensors()

    def load_training_state(self, directory):
        super().load_training_state(directory)
        self.compute_copy.refresh()


class LowPrecisionShardedOptimizer(OwnedOptimizerState, LowPrecisionReplicas):
    """ZeRO-1: each rank's optimizer holds the masters it owns (``engine.strategies.zero1``'s
    partition); after the step every owner broadcasts its updated masters."""

    def __init__(self, setup, dist_info):
        super().__init__(setup, dist_info)
        self.name = "zero1"

    def optimizer_step(self):
        self.step_owned()
        self.compute_copy.refresh()
