"""The mesh: world = pipeline × data × context × tensor ranks, resolved once.

Ranks are numbered with the tensor dimension innermost (ranks of one tensor group are
neighbours, usually on one node, where their traffic is heaviest), then context, then data,
then pipeline — the order ``init_device_mesh(device, (pipeline, data, context, tensor))`` uses:
``rank = ((pipeline_index · data + data_index) · context + context_index) · tensor + tensor_index``.

The data dimension is data-replicate × data-shard (``data_index = replicate_index · data_shard +
shard_index``: the ranks of one shard group are consecutive data ranks, usually one node). Without
``data_sharded`` every data rank holds a whole replica (replicate = data, shard = 1); with it FSDP2
shards the model (ZeRO 2 / 3 on the torch backend) over groups of ``shard_size`` data ranks (None:
all of them, replicate = 1), and the groups replicate each other: hybrid sharding (HSDP), where
``1 < shard_size < data``. Gradients are still averaged over every data rank (reduce-scattered in the
shard group, all-reduced over the replicas). Experts borrow data × context ranks: ``expert`` of them
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
``DATA_SHARDING``           data-shard × context     FSDP2 shards the model over them (all of data
                                                     × context unless hybrid)
``DATA_REPLICAS``           data-replicate           hold the same shards (hybrid): their shards'
                                                     gradients all-reduced
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
DATA_SHARDING = ("data_shard", "context")
DATA_REPLICAS = ("data_replicate",)
# The data dimension as the device mesh of a hybrid mesh holds it: replicate outer, shard inner.
DATA_PARTS = ("data_replicate", "data_shard")


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
    shard_size: int | None = None  # data ranks per shard group when data_sharded (None: all of them)
    shard_size_key: str = "shard_size"  # the zero_optimization key it was written as (DeepSpeed's, or ours)

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
        if self.shard_size is not None:
            self._check_shard_size()

    def _check_shard_size(self) -> None:
        size, data = self.shard_size, self.data
        if not self.data_sharded:
            raise ConfigError([
                f"mesh: zero_optimization.{self.shard_size_key} {size} needs a data dimension that shards the model "
                f"(zero_optimization.stage 2 or 3 on backend torch); set the stage, or remove {self.shard_size_key}"])
        if size < 1 or data % size:
            divisors = [d for d in range(1, data + 1) if data % d == 0]
            raise ConfigError([
                f"mesh: zero_optimization.{self.shard_size_key} {size} does not divide the {data} data rank(s) "
                f"({self.describe()}): data = replicate × shard needs {data} / {size} = {data / size:.4g} whole "
                f"replicas; use one of {divisors} (or remove {self.shard_size_key}: one shard group of all {data})"])

    # -- sizes -------------------------------------------------------------------------------
    @property
    def data(self) -> int:
        """Data-parallel ranks, the planner's W: world / (pipeline × context × tensor)."""
        return self.world_size // (self.pipeline * self.context * self.tensor)

    @property
    def data_replicate(self) -> int:
        """Data ranks holding whole replicas of what the data shards hold: data / data_shard."""
        return self.data // self.data_shard

    @property
    def data_shard(self) -> int:
        """Data ranks the model is sharded over (FSDP2): a shard group."""
        if not self.data_sharded:
            return 1
        return self.shard_size if self.shard_size is not None else self.data

    @property
    def hybrid(self) -> bool:
        """Shards within groups of data ranks, replicas across them (both parts beyond one rank)."""
        return self.data_sharded and 1 < self.data_replicate and 1 < self.data_shard

    @property
    def needs_groups(self) -> bool:
        """Whether the runtime needs the mesh's own process groups (otherwise every group is the world)."""
        return not self.is_data_parallel_only or self.hybrid

    def size(self, dims: tuple[str, ...]) -> int:
        """The number of ranks in a group spanning ``dims`` (e.g. ``GRADIENT_REDUCTION``)."""
        return math.prod(getattr(self, dim) for dim in _parts(dims))

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

    def _index(self, rank: int, dim: str) -> int:
        """``rank``'s index along ``dim``: a mesh dimension or a part of the data dimension."""
        coordinates = self.coordinates(rank)
        if dim == "data_replicate":
            return coordinates.data // self.data_shard
        if dim == "data_shard":
            return coordinates.data % self.data_shard
        return getattr(coordinates, dim)

    def group_ranks(self, dims: tuple[str, ...], rank: int) -> list[int]:
        """The global ranks of ``rank``'s group spanning ``dims`` (ascending): those whose
        coordinates differ from ``rank``'s in ``dims`` only (``data`` or its parts, ``DATA_PARTS``)."""
        fixed = [dim for dim in _parts(MESH_DIMS) if dim not in _parts(dims)]
        return [r for r in range(self.world_size) if all(self._index(r, dim) == self._index(rank, dim) for dim in fixed)]

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
        if self.hybrid:
            text += f" (data = replicate {self.data_replicate} × shard {self.data_shard})"
        return text + (f", experts over {self.expert} of the data × context ranks" if self.expert > 1 else "")

    @property
    def device_dims(self) -> tuple[str, ...]:
        """The dimensions of the device mesh, outermost first: ``MESH_DIMS``, the data dimension as
        its two parts on a hybrid mesh."""
        return _parts(MESH_DIMS) if self.hybrid else MESH_DIMS

    def device_mesh(self, device_type: str):
        """The ``DeviceMesh`` over every rank, dimensions named as ``device_dims`` (collective:
        every rank calls it)."""
        dims = self.device_dims
        return init_device_mesh(device_type, tuple(getattr(self, dim) for dim in dims), mesh_dim_names=dims)


