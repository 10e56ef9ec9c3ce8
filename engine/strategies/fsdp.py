"""ZeRO stages 2 and 3 on FSDP2 (``fully_shard``): parameters, gradients and optimizer
state sharded across ranks.

Shard units. The layers of the model's outermost ``ModuleList`` / ``Sequential`` (its
transformer blocks, an MLP's layers) are sharded in groups of consecutive layers holding at
least ``zero_optimization.shard_unit_size`` parameters; the root unit takes the rest. Fewer,
larger units mean fewer, larger collectives, as DeepSpeed's bucket sizes do.

Memory, by default (``defer_reduction: false``): every backward reduce-scatters its
gradients into shards, so no rank holds a full-size gradient between micro-steps.
* Stage 2 keeps parameters gathered from a window's first forward to its last backward
  (ZeRO-2 holds them whole anyway): one all-gather per window, one reduce-scatter per
  micro-step.
* Stage 3 frees gathered parameters after every forward and every backward and gathers
  them again for the next — except the root unit's, kept from its forward to its backward
  (FSDP2's rule: they would be gathered again at once).

``defer_reduction: true`` trades memory for traffic: gradients accumulate full-size and
parameters stay gathered for the whole window, which then costs one all-gather and one
reduce-scatter per unit whatever its number of micro-steps. ``"auto"`` chooses per window
(``engine.strategies.deferral``).

Offload (``offload_param`` / ``offload_optimizer``, read by ``engine.config.offload``):
FSDP2's ``CPUOffloadPolicy`` keeps the shards, their gradients and the optimizer state on
the host; the gathered parameters live on the device while a unit computes.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from engine.adapters.torch_internals import (
    drop_unreduced_gradients, fsdp_comms, fsdp_held_tensors, reduce_accumulated_gradients,
)
from engine.distributed.collectives import broadcast_, check_peers
from engine.strategies.base import TorchStrategy, cpu_state_dict
from engine.strategies.deferral import ReductionDeferral

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)


def _parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _layers(container: torch.nn.Module):
    """A container's entries, with nested containers opened up."""
    for child in container.children():
        if isinstance(child, _CONTAINERS):
            yield from _layers(child)
        else:
            yield child


def _outermost_containers(module: torch.nn.Module):
    if isinstance(module, _CONTAINERS):
        yield module
        return
    for child in module.children():
        yield from _outermost_containers(child)


def shard_units(module: torch.nn.Module, unit_size: int) -> list[list[torch.nn.Module]]:
    """Groups of consecutive layers of the outermost containers, each closed once it holds
    ``unit_size`` parameters (a container's last group may hold fewer). Layers without
    parameters join whichever group is open. A group holding the whole model is left to the
    root unit."""
    units = []
    for container in _outermost_containers(module):
        group, size = [], 0
        for layer in _layers(container):
            group.append(layer)
            size += _parameter_count(layer)
            if size >= unit_size:
                units.append(group)
                group, size = [], 0
        if size:
            units.append(group)
    total = _parameter_count(module)
    return [group for group in units if sum(map(_parameter_count, group)) < total]


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


