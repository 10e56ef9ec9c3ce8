"""FSDP2's sharding, wired in one place for every holder that shards: ``fully_shard`` with the
mesh, the reshard rule, the host offload policy, the precision policies and the parameters held
apart, and gloo's collectives. ZeRO 2 / 3 without a pipeline (``engine.strategies.fsdp``: its shard
units, then the whole model) and each stage of a pipeline (``engine.strategies.pipeline``: each
stage a root of its own) call :func:`shard`; what differs between them is what they pass.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from engine.adapters.torch_internals import fsdp_comms
from engine.distributed.group_held import GroupHeldParameters

log = logging.getLogger("engine")


def host_offload_policy(offload, device: torch.device) -> OffloadPolicy:
    """FSDP2's policy for ``zero_optimization.offload_*`` (``engine.config.offload.TorchOffload``): the
    shards, their gradients and the optimizer state on the host — pinned only where an accelerator
    copies from them — or nothing offloaded."""
    if not offload.to_host:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=offload.pin_memory and device.type != "cpu")


@dataclass(frozen=True)
class ShardingPolicy:
    """What every ``fully_shard`` of one holder shares."""

    mesh: DeviceMesh  # 1-D (the shard group) or, hybrid, 2-D (replicas, shard group)
    offload: OffloadPolicy  # host_offload_policy
    held: GroupHeldParameters  # parameters held apart (split experts): kept out of FSDP2's shards
    # (inner units, roots): half-precision compute over fp32 shards (engine.precision); FSDP2's
    # default where the holder autocasts instead (a pipeline's stages)
    precision: tuple[MixedPrecisionPolicy, MixedPrecisionPolicy] = field(
        default_factory=lambda: (MixedPrecisionPolicy(), MixedPrecisionPolicy()))


def shard(policy: ShardingPolicy, roots: list[torch.nn.Module], units: Sequence[list[torch.nn.Module]] = (), *,
          unit_reshards: bool = True, root_reshards: bool | None = True) -> list[FSDPModule]:
    """Shard ``units`` (groups of modules, each group one FSDP2 unit), then each of ``roots``
    (what the units leave), by ``policy``. ``unit_reshards`` / ``root_reshards``: whether their
    gathered parameters are freed after each forward (None: FSDP2's rule for a root, kept to its
    backward). Returns every FSDP2 unit made, inner ones first (a group's modules share one state:
    its first stands for it)."""
    held = policy.held
    # Parameters held apart stay whole on their ranks: their gradients are reduced over their own replicas.
    ignored = {"ignored_params": {e.param for e in held.parameters}} if held.holds_any else {}
    if isinstance(policy.offload, CPUOffloadPolicy) and held.holds_any:
        log.info("zero_optimization offload: the experts' slices (%d parameter(s), held apart from FSDP2's shards: "
                 "expert_parallel splits them instead) and their optimizer state stay on the device; FSDP2 offloads "
                 "the rest", len(held.parameters))
    inner, outer = policy.precision
    made = []
    for group in units:
        fully_shard(group, mesh=policy.mesh, reshard_after_forward=unit_reshards, offload_policy=policy.offload,
                    mp_policy=inner, **ignored)
        made.append(group[0])
    for root in roots:
        fully_shard(root, mesh=policy.mesh, reshard_after_forward=root_reshards, offload_policy=policy.offload,
                    mp_policy=outer, **ignored)
        made.append(root)
    if on_gloo(policy.mesh):
        for unit in made:
            # gloo has no reduce-scatter of its own (engine.adapters.torch_internals)
            set_comms(unit, guard=None, all_to_all_reduce_scatter=True)
            if policy.mesh.ndim > 1:  # hybrid: FSDP2's all-reduce over the replicas averages, which gloo cannot
                unit.set_force_sum_reduction_for_comms(True)
    return made


def on_gloo(mesh: DeviceMesh) -> bool:
    """Whether the shard group's collectives run on gloo."""
    return dist.get_backend(mesh.get_group(mesh.ndim - 1)) == "gloo"


def set_comms(unit: FSDPModule, guard, all_to_all_reduce_scatter: bool) -> None:
    """``unit``'s all-gather and reduce-scatter: FSDP2's, with ``guard(group)`` called before each
    (None: none) and, on gloo, the reduce-scatter as one all-to-all (``fsdp_comms``)."""
    all_gather, reduce_scatter = fsdp_comms(guard, all_to_all_reduce_scatter=all_to_all_reduce_scatter)
    unit.set_custom_all_gather(all_gather)
    unit.set_custom_reduce_scatter(reduce_scatter)
