"""ZeRO stages 2 and 3 on FSDP2 (``fully_shard``): parameters, gradients and optimizer
state sharded across ranks.

Stage 2 keeps parameters gathered from forward to backward; stage 3 reshards them after
each forward (less memory, an all-gather again in the backward). Inside a window the
gradient reduce-scatter and the resharding after backward are both deferred, so unsharded
gradients accumulate locally and a window costs one reduce-scatter per shard group
(stage 2: also one all-gather; stage 3: one in the first forward and one per backward,
since parameters stay gathered from a backward to the next forward). ``reduce_every_micro_step`` reduce-scatters after every micro-step instead,
accumulating sharded gradients; at stage 3 it also frees the gathered parameters after
every backward: ZeRO-3's memory profile, for more traffic.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from engine.strategies.base import PeerFailure, TorchStrategy, failure_vote
from engine.strategies.ddp import broadcast_


def shard_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The submodules sharded as units of their own (bottom-up order): the entries of every
    ``ModuleList`` / ``Sequential`` that hold parameters, e.g. transformer blocks. Whatever
    they leave out belongs to the root's unit."""
    units = []
    for container in module.modules():
        if isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            units += [child for child in container if any(True for _ in child.parameters())]
    return [m for m in reversed(units) if m is not module]


def _repoint_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], module: torch.nn.Module) -> None:
    """Swap, in place, the optimizer's parameters for the sharded ones of the same name."""
    if optimizer.state:
        raise ValueError(
            "the optimizer already holds state, which cannot follow its parameters into shards; "
            "pass a fresh optimizer (restore training state with eng.load_checkpoint)"
        )
    sharded = dict(module.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]


def _check_peers(group, *, rank: int, world_size: int, device) -> None:
    failures = failure_vote(0, rank, world_size, device, group)
    if failures:
        raise PeerFailure(failures)


class _GuardedAllGather:
    """FSDP2's all-gather (custom-comm interface), preceded by a check of the peers' flags.
    Buffers are allocated before ``__call__``, so a rank that runs out of memory allocating
    them fails before the check, which its vote then answers."""

    def __init__(self, guard):
        self.guard = guard

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.guard(group)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _GuardedReduceScatter(_GuardedAllGather):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.guard(group)
        return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class FullyShardedDataParallel(TorchStrategy):
    name = "fsdp"

    def __init__(self, precision, device, *, stage: int, reduce_every_micro_step: bool = False):
        super().__init__(precision, device)
        self.stage = stage
        self.reduce_every_micro_step = reduce_every_micro_step
        self._backward_closes_window = True

    def setup(self, module, optimizer):
        module = module.to(self.device)
        broadcast_([*module.parameters(), *module.buffers()], src=0)  # as DDP does: every rank starts from rank 0's model
        names = {id(p): name for name, p in module.named_parameters()}
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        reshard_after_forward = self.stage == 3
        for unit in shard_units(module):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
        _repoint_optimizer(optimizer, names, module)
        self.module = self.forward_module = module
        self.optimizer = optimizer
        self.group = mesh.get_group()
        self._defer_reduction = False
        self._flags = None  # (requires_gradient_sync, reshard_after_backward) last set

    def prepare_micro_step(self, closes_window):
        closes = closes_window and not self._defer_reduction
        # Keep parameters gathered between the window's micro-steps (no all-gather in the next
        # forward); reshard at its end so the optimizer updates the shards while no stale
        # unsharded copy is registered. ZeRO-3 asked to save memory (reduce_every_micro_step)
        # frees them after every backward instead.
        lean = self.reduce_every_micro_step and self.stage == 3
        flags = (closes or self.reduce_every_micro_step, closes or lean)
        if flags != self._flags:  # each setter walks every module: only when they change
            self.module.set_requires_gradient_sync(flags[0])
            self.module.set_reshard_after_backward(flags[1])
            self._flags = flags
        self._backward_closes_window = closes

    def release_gathered_parameters(self):
        for unit in self._units():
            unit.reshard()

    def enable_failure_guard(self):
        # All-gathers happen inside forward and backward: each first checks the peers' flags.
        # The window's reduce-scatter waits for the end-of-window vote (reduce_gradients).
        self._defer_reduction = True
        guard = functools.partial(_check_peers, rank=self.rank, world_size=self.world_size, device=self.device)
        for unit in self._units():
            unit.set_custom_all_gather(_GuardedAllGather(guard))
            unit.set_custom_reduce_scatter(_GuardedReduceScatter(guard))

    def discard_window(self):
        # reset_iter_state drops FSDP's half-finished forward/backward bookkeeping but keeps
        # the unsharded gradients accumulated so far: clear those by hand.
        self.module.reset_iter_state()
        for unit in self._units():
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    if hasattr(param, "_unsharded_param"):
                        param._unsharded_param.grad = None
                    param.unsharded_accumulated_grad = None
        self.zero_grad()
        self._backward_closes_window = True

    def _units(self) -> list[FSDPModule]:
        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    def reduce_gradients(self):
        if not self._backward_closes_window:
            self._finish_backward_now()

    def _finish_backward_now(self) -> None:
        """Reduce-scatter the gradients accumulated without sync and reshard, as the end of
        a closing backward would have. FSDP2 has no public call for this; its end-of-backward
        callback does exactly it (tested in tests/test_distributed.py, short windows)."""
        self.module.set_requires_gradient_sync(True)
        self.module.set_reshard_after_backward(True)
        self._flags = (True, True)
        state = self.module._get_fsdp_state()
        state._state_ctx.is_last_backward = True
        state._root_post_backward_final_callback()
        self._backward_closes_window = True

    def local_gradients(self):
        return [p.grad.to_local() for p in self.module.parameters() if p.grad is not None]

    def gradients_are_sharded(self):
        return True

    def full_state_dict(self):
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
