"""The mesh layout: which rank sits where, and errors that name the mesh."""

import pytest

import engine
from engine.distributed.mesh import MeshLayout


def test_tensor_innermost_then_data_then_pipeline():
    mesh = MeshLayout(8, tensor=2, pipeline=2)
    assert mesh.data == 2
    assert [mesh.coordinates(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert [mesh.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert mesh.describe() == "world 8 = pipeline 2 × data 2 × tensor 2"


def test_data_parallel_only_by_default():
    mesh = MeshLayout(4)
    assert mesh.is_data_parallel_only and mesh.data == 4
    assert [mesh.data_rank(r) for r in range(4)] == [0, 1, 2, 3]


def test_a_world_that_does_not_divide_names_the_sizes():
    with pytest.raises(engine.ConfigError, match=r"world of 6 rank\(s\) does not divide into pipeline 2 × context 1 × tensor 2 = 4"):
        MeshLayout(6, tensor=2, pipeline=2)
