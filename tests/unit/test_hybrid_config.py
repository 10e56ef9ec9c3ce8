"""Hybrid sharding's config: ``zero_optimization.shard_size`` and DeepSpeed's spellings of it, resolved
into the mesh once, and every refusal stating the equation or the reason with the fix."""
import warnings

import pytest

from engine.config.checks import check_without_model
from engine.config.deepspeed import deepspeed_config
from engine.config.schema import ConfigError, load_config
from engine.config.setup import mesh_layout


def config(backend="torch", stage=3, **zero):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_config({"backend": backend, "train_batch_size": 16,
                              "zero_optimization": {"stage": stage, **zero}})
    return loaded, [str(w.message) for w in caught]


@pytest.mark.parametrize("zero", [{"shard_size": 2}, {"mics_shard_size": 2}, {"zero_hpz_partition_size": 2},
                                  {"shard_size": 2, "mics_shard_size": 2}])
def test_shard_size_and_deepspeeds_keys_split_the_data_dimension(zero):
    loaded, warned = config(**zero)
    assert not any("not used by the torch backend" in w for w in warned), warned
    assert check_without_model(loaded) == []
    mesh = mesh_layout(loaded, 8)
    assert (mesh.data_replicate, mesh.data_shard, mesh.hybrid) == (4, 2, True)
    assert mesh.describe() == "world 8 = pipeline 1 × data 8 × context 1 × tensor 1 (data = replicate 4 × shard 2)"


@pytest.mark.parametrize("zero", [{}, {"mics_shard_size": -1}, {"zero_hpz_partition_size": 1}])
def test_by_default_one_shard_group_holds_every_data_rank(zero):
    mesh = mesh_layout(config(**zero)[0], 8)
    assert (mesh.data_replicate, mesh.data_shard, mesh.hybrid) == (1, 8, False)


def test_a_size_that_does_not_divide_the_data_ranks_states_the_equation():
    with pytest.raises(ConfigError, match=r"zero_optimization.shard_size 4 does not divide the 6 data rank\(s\) "
                                          r"\(world 6 = .*\): data = replicate × shard needs 6 / 4 = 1.5 whole "
                                          r"replicas; use one of \[1, 2, 3, 6\]"):
        mesh_layout(config(shard_size=4)[0], 6)


@pytest.mark.parametrize("stage", [0, 1])
def test_stages_that_do_not_shard_parameters_refuse_it(stage):
    loaded, _ = config(stage=stage, shard_size=2)
    held = "a whole replica" if stage == 0 else "whole parameters and gradients"
    assert check_without_model(loaded) == [
        f"<dict>: zero_optimization.shard_size: 2 shards parameters and gradients within groups of 2 data ranks, "
        f"which ZeRO stages 2 and 3 do; at stage {stage} every data rank holds {held}"
        + ("" if stage == 0 else " (stage 1 shards the optimizer only)")
        + ". Set zero_optimization.stage: 2 or 3, or remove shard_size"]
    loaded, _ = config(stage=stage, mics_shard_size=2)
    assert "remove mics_shard_size" in check_without_model(loaded)[0]


def test_different_spellings_with_different_sizes_conflict():
    loaded, _ = config(shard_size=2, zero_hpz_partition_size=4)
    assert check_without_model(loaded) == [
        "<dict>: zero_optimization.shard_size: shard_size: 2 and zero_hpz_partition_size: 4 conflict (on backend "
        "torch each sets the shard group size of hybrid sharding; keep one)"]


def test_a_deepspeed_size_that_is_not_a_count_is_named():
    loaded, _ = config(mics_shard_size="two")
    assert check_without_model(loaded) == [
        "<dict>: zero_optimization.mics_shard_size: expected a positive number of data ranks per shard group, got "
        "'two' (or -1 for off)"]


def test_the_deepspeed_backend_refuses_our_key_and_keeps_its_own():
    loaded, _ = config(backend="deepspeed", shard_size=2)
    assert any("zero_optimization.shard_size: 2 is the torch backend's hybrid sharding" in p and
               "use one of those with backend: deepspeed, or set backend: torch" in p
               for p in check_without_model(loaded))
    loaded, _ = config(backend="deepspeed", mics_shard_size=2)
    assert not any("shard" in p for p in check_without_model(loaded))
    assert mesh_layout(loaded, 8).data_shard == 8  # DeepSpeed's MiCS does it, not the mesh
    zero = deepspeed_config(loaded, 8)["zero_optimization"]
    assert zero["mics_shard_size"] == 2 and "shard_size" not in zero


def test_zero_for_a_size_is_a_type_error():
    with pytest.raises(ConfigError, match=r"zero_optimization.shard_size: must be > 0, got 0"):
        config(shard_size=0)


def test_shard_groups_are_consecutive_data_ranks_and_replicas_stride_them():
    from engine.distributed.mesh import DATA_REPLICAS, DATA_SHARDING, GRADIENT_REDUCTION, MeshLayout

    mesh = MeshLayout(16, context=2, data_sharded=True, shard_size=2)  # data 8 = replicate 4 × shard 2
    # rank 5 = data 2, context 1: shard group = data 2, 3 × both context ranks
    assert mesh.group_ranks(DATA_SHARDING, 5) == [4, 5, 6, 7]
    assert mesh.group_ranks(DATA_REPLICAS, 5) == [1, 5, 9, 13]
    assert mesh.group_ranks(GRADIENT_REDUCTION, 5) == list(range(16))  # gradients still averaged over all
    assert mesh.size(DATA_SHARDING) * mesh.size(DATA_REPLICAS) == mesh.size(GRADIENT_REDUCTION)
    assert mesh.device_dims == ("pipeline", "data_replicate", "data_shard", "context", "tensor")
