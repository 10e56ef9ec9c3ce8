"""The mesh: world = pipeline × data × context × tensor ranks, resolved once.

Ranks are numbered with the tensor dimension innermost (ranks of one tensor group are
neighbours, usually on one node, where their traffic is heaviest), then context, then data,
then pipeline — the order ``init_device_mesh(device, (pipeline, data, context, tensor))`` uses:
``rank = ((pipeline_index · data + data_index) · context + context_index) · tensor + tensor_index``.

The data dimension is data-replicate × data-shard: one of the two is the whole data dimension
(``data_sharded``: FSDP2 shards the model over it, ZeRO 2 / 3 on the torch backend; otherwise
every data rank holds a whole replica). Experts borrow data × context ranks: ``expert`` of them
split the experts between them (it must divide data × context), no rank is added for them. In the
data × context index ``i = data_index · context + context_index`` of a (pipeline, tensor)
coordinate, the expert group is ``i // expert`` (consecutive ranks: the all-to-all's traffic stays
near) and the rank holds slice ``i % expert`` of the experts; the ranks holding the same slice are
its expert replicas.

:class:`MeshLayout` is arithmetic on sizes (no process group needed: ``python -m engine plan``
uses it); :class:`MeshGroups` builds the process groups of one mesh, once, collectively. Both
name the groups the runtime needs, by the dimensions they span:

=========================  =======================  ==============================================
group                       dimensions               why
=========================  =======================  ==============================================
``GRADIENT_REDUCTION``      data × context           ranks holding the same parameters on different
                                                     rows or sequence pieces: gradients averaged
``WINDOW_STATISTICS``       data × context           samples, token counts, losses of a window are
                                                     summed (every row and token counted once)
``GRADIENT_NORM``           the whole world          every stage, shard and tensor piece; a piece
                                                     held by several ranks divided by its copies
``SAME_BATCH``              pipeline × context ×     ranks of one data index: they must be given the
                            tensor                   same batch (checked, never assumed)
``EXPERTS``                 data × context           the ranks experts are spread over
expert group                ``expert`` ranks of      split the experts: tokens dispatched to the
(``MeshGroups.experts``)    data × context           rank holding their expert (all-to-all)
expert replicas             data × context /         hold the same slice of the experts: its
(``.expert_replicas``)      ``expert`` ranks         gradients summed over them
=========================  =======================  ==============================================

The batch planner counts data ranks only (its W is ``data``): the context, tensor and pipeline
ranks of one data index see the same rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.adapters.torch_internals import flatten_device_mesh
from engine.errors import ConfigError

MESH_DIMS = ("pipeline", "data", "context", "tensor")  # outermost first: the rank order

GRADIENT_REDUCTION = ("data", "context")
WINDOW_STATISTICS = ("data", "context")
GRADIENT_NORM = MESH_DIMS
SAME_BATCH = ("pipeline", "context", "tensor")
STATISTICS_COPIES = ("pipeline", "tensor")  # ranks of a SAME_BATCH group holding the same window statistics
STAGE_HOLDERS = ("data", "context", "tensor")  # ranks holding a part of one pipeline stage
EXPERTS = ("data", "context")


class MeshCoordinates(NamedTuple):
    """Where one rank sits on the mesh."""

    pipeline: int
    data: int
    context: int
    tensor: int


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of the mesh dimensions; ``data`` is what is left of the world."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1  # borrowed from data × context, not a factor of the world
    data_sharded: bool = False  # the data dimension shards the model (FSDP2) rather than replicates it

    def __post_init__(self):
        sizes = {"tensor": self.tensor, "pipeline": self.pipeline, "context": self.context, "expert": self.expert}
        problems = [f"{name} size must be at least 1, got {size}" for name, size in sizes.items() if size < 1]
        if problems:
            raise ConfigError(problems)
        model = self.pipeline * self.context * self.tensor
        if self.world_size % model:
            raise ConfigError([
                f"mesh: the world of {self.world_size} rank(s) does not divide into pipeline {self.pipeline} × "
                f"context {self.context} × tensor {self.tensor} = {model} ranks per data replica "
                f"({self.world_size} / {model} = {self.world_size / model:.4g}); launch a multiple of {model} "
                "processes, or change pipeline.stages / context_parallel.size / tensor_parallel.size"])
        borrowed = self.data * self.context
        if borrowed % self.expert:
            # the fewest processes whose data × context ranks divide by the expert size
            processes = model * (self.expert // math.gcd(self.expert, self.context))
            launch = (f"launch a multiple of {processes} processes (python -m launch --nproc-per-node {processes} "
                      "...)")
            fix = (f"{launch}, or set expert_parallel.size: 1" if borrowed == 1 else
                   f"{launch}, or use a divisor of {borrowed}" if borrowed < self.expert else
                   f"use a divisor of {borrowed}, or {launch}")
            raise ConfigError([
                f"mesh: expert_parallel.size {self.expert} does not divide the data {self.data} × context "
                f"{self.context} = {borrowed} ranks the experts are spread over ({self.describe()}); {fix}"])

    # -- sizes -------------------------------------------------------------------------------
    @property
    def data(self) -> int:
        """Data-parallel ranks, the planner's W: world / (pipeline × context × tensor)."""
        return self.world_size // (self.pipeline * self.context * self.tensor)

    @property
    def data_replicate(self) -> int:
        """Data ranks holding whole replicas of what the data shards hold."""
        return 1 if self.data_sharded else self.data

    @property
    def data_shard(self) -> int:
        """Data ranks the model is sharded over (FSDP2)."""
        return self.data if self.data_sharded else 1

    def size(self, dims: tuple[str, ...]) -> int:
        """The number of ranks in a group spanning ``dims`` (e.g. ``GRADIENT_REDUCTION``)."""
        return math.prod(getattr(self, dim) for dim in dims)

    @property
    def is_data_parallel_only(self) -> bool:
        """Every rank holds the whole model (no dimension splits it, experts included)."""
        return self.tensor == 1 and self.pipeline == 1 and self.context == 1 and self.expert == 1

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same slice of the experts: data × context / expert."""
        return self.data * self.context // self.expert

    # -- where a rank sits -------------------------------------------------------------------
    def coordinates(self, rank: int) -> MeshCoordinates:
        """(pipeline, data, context, tensor) index of ``rank``."""
        tensor, rest = rank % self.tensor, rank // self.tensor
        context, rest = rest % self.context, rest // self.context
        return MeshCoordinates(rest // self.data, rest % self.data, context, tensor)

    def rank_at(self, coordinates: MeshCoordinates) -> int:
        p, d, c, t = coordinates
        return ((p * self.data + d) * self.context + c) * self.tensor + t

    def pipeline_rank(self, rank: int) -> int:
        """This rank's pipeline index: the stage (or first of the stages) it holds."""
        return self.coordinates(rank).pipeline

    def data_rank(self, rank: int) -> int:
        """This rank's data-parallel index: the batch planner's rank."""
        return self.coordinates(rank).data

    def group_ranks(self, dims: tuple[str, ...], rank: int) -> list[int]:
        """The global ranks of ``rank``'s group spanning ``dims`` (ascending): those whose
        coordinates differ from ``rank``'s in ``dims`` only."""
        mine = self.coordinates(rank)
        return [r for r in range(self.world_size)
                if all(getattr(self.coordinates(r), dim) == getattr(mine, dim) for dim in MESH_DIMS if dim not in dims)]

    def expert_index(self, rank: int) -> int:
        """Which slice of the experts ``rank`` holds (0 .. expert - 1)."""
        p, d, c, t = self.coordinates(rank)
        return (d * self.context + c) % self.expert

    def expert_layout(self):
        """Every rank, as a (pipeline, tensor, expert replica, expert) array of global ranks: row
        [p][t][r] is an expert group, column [p][t][:, e] the replicas of slice e."""
        return [[[[self.rank_at(MeshCoordinates(p, (r * self.expert + e) // self.context,
                                                (r * self.expert + e) % self.context, t))
                   for e in range(self.expert)] for r in range(self.expert_replicas)]
                 for t in range(self.tensor)] for p in range(self.pipeline)]

    def index_in(self, dims: tuple[str, ...], rank: int) -> int:
        """``rank``'s place in its group spanning ``dims`` (ranks in ascending order)."""
        return self.group_ranks(dims, rank).index(rank)

    def describe(self) -> str:
        """The mesh in words, for errors and logs:
        'world 8 = pipeline 2 × data 2 × context 1 × tensor 2' (and the experts where split)."""
        text = (f"world {self.world_size} = pipeline {self.pipeline} × data {self.data} × context {self.context} × "
                f"tensor {self.tensor}")
        return text + (f", experts over {self.expert} of the data × context ranks" if self.expert > 1 else "")

    def device_mesh(self, device_type: str):
        """The ``DeviceMesh`` over every rank, dimensions named as ``MESH_DIMS`` (collective:
        every rank calls it)."""
        return init_device_mesh(device_type, tuple(getattr(self, dim) for dim in MESH_DIMS), mesh_dim_names=MESH_DIMS)


