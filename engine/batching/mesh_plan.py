"""The batch plan of a mesh: the planner counts data-parallel ranks only, and its errors say
how they follow from the world (``world 8 = pipeline 2 × data 4 × context 1 × tensor 1``)."""

from __future__ import annotations

from engine.batching.plan import BatchPlan, plan_from_config
from engine.distributed.mesh import MeshLayout
from engine.errors import BatchConfigError


def plan_for_mesh(config, mesh: MeshLayout, rank: int = 0) -> BatchPlan:
    """The plan of ``config`` for ``mesh``'s data-parallel ranks; ``rank`` is a global rank."""
    try:
        return plan_from_config(config, mesh.data, mesh.data_rank(rank))
    except BatchConfigError as error:
        if mesh.is_data_parallel_only:
            raise
        raise BatchConfigError(f"{describe_data_ranks(mesh)}: {error}") from None


def describe_data_ranks(mesh: MeshLayout) -> str:
    """'world 8 = pipeline 2 × data 4 × context 1 × tensor 1: the batch is planned for W_dp =
    8 / (pipeline 2 × context 1 × tensor 1) = 4 data-parallel rank(s), so G = M·A·4'."""
    return (f"{mesh.describe()}: the batch is planned for W_dp = {mesh.world_size} / "
            f"(pipeline {mesh.pipeline} × context {mesh.context} × tensor {mesh.tensor}) = {mesh.data} data-parallel "
            f"rank(s), so G = M·A·{mesh.data}")
