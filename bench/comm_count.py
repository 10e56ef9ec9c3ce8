"""Count the collectives this process issues: calls and bytes, by kind.

Used by the tests (no gradient collective before a boundary) and the benchmarks (bytes
sent per optimizer step). The engine's agreements on the gloo control group are not counted. It patches the ``torch.distributed`` functions that FSDP,
DeepSpeed and the engine call, and, for DDP, whose reducer bypasses Python, wraps the
gradient all-reduce in a comm hook (``watch_ddp``).

DeepSpeed binds some ``torch.distributed`` functions at start-up: ``watch_deepspeed`` wraps
its comm backend instead.

``sent_bytes`` estimates what one rank puts on the wire with ring algorithms: an
all-reduce of n bytes sends 2·n·(W-1)/W, an all-gather or reduce-scatter whose full
buffer is n bytes sends n·(W-1)/W, a broadcast sends n·(W-1)/W on average per rank.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter

import torch
import torch.distributed as dist

from engine.distributed.process_group import control_group

# function name -> (kind, index of the argument whose size is the full buffer)
_WATCHED = {
    "all_reduce": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "all_gather": ("small all_gather", 0),  # the list form: small reductions (collectives.small_sum)
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter": ("reduce_scatter", 1),
    "all_to_all_single": ("all_to_all", 1),
}
_RING_FACTOR = {"all_reduce": 2.0}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _on_control_group(kwargs) -> bool:
    """The engine's agreements (the ranks' positions, flush, stop signals, checkpoints) run on the
    gloo control group: small CPU messages, not training traffic, measured by
    bench/agreement_cost.py and bench/checkpoint_cost.py instead."""
    group = kwargs.get("group")
    return group is not None and group is control_group()


class CommCounter:
    """``with CommCounter() as comm: ...`` then ``comm.calls``, ``comm.bytes``, ``comm.sent_bytes``."""

    def __init__(self):
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()  # full-buffer bytes per kind
        self._originals: dict = {}
        self._inside = threading.local()  # one collective calling another counts once

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    @property
    def sent_bytes(self) -> float:
        world = dist.get_world_size() if dist.is_initialized() else 1
        share = (world - 1) / world
        return sum(_RING_FACTOR.get(kind, 1.0) * share * n for kind, n in self.bytes.items())

    def record(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    def _wrap(self, original, kind: str, index: int, keyword: str | None = None):
        """``original`` counting its call, once: collectives it calls in turn are not counted."""
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if getattr(self._inside, "active", False) or _on_control_group(kwargs):
                return original(*args, **kwargs)
            self._inside.active = True
            try:
                if len(args) > index:
                    buffer = args[index]
                else:
                    buffer = kwargs.get(keyword) if keyword else next(iter(kwargs.values()), None)
                self.record(kind, _nbytes(buffer))
                return original(*args, **kwargs)
            finally:
                self._inside.active = False
        return counted

    def __enter__(self) -> CommCounter:
        for name, (kind, index) in _WATCHED.items():
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._wrap(original, kind, index))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def watch_ddp(self, ddp_module) -> None:
        """Count DDP's gradient all-reduces (call before its first backward)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting_hook(state, bucket):
            self.record("all_reduce", _nbytes(bucket.buffer()))
            self._inside.active = True  # the hook's own dist.all_reduce is this same collective
            try:
                return allreduce_hook(state, bucket)
            finally:
                self._inside.active = False

        ddp_module.register_comm_hook(None, counting_hook)

    def watch_deepspeed(self):
        """Count DeepSpeed's collectives too (with the counter entered).

        DeepSpeed binds some torch.distributed functions at start-up, so patching them misses
        calls; every DeepSpeed collective goes through its comm backend object instead, whose
        methods are wrapped here (in the counter's convention: full-buffer bytes). Returns a
        function that removes the wrappers."""
        from deepspeed.comm import comm as ds_comm

        backend = ds_comm.cdb
        # method -> (kind, index of the full-buffer argument, its keyword)
        watched = {
            "all_reduce": ("all_reduce", 0, "tensor"), "inference_all_reduce": ("all_reduce", 0, "tensor"),
            "all_reduce_coalesced": ("all_reduce", 0, "tensors"), "reduce": ("reduce", 0, "tensor"),
            "broadcast": ("broadcast", 0, "tensor"),
            "all_gather": ("all_gather", 0, "tensor_list"), "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
            "all_gather_base": ("all_gather", 0, "output_tensor"),
            "all_gather_coalesced": ("all_gather", 0, "output_tensors"),
            "reduce_scatter": ("reduce_scatter", 1, "input_list"),
            "reduce_scatter_tensor": ("reduce_scatter", 1, "input_tensor"),
            "all_to_all_single": ("all_to_all", 1, "input"), "all_to_all": ("all_to_all", 1, "input_tensor_list"),
        }
        originals = {}
        for name, (kind, index, keyword) in watched.items():
            original = getattr(backend, name, None)
            if original is not None:
                originals[name] = original
                setattr(backend, name, self._wrap(original, kind, index, keyword))

        def unwatch():
            for name in originals:
                delattr(backend, name)  # the instance attribute: the class method shows again

        return unwatch
