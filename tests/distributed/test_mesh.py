"""The mesh layout: which rank sits where, and errors that name the mesh."""

import pytest

import engine
import torch
import torch.distributed as dist

from engine.distributed import mesh as mesh_module
from engine.config.setup import mesh_layout
from engine.distributed.mesh import MeshLayout
from tests.support.dist_utils import run_distributed


def test_tensor_innermost_then_data_then_pipeline():
    mesh = MeshLayout(8, tensor=2, pipeline=2)
    assert mesh.data == 2
    assert [mesh.coordinates(r) for r in range(8)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1), (1, 1, 0, 0), (1, 1, 0, 1)]
    assert [mesh.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert mesh.describe() == "world 8 = pipeline 2 × data 2 × context 1 × tensor 2"


def test_data_parallel_only_by_default():
    mesh = MeshLayout(4)
    assert mesh.is_data_parallel_only and mesh.data == 4
    assert [mesh.data_rank(r) for r in range(4)] == [0, 1, 2, 3]


def test_a_world_that_does_not_divide_names_the_sizes():
    with pytest.raises(engine.ConfigError, match=r"world of 6 rank\(s\) does not divide into pipeline 2 × context 1 × "
                                                 r"tensor 2 = 4 ranks per data replica \(6 / 4 = 1.5\)"):
        MeshLayout(6, tensor=2, pipeline=2)


def test_context_sits_between_data_and_tensor():
    mesh = MeshLayout(16, tensor=2, pipeline=2, context=2)
    assert mesh.data == 2 and mesh.size(mesh_module.GRADIENT_REDUCTION) == 4
    assert [tuple(mesh.coordinates(r)) for r in range(8)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1), (0, 1, 0, 0), (0, 1, 0, 1), (0, 1, 1, 0), (0, 1, 1, 1)]
    assert all(mesh.rank_at(mesh.coordinates(r)) == r for r in range(16))
    # rank 5 = (pipeline 0, data 1, context 0, tensor 1)
    assert mesh.group_ranks(mesh_module.GRADIENT_REDUCTION, 5) == [1, 3, 5, 7]  # tensor 1 of stage 0, every data × context
    assert mesh.group_ranks(mesh_module.WINDOW_STATISTICS, 5) == [1, 3, 5, 7]
    assert mesh.group_ranks(mesh_module.SAME_BATCH, 5) == [4, 5, 6, 7, 12, 13, 14, 15]  # data index 1
    assert mesh.group_ranks(mesh_module.GRADIENT_NORM, 5) == list(range(16))
    assert mesh.group_ranks(("tensor",), 5) == [4, 5]
    assert mesh.describe() == "world 16 = pipeline 2 × data 2 × context 2 × tensor 2"


def test_data_is_replicate_or_shard():
    assert (MeshLayout(4).data_replicate, MeshLayout(4).data_shard) == (4, 1)
    sharded = MeshLayout(8, tensor=2, data_sharded=True)
    assert (sharded.data_replicate, sharded.data_shard) == (1, 4)


def test_experts_borrow_data_and_context():
    mesh = MeshLayout(8, tensor=2, context=2, expert=4)
    assert mesh.data == 2 and mesh.world_size == 8  # no rank added for the experts
    assert mesh.describe().endswith(", experts over 4 of the data × context ranks")
    with pytest.raises(engine.ConfigError, match=r"expert_parallel.size 3 does not divide the data 2 × context 2 = 4 "
                                                 r"ranks .*world 8 = pipeline 1 × data 2 × context 2 × tensor 2"):
        MeshLayout(8, tensor=2, context=2, expert=3)
    with pytest.raises(engine.ConfigError, match="context size must be at least 1, got 0"):
        MeshLayout(8, context=0)


def test_config_mesh_shards_the_data_dimension_at_zero_2_and_3():
    for stage, sharded in ((0, False), (1, False), (2, True), (3, True)):
        config = engine.load_config({"train_batch_size": 8, "zero_optimization": {"stage": stage}})
        assert mesh_layout(config, 4).data_sharded is sharded


def _mesh_groups(rank, world_size):
    from engine.distributed.mesh import MeshGroups

    groups = MeshGroups(MeshLayout(world_size, context=2), "cpu", rank)  # data 2 × context 2: one flattened group
    reduction = groups.group(mesh_module.GRADIENT_REDUCTION)  # the whole world: the default group
    data = groups.group(("data",))
    context = groups.group(("context",))
    ones = torch.ones(1)
    dist.all_reduce(ones, group=data)
    members = torch.tensor([float(rank)])
    dist.all_reduce(members, group=context)
    flattened = groups.submesh(mesh_module.GRADIENT_REDUCTION)  # data × context flattened into one dimension
    everyone = torch.tensor([float(rank)])
    dist.all_reduce(everyone, group=flattened.get_group())
    return reduction is None, ones.item(), members.item(), groups.global_rank(("data",), 1), everyone.item()


def _flattened_groups(rank, world_size):
    from engine.distributed.mesh import MeshGroups

    layout = MeshLayout(world_size, tensor=2, context=2)  # data 1 × context 2 × tensor 2
    groups = MeshGroups(layout, "cpu", rank)
    same_batch = torch.tensor([float(rank)])
    dist.all_reduce(same_batch, group=groups.group(mesh_module.SAME_BATCH))  # the whole world
    reduction = torch.tensor([float(rank)])
    dist.all_reduce(reduction, group=groups.group(mesh_module.GRADIENT_REDUCTION))  # the context dimension (data 1)
    return same_batch.item(), reduction.item()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_mesh_groups_span_their_dimensions():
    # rank = data · 2 + context: rank 0's data group is {0, 2}, its context group {0, 1}
    assert run_distributed(_mesh_groups, world_size=4) == [
        (True, 2.0, 1.0, 2, 6.0), (True, 2.0, 1.0, 3, 6.0), (True, 2.0, 5.0, 2, 6.0), (True, 2.0, 5.0, 3, 6.0)]
    # rank = context · 2 + tensor: the gradients of rank 0 are reduced over {0, 2} (data is 1), the
    # same batch is every rank's
    assert run_distributed(_flattened_groups, world_size=4) == [(6.0, 2.0), (6.0, 4.0), (6.0, 2.0), (6.0, 4.0)]
