"""ZeRO stage 0: DistributedDataParallel, one gradient all-reduce per window.

DDP decides in the *forward* whether the coming backward all-reduces, so the engine calls
``prepare_micro_step`` before every forward; only the micro-step that closes the window
syncs. A window that ends without such a micro-step (``step(flush=True)``) or whose sync
was deliberately deferred is all-reduced afterwards, in buckets, by ``reduce_gradients``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from engine.strategies.base import TorchStrategy

BUCKET_BYTES = 25 * 1024 * 1024


def buckets(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES):
    """Consecutive runs of same-dtype, same-device tensors of at most ``limit`` bytes."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > limit or t.dtype != bucket[0].dtype or t.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def all_reduce_mean_(tensors: list[torch.Tensor], world_size: int) -> None:
    """Replace each tensor by its mean over ranks, one flat all-reduce per bucket."""
    for bucket in buckets(tensors):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat)
        flat.div_(world_size)
        for tensor, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            tensor.copy_(reduced)


@torch.no_grad()
def broadcast_(tensors: list[torch.Tensor], src: int) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values, one flat broadcast per bucket."""
    for bucket in buckets(tensors):
        flat = _flatten_dense_tensors(bucket)
        dist.broadcast(flat, src=src)
        if dist.get_rank() != src:
            for tensor, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(value)


class DataParallel(TorchStrategy):
    name = "ddp"

    def setup(self, module, optimizer):
        self.module = module.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers here: every rank starts equal.
        # Gradients as views of DDP's buckets: one copy of the gradient instead of two.
        self.forward_module = DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True)
        self.optimizer = optimizer
        self._backward_syncs = False
        self._defer_reduction = False

    def prepare_micro_step(self, closes_window):
        syncs = closes_window and not self._defer_reduction
        self.forward_module.require_backward_grad_sync = syncs
        self._backward_syncs = syncs

    def enable_failure_guard(self):
        # No collective inside a window at all: the all-reduce runs after the window's vote,
        # so a rank failing in its backward can never leave a peer inside DDP's reducer.
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
        all_reduce_mean_(grads, self.world_size)
