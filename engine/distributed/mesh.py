"""The device mesh: world = pipeline × data × tensor ranks.

Ranks are numbered with the tensor dimension innermost (ranks of one tensor group are
neighbours, usually on one node, where their traffic is heaviest), then data, then pipeline:
``rank = (pipeline_index · data + data_index) · tensor + tensor_index``, the order
``init_device_mesh(device, (pipeline, data, tensor))`` uses.

The batch planner counts data-parallel ranks only: ranks of one tensor group see the same
batch, ranks of one pipeline group the same per-data-rank batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import init_device_mesh

from engine.errors import ConfigError

MESH_DIMS = ("pipeline", "data", "tensor")


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of the mesh dimensions; ``data`` is what is left of the world."""

    world_size: int
    tensor: int = 1
    pipeline: int = 1

    def __post_init__(self):
        model = self.tensor * self.pipeline
        if self.tensor < 1 or self.pipeline < 1 or self.world_size % model:
            raise ConfigError([
                f"tensor_parallel / pipeline: the world of {self.world_size} rank(s) does not divide into "
                f"tensor {self.tensor} × pipeline {self.pipeline} = {model} model-parallel ranks; launch a "
                f"multiple of {model} processes, or change the tensor / pipeline sizes"])

    @classmethod
    def from_config(cls, config, world_size: int) -> MeshLayout:
        """The mesh a loaded config asks for on ``world_size`` ranks."""
        return cls(world_size, tensor=config.tensor_parallel.size, pipeline=config.pipeline.stages)

    @property
    def data(self) -> int:
        """Data-parallel ranks: W_dp = world / (tensor × pipeline)."""
        return self.world_size // (self.tensor * self.pipeline)

    @property
    def is_data_parallel_only(self) -> bool:
        return self.tensor == 1 and self.pipeline == 1

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(pipeline index, data index, tensor index) of ``rank``."""
        return rank // (self.data * self.tensor), rank // self.tensor % self.data, rank % self.tensor

    def pipeline_rank(self, rank: int) -> int:
        """This rank's pipeline index: the stage (or first of the stages) it holds."""
        return self.coordinates(rank)[0]

    def data_rank(self, rank: int) -> int:
        """This rank's data-parallel index: the batch planner's rank."""
        return self.coordinates(rank)[1]

    def describe(self) -> str:
        """The mesh in words, for errors and logs: 'world 8 = pipeline 2 × data 2 × tensor 2'."""
        return (f"world {self.world_size} = pipeline {self.pipeline} × data {self.data} × "
                f"tensor {self.tensor}")

    def device_mesh(self, device_type: str):
        """The ``DeviceMesh`` over every rank, dimensions named ``pipeline``, ``data``, ``tensor``
        (collective: every rank calls it)."""
        return init_device_mesh(device_type, (self.pipeline, self.data, self.tensor), mesh_dim_names=MESH_DIMS)
