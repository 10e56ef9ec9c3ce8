"""ZeRO stage 0: DistributedDataParallel, one gradient all-reduce per window.

DDP decides in the *forward* whether the coming backward all-reduces, so the engine calls
``prepare_micro_step`` before every forward; only the micro-step that closes the window
syncs. A window that ends without such a micro-step (``flush()``) or whose sync was
deliberately deferred is all-reduced afterwards, in buckets, by ``reduce_gradients``.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from engine.adapters.torch_internals import set_ddp_gradient_sync
from engine.distributed.collectives import all_reduce_mean_
from engine.strategies.base import TorchStrategy


class DataParallel(TorchStrategy):
    name = "ddp"

    def setup(self, module, optimizer):
        self.module = module.to(self.device)
        self.transform(self.module)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers here: every rank starts equal.
        # Gradients as views of DDP's buckets: one copy of the gradient instead of two.
        # zero_optimization.reduce_bucket_size: DDP's bucket (all-reduced as soon as the backward fills it)
        bucket = self.settings.overlap.reduce_bucket_bytes
        buckets = {} if bucket is None else {"bucket_cap_mb": bucket / 2**20}
        self.forward_module = DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True,
                                                      **buckets)
        self.optimizer = optimizer
        self._backward_syncs = False
        self._defer_reduction = False

    def prepare_micro_step(self, closes_window):
        syncs = closes_window and not self._defer_reduction
        set_ddp_gradient_sync(self.forward_module, syncs)
        self._backward_syncs = syncs

    def enable_failure_guard(self):
        # No collective inside a window at all: the all-reduce runs after the window's vote,
        # so a rank failing in its backward can never leave a peer inside DDP's reducer.
        # (ZeRO-0 holds full-size gradients anyway: deferring costs no memory.)
        self._defer_reduction = True

    def reduce_gradients(self):
        if self._backward_syncs:
            return
        grads = []
        for p in self.module.parameters():
            if p.requires_grad:
                if p.grad is None:  # unused on this rank: its share is zero
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        all_reduce_mean_(grads, self.world_size, self.settings.overlap.reduce_bucket_bytes)
