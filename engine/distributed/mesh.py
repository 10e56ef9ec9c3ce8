"""The device mesh: world = pipeline × data × context × tensor ranks.

Ranks are numbered with the tensor dimension innermost (ranks of one tensor group are
neighbours, usually on one node, where their traffic is heaviest), then context, then data,
then pipeline: ``rank = ((pipeline_index · data + data_index) · context + context_index) ·
tensor + tensor_index``, the order ``init_device_mesh(device, (pipeline, data, context,
tensor))`` uses.

The batch planner counts data-parallel ranks only: ranks of one tensor group and of one
context group see the same batch (a context group splits each of its sequences), ranks of one
pipeline group the same per-data-rank batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import init_device_mesh

from engine.errors import ConfigError

MESH_DIMS = ("pipeline", "data", "context", "tensor")


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of the mesh dimensions; ``data`` is what is left of the world."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    context: int = 1

    def __post_init__(self):
        model = self.tensor * self.pipeline * self.context
        if self.tensor < 1 or self.pipeline < 1 or self.context < 1 or self.world_size % model:
            raise ConfigError([
                f"tensor_parallel / pipeline / context_parallel: the world of {self.world_size} rank(s) does not "
                f"divide into pipeline {self.pipeline} × context {self.context} × tensor {self.tensor} = {model} "
                f"ranks per data-parallel rank; launch a multiple of {model} processes, or change the sizes"])

    @classmethod
    def from_config(cls, config, world_size: int) -> MeshLayout:
        """The mesh a loaded config asks for on ``world_size`` ranks."""
        return cls(world_size, tensor=config.tensor_parallel.size, pipeline=config.pipeline.stages,
                   context=config.context_parallel.size)

    @property
    def data(self) -> int:
        """Data-parallel ranks: W_dp = world / (pipeline × context × tensor)."""
        return self.world_size // (self.tensor * self.pipeline * self.context)

    @property
    def is_data_parallel_only(self) -> bool:
        return self.tensor == 1 and self.pipeline == 1 and self.context == 1

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipeline index, data index, tensor index) of ``rank``."""
        inner = self.context * self.tensor
        return rank // (self.data * inner), rank // inner % self.data, rank % self.tensor

    def context_rank(self, rank: int) -> int:
        """This rank's index in its context group (which part of each sequence it holds)."""
        return rank // self.tensor % self.context

    def context_groups(self) -> list[list[int]]:
        """The ranks of every context group (ranks that split the same sequences), in context order."""
        starts = [rank for rank in range(self.world_size) if self.context_rank(rank) == 0]
        return [[start + index * self.tensor for index in range(self.context)] for start in starts]

    def pipeline_rank(self, rank: int) -> int:
        """This rank's pipeline index: the stage (or first of the stages) it holds."""
        return self.coordinates(rank)[0]

    def data_rank(self, rank: int) -> int:
        """This rank's data-parallel index: the batch planner's rank."""
        return self.coordinates(rank)[1]

    def describe(self) -> str:
        """The mesh in words, for errors and logs: 'world 8 = pipeline 2 × data 2 × tensor 2'
        ('× context 2' before the tensor size when sequences are split)."""
        context = f" × context {self.context}" if self.context > 1 else ""
        return (f"world {self.world_size} = pipeline {self.pipeline} × data {self.data}{context} × "
                f"tensor {self.tensor}")

    def device_mesh(self, device_type: str):
        """The ``DeviceMesh`` over every rank, dimensions named ``pipeline``, ``data``, ``context``,
        ``tensor`` (collective: every rank calls it)."""
        return init_device_mesh(device_type, (self.pipeline, self.data, self.context, self.tensor),
                                mesh_dim_names=MESH_DIMS)
