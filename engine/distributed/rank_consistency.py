"""Every rank must train with the same config and plan: check it once, at initialize.

A mismatch (a different ``--set`` on one node, an edited file on another) would otherwise
hang in a collective or silently diverge. Ranks exchange a hash; only when hashes differ
do they exchange the settings themselves, so every rank raises the same error naming the
keys that differ.
"""

from __future__ import annotations

import dataclasses
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


def settings(config, plan) -> dict[str, object]:
    """What must agree across ranks: the config (minus the user's own constants) and the plan."""
    values = config.to_dict()
    values.pop("constants", None)
    shared_plan = dataclasses.asdict(plan.for_rank(0))
    shared_plan.pop("notes", None)
    return _flatten({"config": values, "plan": shared_plan})


def check_same_settings(config, plan) -> None:
    """Raise ConfigError on every rank when ranks disagree on their settings."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = settings(config, plan)
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
