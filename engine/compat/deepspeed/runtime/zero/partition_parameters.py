"""``from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus``: the objects of
``deepspeed.zero`` (engine/compat/deepspeed/zero.py) under DeepSpeed's other path."""

from engine.compat.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