class MeshGroups:
    """The process groups of one mesh, built once (collective: every rank builds it, in the
    same order). ``submesh(dims)`` is the ``DeviceMesh`` spanning ``dims`` (one dimension, or
    several flattened into one), ``group(dims)`` its process group."""

    def __init__(self, layout: MeshLayout, device_type: str, rank: int):
        self.layout, self.rank = layout, rank
        self.device_mesh = layout.device_mesh(device_type)
        self._submeshes: dict[tuple[str, ...], object] = {}
        self.submesh(GRADIENT_REDUCTION)  # a flattened group when data and context both split: made by every rank
        self.expert_mesh = self.experts = self.expert_replicas = None
        if layout.expert > 1:  # every rank builds every expert group, in the same order
            dims = ("pipeline", "tensor", "expert_replica", "expert")
            whole = DeviceMesh(device_type, torch.tensor(layout.expert_layout()), mesh_dim_names=dims)
            # (expert replica, expert): what a checkpoint's expert tensors are DTensors on
            self.expert_mesh = whole["expert_replica", "expert"]
            self.experts, self.expert_replicas = whole["expert"].get_group(), whole["expert_replica"].get_group()

    def submesh(self, dims: tuple[str, ...]):
        """The ``DeviceMesh`` of this rank's group spanning ``dims``: one mesh dimension, or the
        dimensions flattened into one (the first time: collective)."""
        dims = tuple(dim for dim in MESH_DIMS if dim in dims)  # in rank order
        if dims not in self._submeshes:
            spanned = tuple(dim for dim in dims if getattr(self.layout, dim) > 1) or dims[:1]
            if len(spanned) == 1:
                self._submeshes[dims] = self.device_mesh[spanned[0]]
            else:
                self._submeshes[dims] = flatten_device_mesh(self.device_mesh[spanned], "_".join(spanned))
        return self._submeshes[dims]

    def group(self, dims: tuple[str, ...]):
        """The process group of this rank's group spanning ``dims`` (the whole world: None, the default group)."""
        if self.layout.size(dims) == self.layout.world_size:
            return None
        return self.submesh(dims).get_group()

    def global_rank(self, dims: tuple[str, ...], index: int) -> int:
        """The global rank of the ``index``-th rank of this rank's group spanning ``dims``."""
        group = self.group(dims)
        return index if group is None else dist.get_global_rank(group, index)
