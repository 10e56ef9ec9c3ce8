"""Hybrid sharding: ``zero_optimization.shard_size``, and DeepSpeed's spellings of it on the torch backend.

At ZeRO 2 / 3 the torch backend shards parameters, gradients and optimizer state (FSDP2) over the
data ranks. ``shard_size: N`` shards them within groups of N consecutive data ranks instead, the
groups holding replicas of each other (FSDP2's HSDP: ``engine.distributed.mesh``): each rank holds
1/N of the model, and the shard groups' collectives stay within N ranks (one node) while only an
all-reduce of the shards crosses them. Gradients are still averaged over every data rank.

| key | torch backend | DeepSpeed backend |
|---|---|---|
| ``zero_optimization.shard_size: N`` | hybrid sharding, N | refused: DeepSpeed spells it with its own keys |
| ``zero_optimization.mics_shard_size: N`` (MiCS; -1: off) | read as ``shard_size: N`` | DeepSpeed's MiCS |
| ``zero_optimization.zero_hpz_partition_size: N`` (ZeRO++ hpZ; 1: off) | read as ``shard_size: N`` | DeepSpeed's hpZ |

hpZ keeps DeepSpeed's primary shards over every rank and adds a secondary copy of the parameters
per group of N; read as ``shard_size`` the optimizer state is sharded within the group too (more
memory per rank than hpZ's, the same gather traffic). N must divide the data ranks (checked against
the world in ``engine.distributed.mesh.MeshLayout``).
"""
from __future__ import annotations

# DeepSpeed's keys read as shard_size on the torch backend, and the value that switches each off.
DEEPSPEED_SHARD_SIZE_KEYS = {"mics_shard_size": -1, "zero_hpz_partition_size": 1}


def _deepspeed_sizes(zero) -> dict[str, object]:
    """DeepSpeed's shard-size keys ``zero`` (a ``zero_optimization`` section) switches on, with their values."""
    extras = zero.model_extra or {}
    return {key: extras[key] for key, off in DEEPSPEED_SHARD_SIZE_KEYS.items() if key in extras and extras[key] != off}


def _valid(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def shard_size(config) -> int | None:
    """The shard group size the torch backend shards the data dimension by (None: all data ranks):
    ``shard_size``, else the DeepSpeed key that sets it (``shard_size_problems`` refuses conflicts)."""
    if config.backend != "torch":
        return None
    zero = config.zero_optimization
    if zero.shard_size is not None:
        return zero.shard_size
    sizes = [value for value in _deepspeed_sizes(zero).values() if _valid(value)]
    return sizes[0] if sizes else None


def shard_size_key(config) -> str:
    """The ``zero_optimization`` key the shard group size was written as: ``shard_size``, or the
    DeepSpeed key read as it (for messages naming what is in the user's file)."""
    zero = config.zero_optimization
    if zero.shard_size is not None:
        return "shard_size"
    return next((key for key, value in _deepspeed_sizes(zero).items() if _valid(value)), "shard_size")


def shard_size_problems(config) -> list[str]:
    """What is refused about the shard group size, as ``key: problem`` lines."""
    zero = config.zero_optimization
    deepspeed = _deepspeed_sizes(zero)
    if config.backend != "torch":
        if zero.shard_size is None:
            return []  # DeepSpeed reads its own keys
        return [f"zero_optimization.shard_size: {zero.shard_size} is the torch backend's hybrid sharding (FSDP2 over "
                "a replicate × shard mesh); DeepSpeed spells it zero_optimization.mics_shard_size (MiCS) or "
                "zero_hpz_partition_size (ZeRO++ hpZ): use one of those with backend: deepspeed, or set backend: torch"]
    problems = [f"zero_optimization.{key}: expected a positive number of data ranks per shard group, got {value!r} "
                f"(or {DEEPSPEED_SHARD_SIZE_KEYS[key]} for off)" for key, value in deepspeed.items() if not _valid(value)]
    given = {**({"shard_size": zero.shard_size} if zero.shard_size is not None else {}),
             **{key: value for key, value in deepspeed.items() if _valid(value)}}
    if len(set(given.values())) > 1:
        problems.append("zero_optimization.shard_size: " + " and ".join(f"{key}: {value}" for key, value in given.items())
                        + " conflict (on backend torch each sets the shard group size of hybrid sharding; keep one)")
    if given and zero.stage < 2:
        key, value = next(iter(given.items()))
        held = "a whole replica" if zero.stage == 0 else "whole parameters and gradients (stage 1 shards the optimizer only)"
        problems.append(f"zero_optimization.{key}: {value} shards parameters and gradients within groups of {value} "
                        f"data ranks, which ZeRO stages 2 and 3 do; at stage {zero.stage} every data rank holds {held}. "
                        f"Set zero_optimization.stage: 2 or 3, or remove {key}")
    return problems