class FullyShardedDataParallel(TorchStrategy):
    name = "fsdp"

    def __init__(self, setup, dist_info):
        super().__init__(setup, dist_info)
        self.stage = setup.stage
        self._flags = None  # (gradient sync, reshard after backward, reshard after forward) last set
        self._window_defers = None  # decided at a window's first micro-step

    def setup(self, module, optimizer):
        module = module.to(self.device)
        broadcast_([*module.parameters(), *module.buffers()], src=0)  # as DDP does: every rank starts from rank 0's model
        names = {id(p): name for name, p in module.named_parameters()}
        trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        everything = sum(p.numel() * p.element_size() for p in module.parameters())
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        offload = self.settings.offload
        # Pinned host memory needs an accelerator to copy to.
        self.offload_policy = CPUOffloadPolicy(pin_memory=offload.pin_memory and self.device.type != "cpu") \
            if offload.to_host else OffloadPolicy()
        self.inner_units = []
        for group in shard_units(module, self.settings.shard_unit_size):
            fully_shard(group, mesh=mesh, reshard_after_forward=self.stage == 3, offload_policy=self.offload_policy)
            self.inner_units.append(group[0])  # the modules of one group share their FSDP state
        # The root: at stage 3 None lets FSDP2 keep its parameters from forward to backward.
        fully_shard(module, mesh=mesh, reshard_after_forward=None if self.stage == 3 else False,
                    offload_policy=self.offload_policy)
        _repoint_optimizer(optimizer, names, module)
        self.module = self.forward_module = module
        self.optimizer = optimizer
        self.group = mesh.get_group()
        self._gloo = dist.get_backend(self.group) == "gloo"
        if self._gloo:
            self._set_comms(guard=None)
        # Deferring adds the full-size gradient, and at stage 3 the parameters kept gathered.
        self.deferral = ReductionDeferral(self.settings.defer_reduction, self,
                                          extra_bytes=trainable + (everything if self.stage == 3 else 0),
                                          memory_limit=self.settings.memory_limit)

    @property
    def forward_communicates(self) -> bool:
        # Beyond a window's first forward, only ZeRO-3 gathers again (unless the window defers).
        return self.stage == 3 and not self._window_defers

    def _units(self) -> list[FSDPModule]:
        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    # -- a window -----------------------------------------------------------------------------
    def prepare_micro_step(self, closes_window):
        if self._window_defers is None:  # the window's first micro-step
            self._window_defers = self.deferral.deferring
        defers = self._window_defers
        flags = (closes_window or not defers,  # reduce-scatter in this backward
                 closes_window or (self.stage == 3 and not defers),  # free gathered parameters after it
                 self.stage == 3 and not defers)  # free them after each forward (non-root units)
        if flags == self._flags:  # each setter walks every module: only when they change
            return
        sync, after_backward, after_forward = flags
        self.module.set_requires_gradient_sync(sync)
        self.module.set_reshard_after_backward(after_backward)
        if self._flags is None or after_forward != self._flags[2]:
            for unit in self.inner_units:
                unit.set_reshard_after_forward(after_forward, recurse=False)
        self._flags = flags

    def backward(self, loss, weight):
        super().backward(loss, weight)
        self.deferral.observe()

    def reduce_gradients(self):
        sync, after_backward, _ = self._flags
        if not sync:  # a deferred window closed early (flush): reduce and reshard now
            reduce_accumulated_gradients(self.module)
            self._flags = None
        elif not after_backward:  # parameters still gathered: the step updates the shards
            self.release_gathered_parameters()

    def step(self, multiplier, max_norm, want_norm=False):
        result = super().step(multiplier, max_norm, want_norm)
        self.deferral.review()
        self._window_defers = None
        return result

    def release_gathered_parameters(self):
        for unit in self._units():
            unit.reshard()

    # -- surviving a failed micro-step ----------------------------------------------------------
    def enable_failure_guard(self):
        # Every all-gather and reduce-scatter first checks the peers' flags, so gradients can
        # still be reduced after every micro-step (ZeRO memory) under an automatic micro size.
        self._set_comms(functools.partial(check_peers, rank=self.rank, world_size=self.world_size,
                                          device=self.device))

    def _set_comms(self, guard) -> None:
        for unit in self._units():
            all_gather, reduce_scatter = fsdp_comms(guard, all_to_all_reduce_scatter=self._gloo)
            unit.set_custom_all_gather(all_gather)
            unit.set_custom_reduce_scatter(reduce_scatter)

    def discard_window(self):
        drop_unreduced_gradients(self.module, self._units())
        self.zero_grad()
        self._window_defers = None

    # -- what this rank holds ---------------------------------------------------------------------
    def local_gradients(self):
        return [p.grad.to_local() for p in self.module.parameters() if p.grad is not None]

    def gradients_are_sharded(self):
        return True

    def held_tensors(self):
        return super().held_tensors() + list(fsdp_held_tensors(self._units()))

    def full_state_dict(self):
        return cpu_state_dict(get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True)))
