"""``from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled``
for a DeepSpeed script run by Microstep: the same questions answered, without the deepspeed and
accelerate packages.

A script keeps ``dschf = HfDeepSpeedConfig(ds_config)`` alive while it builds its model, and
asks ``is_deepspeed_zero3_enabled()`` (true while such an object with ZeRO stage 3 lives) and
``dschf.is_zero3()``, ``get_value("zero_optimization.stage")``, ... Unlike transformers' own
class, this one registers nothing with transformers: ``from_pretrained`` builds the whole model
as without DeepSpeed (it would otherwise build it inside ``deepspeed.zero.Init``, importing the
deepspeed package), and ``deepspeed.initialize`` shards it at ZeRO 3.
"""
from __future__ import annotations

import copy
import json
import weakref

__all__ = ["HfDeepSpeedConfig", "is_deepspeed_zero3_enabled", "deepspeed_config"]

_live: "weakref.ref[HfDeepSpeedConfig] | None" = None  # the newest HfDeepSpeedConfig, while it lives


class HfDeepSpeedConfig:
    """transformers' ``HfDeepSpeedConfig(config_file_or_dict)``: a DeepSpeed config (a dict, copied,
    or a JSON file's path) queried by dotted keys."""

    def __init__(self, config_file_or_dict):
        global _live
        if isinstance(config_file_or_dict, dict):
            self.config = copy.deepcopy(config_file_or_dict)
        elif isinstance(config_file_or_dict, str):
            with open(config_file_or_dict) as f:
                self.config = json.load(f)
        else:
            raise ValueError(f"HfDeepSpeedConfig: expected a dict or a JSON file's path, got "
                             f"{type(config_file_or_dict).__name__}")
        stage = self.get_value("zero_optimization.stage", -1)
        self._stage = stage
        self._offload = stage in (2, 3) and any(
            self.get_value(f"zero_optimization.{key}.device") in ("cpu", "nvme")
            for key in ("offload_optimizer", "offload_param"))
        _live = weakref.ref(self)

    def find_config_node(self, ds_key_long: str):
        """(the section holding the last part of the dotted key, that part), or (None, part)."""
        node = self.config
        *sections, key = ds_key_long.split(".")
        for section in sections:
            node = node.get(section)
            if not isinstance(node, dict):
                return None, key
        return node, key

    def get_value(self, ds_key_long: str, default=None):
        """The value at the dotted key (``"zero_optimization.stage"``), or ``default``."""
        node, key = self.find_config_node(ds_key_long)
        return default if node is None else node.get(key, default)

    def del_config_sub_tree(self, ds_key_long: str, must_exist: bool = False) -> None:
        node, key = self.find_config_node(ds_key_long)
        if node is None or key not in node:
            if must_exist:
                raise ValueError(f"HfDeepSpeedConfig: no {ds_key_long!r} in the config")
            return
        del node[key]

    def is_true(self, ds_key_long: str) -> bool:
        """Whether the key is set and true (False when absent)."""
        return bool(self.get_value(ds_key_long, False))

    def is_false(self, ds_key_long: str) -> bool:
        """Whether the key is set and false (False when absent)."""
        value = self.get_value(ds_key_long)
        return value is not None and not value

    def is_zero2(self) -> bool:
        return self._stage == 2

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        return self._offload


def is_deepspeed_zero3_enabled() -> bool:
    """True while an ``HfDeepSpeedConfig`` of ZeRO stage 3 lives (the newest one made)."""
    config = _current()
    return config is not None and config.is_zero3()


def _current() -> HfDeepSpeedConfig | None:
    return None if _live is None else _live()


def deepspeed_config() -> dict | None:
    """The newest living ``HfDeepSpeedConfig``'s dict, or None."""
    config = _current()
    return None if config is None else config.config
