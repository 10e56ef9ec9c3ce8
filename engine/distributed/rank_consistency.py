"""Every rank must train with the same config: check it once, at initialize, right after the
default process group is joined and before any other group is built.

A mismatch (a different ``--set`` on one node, an edited file on another) would otherwise
hang in a collective or silently diverge; one that shapes the mesh (a stage, a shard size, a
parallel size or method, the backend) would hang while the ranks build different groups. Ranks
exchange a hash; only when hashes differ do they exchange the settings themselves, so every rank
raises the same error naming each key that differs (as written: DeepSpeed's ``mics_shard_size``
under its own name) with each rank's value. The batch plan needs no check of its own: it is a
function of the config and the world size.
"""

from __future__ import annotations

import hashlib
import json

import torch.distributed as dist

from engine.errors import ConfigError
from engine.distributed.process_group import control_group


def _flatten(tree, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def settings(config) -> dict[str, object]:
    """What must agree across ranks: the config, minus the user's own constants."""
    values = config.to_dict()
    values.pop("constants", None)
    return _flatten(values)


def check_same_settings(config) -> None:
    """Raise ConfigError on every rank when ranks disagree on their settings."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = settings(config)
    encoded = json.dumps(mine, sort_keys=True, default=repr)
    digest = hashlib.sha256(encoded.encode()).hexdigest()
    group = control_group()
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest, group=group)
    if len(set(digests)) == 1:
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    problems = []
    for rank, theirs in enumerate(everyone[1:], start=1):
        for key in sorted(set(reference) | set(theirs)):
            if reference.get(key) != theirs.get(key):
                problems.append(f"{key}: rank 0 has {reference.get(key)!r}, rank {rank} has {theirs.get(key)!r}")
    raise ConfigError(["ranks disagree on their settings (every rank must load the same config "
                       "and --set overrides):"] + problems[:20] + (["..."] if len(problems) > 20 else []))
