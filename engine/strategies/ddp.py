"""ZeRO stages 0 and 1 on a mesh of data ranks: DistributedDataParallel, one gradient
all-reduce per window (at ZeRO 1 with the optimizer state owned, ``engine.strategies.zero1``).

DDP decides in the *forward* whether the coming backward all-reduces, so the engine calls
``prepare_micro_step`` before every forward; only the micro-step that closes the window
syncs. A window that ends without such a micro-step (``flush()``) or whose sync was
deliberately deferred is all-reduced afterwards, in buckets, by ``reduce_gradients``.

Unused parameters. DDP's all-reduce inside the backward waits for every parameter's
gradient, so a parameter the forward never reaches (a Hugging Face encoder's pooler) would
leave it waiting. The first window is therefore reduced after its backward, where the engine
sees which parameters got a gradient on which rank; when some did not on every rank, DDP is
rebuilt to find unused parameters in each backward (an extra traversal of the autograd graph,
which models without unused parameters never pay). A parameter unused on every rank keeps no
gradient, so the optimizer leaves it alone, as in one process.

Parameters held apart (``engine.distributed.group_held``) differ between ranks: DDP ignores them
(neither broadcast nor reduced); their gradients are reduced over their own replicas at the boundary.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from torch.nn.parallel import DistributedDataParallel

from engine.adapters.torch_internals import ddp_ignore, set_ddp_gradient_sync
from engine.strategies.base import TorchStrategy, repoint_optimizer
from engine.strategies.zero1 import optimizer_state

log = logging.getLogger("engine")


class DataParallel(TorchStrategy):
    def capabilities(self):
        early = self._has_buffers or self._split_model_exchanges()

        def communicates_before_closing_backward() -> bool:
            # DDP's forwards communicate only to broadcast buffers (a window's first forward, after a
            # synced backward) and, once per wrap, to agree on rebuilt buckets (the first forward after
            # a synced backward): asked per window, the buckets being rebuilt after the first synced
            # backward (and again after a re-wrap). Otherwise the closing backward's all-reduce is the first.
            return early or not self._buckets_rebuilt

        # DDP pairs each forward with its backward, and can reduce after the window's last backward
        # instead (hold_forwards): ZeRO 0 / 1 hold whole gradients, deferring costs no memory.
        return replace(super().capabilities(), can_hold_forwards=True,
                       communicates_before_closing_backward=communicates_before_closing_backward)

    def setup(self, module, optimizer):
        self.module = module.to(self.device)
        names = {id(p): name for name, p in self.module.named_parameters()}
        self.parallelize(self.module)
        if self.group_held.holds_any:  # reduced over their own replicas, not by DDP
            ddp_ignore(self.module, self.group_held.names())
            repoint_optimizer(optimizer, names, self.module)
        self._has_buffers = any(True for _ in self.module.buffers())
        # DDP broadcasts rank 0's parameters and buffers here: every rank starts equal.
        self.forward_module = self._wrap(find_unused_parameters=False)
        self.optimizer = optimizer
        self.owned = optimizer_state(self, self.module, optimizer)
        self._backward_syncs = False
        self._defer_reduction = False
        self._probing_usage = True  # the first window: which parameters get gradients

    def _wrap(self, find_unused_parameters: bool) -> DistributedDataParallel:
        self._buckets_rebuilt = False
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Gradients as views of DDP's buckets: one copy of the gradient instead of two.
        # zero_optimization.reduce_bucket_size: DDP's bucket (all-reduced as soon as the backward fills it)
        bucket = self.settings.overlap.reduce_bucket_bytes
        buckets = {} if bucket is None else {"bucket_cap_mb": bucket / 2**20}
        return DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True,
                                       find_unused_parameters=find_unused_parameters, **buckets)

    def prepare_micro_step(self, closes_window):
        if self._backward_syncs:  # this forward follows a synced backward: DDP rebuilds its buckets in it
            self._buckets_rebuilt = True
        syncs = closes_window and not self._defer_reduction and not self._probing_usage
        set_ddp_gradient_sync(self.forward_module, syncs)
        self._backward_syncs = syncs

    def optimizer_step(self):
        self.owned.step()

    def hold_forwards(self):
        self._defer_reduction = True  # the window is reduced after its last backward

    def enable_failure_guard(self):
        super().enable_failure_guard()
        # No collective inside a window at all: the all-reduce runs after the window's vote,
        # so a rank failing in its backward can never leave a peer inside DDP's reducer.
        # (ZeRO-0 holds full-size gradients anyway: deferring costs no memory.)
        self._defer_reduction = True

    def reduce_gradients(self):
        if self._backward_syncs:  # DDP reduced the rest in the closing backward
            self.reduce_group_held_gradients()
            return
        users = self.average_gradients()
        if self._probing_usage:
            self._probing_usage = False
            unused = sum(count < self.world_size for count in users)
            if unused:
                log.info("%d parameter(s) got no gradient on some rank in the first window: DDP finds unused "
                         "parameters in every backward from now on", unused)
                self.forward_module = self._wrap(find_unused_parameters=True)
