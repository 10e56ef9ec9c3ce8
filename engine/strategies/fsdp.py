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

Between windows, stages 1 and 2 hold the parameters gathered, as DeepSpeed's ZeRO-1/2 hold
them whole: the window's one all-gather runs after the step instead of at the next forward, and
``module.state_dict()`` on any rank alone gives whole, plain tensors (checkpoints still save
shards). Stage 3 rests sharded.

Offload (``offload_param`` / ``offload_optimizer``, read by ``engine.config.offload``):
FSDP2's ``CPUOffloadPolicy`` keeps the shards, their gradients and the optimizer state on
the host; the gathered parameters live on the device while a unit computes.

``fully_shard`` itself (policies, parameters held apart, gloo's collectives) is wired in
``engine.strategies.sharding``, which each pipeline stage goes through too.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from engine.adapters.torch_internals import (
    drop_unreduced_gradients, fsdp_held_tensors, reduce_accumulated_gradients, state_dict_as_held,
)
from engine.distributed.collectives import broadcast_
from engine.strategies.model_transforms import container_layers, outermost_containers
from engine.strategies.base import TorchStrategy, cpu_state_dict, repoint_optimizer
from engine.strategies.sharded_calls import ShardedCallCheck
from engine.strategies.sharding import ShardingPolicy, host_offload_policy, on_gloo, set_comms, shard
from engine.strategies.deferral import ReductionDeferral


def _parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def shard_units(module: torch.nn.Module, unit_size: int) -> list[list[torch.nn.Module]]:
    """Groups of consecutive layers of the outermost containers, each closed once it holds
    ``unit_size`` parameters (a container's last group may hold fewer). Layers without
    parameters join whichever group is open. A group holding the whole model is left to the
    root unit."""
    units = []
    for container in outermost_containers(module):
        group, size = [], 0
        for layer in container_layers(container):
            group.append(layer)
            size += _parameter_count(layer)
            if size >= unit_size:
                units.append(group)
                group, size = [], 0
        if size:
            units.append(group)
    total = _parameter_count(module)
    return [group for group in units if sum(map(_parameter_count, group)) < total]


def _ahead(sizes: list[int], budget: int) -> int:
    """How many of the units of ``sizes`` (in the order they run) fit in ``budget`` parameters
    (one at least, when the budget is not 0)."""
    count, total = 0, 0
    for size in sizes:
        if count and total + size > budget or not budget:
            break
        count, total = count + 1, total + size
    return count


def _prefetch(units: list[FSDPModule], sizes: list[int], budget: int) -> None:
    """``zero_optimization.stage3_prefetch_bucket_size``: each unit starts the all-gather of the
    next units (up to ``budget`` parameters) in the forward, and of the previous ones in the
    backward, before it computes — more overlap, more gathered memory. 0: none explicitly
    (FSDP2's default order-based prefetching remains)."""
    for i, unit in enumerate(units):
        following = units[i + 1:i + 1 + _ahead(sizes[i + 1:], budget)]
        preceding = units[:i][::-1][:_ahead(sizes[:i][::-1], budget)]
        unit.set_modules_to_forward_prefetch(following)
        unit.set_modules_to_backward_prefetch(preceding)


def _local_bytes(param: torch.Tensor, element_size: int | None = None) -> int:
    """Bytes of this rank's piece of ``param`` (elements of ``element_size`` bytes; None: its own)."""
    piece = param.to_local() if hasattr(param, "to_local") else param
    return piece.numel() * (element_size or piece.element_size())


class FullyShardedDataParallel(TorchStrategy):
    def __init__(self, setup, dist_info):
        super().__init__(setup, dist_info)
        self.stage = setup.stage
        self.rests_gathered = setup.stage < 3  # whole parameters between windows (ZeRO-1/2, as DeepSpeed)
        self._flags = None  # (gradient sync, reshard after backward, reshard after forward) last set
        self._window_defers = None  # decided at a window's first micro-step

    def setup(self, module, optimizer):
        module = module.to(self.device)
        self.start_equal(module)
        names = {id(p): name for name, p in module.named_parameters()}
        self.parallelize(module)  # tensor split, checkpointing, compile: before the data dimension shards
        mesh = self.sharding_mesh()
        # This rank's bytes (a tensor split holds a piece of each split layer).
        trainable = sum(_local_bytes(p) for p in module.parameters() if p.requires_grad)
        everything = sum(_local_bytes(p, self.precision.compute_itemsize) for p in module.parameters())
        self.offload_policy = host_offload_policy(self.settings.offload, self.device)
        module_names = {id(m): name for name, m in module.named_modules()}
        groups = shard_units(module, self.settings.shard_unit_size)
        unit_sizes = [sum(map(_parameter_count, group)) for group in groups]
        # The root: at stage 3 None lets FSDP2 keep its parameters from forward to backward.
        policy = ShardingPolicy(mesh, self.offload_policy, self.group_held, self.precision.fsdp_policies())
        self.inner_units = shard(policy, [module], groups, unit_reshards=self.stage == 3,
                                 root_reshards=None if self.stage == 3 else False)[:-1]
        if self.settings.overlap.prefetch_parameters is not None:
            _prefetch(self.inner_units, unit_sizes, self.settings.overlap.prefetch_parameters)
        repoint_optimizer(optimizer, names, module)
        # ZeRO 3, until the first window closes: a module called around its unit is named (not under a
        # tensor split, whose parameters are DTensors anyway, nor in compiled blocks, whose graphs the
        # hooks would enter and their removal recompile)
        self._sharded_calls = ShardedCallCheck(module, [module_names[id(u)] for u in self.inner_units]) \
            if self.stage == 3 and self.mesh.tensor == 1 and self.settings.compile is None else None
        self.module = self.forward_module = module
        self.optimizer = optimizer
        self._gloo = on_gloo(mesh)
        # Deferring adds the full-size gradient, and at stage 3 the parameters kept gathered.
        self.deferral = ReductionDeferral(self.settings.defer_reduction, self,
                                          extra_bytes=trainable + (everything if self.stage == 3 else 0),
                                          memory_limit=self.settings.memory_limit)
        if self.rests_gathered:
            self._gather()
            state_dict_as_held(self._units())

    def sharding_mesh(self):
        """The mesh the shards are spread over: the gradient-reduction group (data × context; every
        rank on a mesh of data ranks only), or on a hybrid mesh (replicas, shard group) — FSDP2's HSDP
        (``engine.distributed.mesh.MeshGroups.sharding_mesh``)."""
        if self.groups is None:
            return init_device_mesh(self.device.type, (self.world_size,))
        return self.groups.sharding_mesh()

    def capabilities(self):
        shared = super().capabilities()
        split_exchanges, held_apart_exchange = self._split_model_exchanges(), shared.forward_communicates()
        gathers_again = self.stage == 3 and shared.reduces_gradients_over_ranks

        # Both read the reduction's deferral, which defer_reduction: auto decides again after every window.
        def communicates_before_closing_backward() -> bool:
            # Only ZeRO-2 deferring its reduction (parameters gathered since the last step) waits for the
            # closing backward, unless the split model exchanges in its forwards.
            return split_exchanges or not (self.rests_gathered and self.deferral.deferring)

        def forward_communicates() -> bool:
            # Beyond a window's first forward, only ZeRO-3 gathers again (unless the window defers, or
            # one data rank holds every shard: a tensor mesh with data 1), and parameters held apart may
            # exchange in every forward.
            return gathers_again and not self._window_defers or held_apart_exchange

        # Every forward of a window may run before its backwards: each backward gathers again what it
        # needs (FSDP2's pre-backward unshard) and reduces its gradients into shards as a micro-step does
        # (a held forward is prepared as one that does not close the window; deferring, the boundary reduces).
        return replace(shared, communicates_before_closing_backward=communicates_before_closing_backward,
                       forward_communicates=forward_communicates, can_hold_forwards=True)

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

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        if not torch.is_grad_enabled() and self._window_defers is None and not self.rests_gathered:
            # A forward without gradients between windows (evaluation): no backward or step will
            # free what it gathered, the root unit's parameters (and after a deferred window every
            # unit's: ZeRO-3 held the whole model until the next window; found on a GPU with
            # offload, where the parameters then stayed on the device).
            self._reshard()
        return output

    def backward(self, loss, weight):
        super().backward(loss, weight)
        self.deferral.observe()

    def reduce_gradients(self):
        sync, after_backward, _ = self._flags
        if not sync:  # a deferred window closed early (flush): reduce and reshard now
            reduce_accumulated_gradients(self.module)
            self._flags = None
        elif not after_backward:  # parameters still gathered: the step updates the shards
            self._reshard()
        self.reduce_group_held_gradients()

    def step(self, multiplier, max_norm, want_norm=False, grad_squares=None):
        if self._sharded_calls is not None:  # a window ran through: the model calls its units as it should
            self._sharded_calls.remove()
            self._sharded_calls = None
        result = super().step(multiplier, max_norm, want_norm, grad_squares)
        self.deferral.review()
        self._window_defers = None
        return result

    def release_gathered_parameters(self):
        if not self.rests_gathered:
            self._reshard()

    def _reshard(self) -> None:
        for unit in self._units():
            unit.reshard()

    def _gather(self) -> None:
        for unit in self._units():
            unit.unshard()

    def _is_gathered(self) -> bool:
        return not any(isinstance(p, DTensor) for p in self.module.parameters())

    @contextlib.contextmanager
    def _sharded(self):
        """The module sharded for the duration (checkpoints save and load shards), then back at rest."""
        self._reshard()
        try:
            yield
        finally:
            if self.rests_gathered:
                self._gather()

    @contextlib.contextmanager
    def gathered(self, modifier_rank):
        self.check_gatherable()
        self._gather()
        # What the block found: only what the modifier changed is written back (under the
        # precision policy the gathered parameters are half-precision copies of the fp32 shards).
        found = None if modifier_rank is None else [p.detach().clone() for p in self.module.parameters()]
        try:
            yield
        finally:
            if modifier_rank is not None:
                self._write_back(modifier_rank, found)
            elif not self.rests_gathered:
                self._reshard()

    def _write_back(self, modifier_rank: int, found: list[torch.Tensor]) -> None:
        """The parameters ``modifier_rank`` changed in the block (``found``: their values at its
        start) into every rank's shards (what the optimizer steps)."""
        params = dict(self.module.named_parameters())
        changed = torch.tensor([float(not torch.equal(p.detach(), before)) for p, before in zip(params.values(), found)],
                               device=self.device)
        broadcast_([changed], src=modifier_rank)
        whole = {name: params[name].detach().clone() for name, flag in zip(params, changed.tolist()) if flag}
        broadcast_(list(whole.values()), src=modifier_rank)
        self._reshard()  # frees the gathered copies; the module holds its shards again
        with torch.no_grad():
            for name, shard in self.module.named_parameters():
                if name not in whole:
                    continue
                local = shard.to_local()
                # FSDP2 shards dim 0 as torch.chunk over the mesh's last (shard) dimension
                mesh = shard.device_mesh
                shards, index = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
                chunks = torch.chunk(whole[name], shards, dim=0)
                piece = chunks[index] if index < len(chunks) else whole[name][:0]
                local.copy_(piece.reshape(local.shape))
        if self.rests_gathered:
            self._gather()

    def zero_grad(self):
        super().zero_grad()  # the shards' gradients: the module is sharded after a step
        if self.rests_gathered and not self._is_gathered():
            self._gather()  # the window's all-gather, done now: whole parameters until the next step

    # -- surviving a failed micro-step ----------------------------------------------------------
    def enable_failure_guard(self):
        super().enable_failure_guard()
        # Every all-gather and reduce-scatter first checks the peers' flags, so gradients can
        # still be reduced after every micro-step (ZeRO memory) under an automatic micro size.
        self._set_comms(self.check_peers_before)

    def _set_comms(self, guard) -> None:
        for unit in self._units():
            set_comms(unit, guard, all_to_all_reduce_scatter=self._gloo)

    def discard_window(self):
        drop_unreduced_gradients(self.module, self._units())
        self.zero_grad()
        self._window_defers = None

    # -- what this rank holds ---------------------------------------------------------------------
    def held_tensors(self):
        return super().held_tensors() + list(fsdp_held_tensors(self._units()))

    def full_state_dict(self):
        if self.mesh.tensor > 1:  # each DTensor whole: its tensor pieces and data shards gathered
            return super().full_state_dict()
        # The fp32 master weights: gathered parameters are half-precision copies under the precision policy.
        masters_gathered = self.rests_gathered and self._is_gathered() and not self.precision.converts_parameters
        if masters_gathered:  # every rank holds the whole model, parameters held apart aside: only those gathered
            return self.group_held.whole(cpu_state_dict(self.module.state_dict()))
        with self._sharded():
            return self.group_held.whole(cpu_state_dict(
                get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))))

    def save_training_state(self, directory):
        with self._sharded():
            super().save_training_state(directory)

    def load_training_state(self, directory):
        with self._sharded():
            super().load_training_state(directory)