def _parts(dims: tuple[str, ...]) -> tuple[str, ...]:
    """``dims`` with ``data`` written as its parts (``DATA_PARTS``)."""
    return tuple(part for dim in dims for part in (DATA_PARTS if dim == "data" else (dim,)))


class MeshGroups:
    """The process groups of one mesh, built once (collective: every rank builds it, in the
    same order). ``submesh(dims)`` is the ``DeviceMesh`` spanning ``dims`` (one dimension, or
    several flattened into one), ``group(dims)`` its process group."""

    def __init__(self, layout: MeshLayout, device_type: str, rank: int):
        self.layout, self.rank = layout, rank
        self.device_mesh = layout.device_mesh(device_type)
        self._submeshes: dict[tuple[str, ...] | str, object] = {}
        self.submesh(GRADIENT_REDUCTION)  # a flattened group when data and context both split: made by every rank
        if layout.hybrid:
            self.sharding_mesh()  # likewise (data-shard × context flattened)
        self.expert_mesh = self.experts = self.expert_replicas = None
        if layout.expert > 1:  # every rank builds every expert group, in the same order
            dims = ("pipeline", "tensor", "expert_replica", "expert")
            whole = DeviceMesh(device_type, torch.tensor(layout.expert_layout()), mesh_dim_names=dims)
            # (expert replica, expert): what a checkpoint's expert tensors are DTensors on
            self.expert_mesh = whole["expert_replica", "expert"]
            self.experts, self.expert_replicas = whole["expert"].get_group(), whole["expert_replica"].get_group()

    def submesh(self, dims: tuple[str, ...]):
        """The ``DeviceMesh`` of this rank's group spanning ``dims`` (mesh dimensions, ``data`` or its
        parts): one device-mesh dimension, or the dimensions flattened into one (the first time:
        collective)."""
        wanted = _parts(dims) if self.layout.hybrid else dims  # without hybrid, the data dimension is one
        dims = tuple(dim for dim in self.layout.device_dims if dim in wanted)  # in rank order
        if dims not in self._submeshes:
            spanned = tuple(dim for dim in dims if self.layout.size((dim,)) > 1) or dims[:1]
            if len(spanned) == 1:
                self._submeshes[dims] = self.device_mesh[spanned[0]]
            else:
                self._submeshes[dims] = flatten_device_mesh(self.device_mesh[spanned], "_".join(spanned))
        return self._submeshes[dims]

    def sharding_mesh(self):
        """The ``DeviceMesh`` FSDP2 shards the data dimension over: 1-D over ``DATA_SHARDING`` (data ×
        context), or on a hybrid mesh 2-D (``DATA_REPLICAS``, ``DATA_SHARDING``): FSDP2's HSDP, which
        reduce-scatters a gradient in the shard group and all-reduces it over the replicas, dividing
        by both (the mean over every data × context rank)."""
        if not self.layout.hybrid:
            return self.submesh(GRADIENT_REDUCTION)
        if "sharding" not in self._submeshes:
            shard = self.submesh(DATA_SHARDING)  # data_shard × context flattened when the context splits
            shard_dim = shard.mesh_dim_names[0]
            self._submeshes["sharding"] = self.device_mesh["data_replicate", shard_dim]
        return self._submeshes["sharding"]

    def group(self, dims: tuple[str, ...]):
        """The process group of this rank's group spanning ``dims`` (the whole world: None, the default group)."""
        if self.layout.size(dims) == self.layout.world_size:
            return None
        return self.submesh(dims).get_group()

    def global_rank(self, dims: tuple[str, ...], index: int) -> int:
        """The global rank of the ``index``-th rank of this rank's group spanning ``dims``."""
        group = self.group(dims)
        return index if group is None else dist.get_global_rank(group, index)
