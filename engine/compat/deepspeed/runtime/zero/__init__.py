"""``deepspeed.runtime.zero``: ``partition_parameters`` (``ZeroParamStatus``, ``GatheredParameters``,
``Init``) as scripts reach it; the same objects as ``deepspeed.zero``'s."""

from engine.compat.deepspeed.runtime.zero import partition_parameters
from engine.compat.deepspeed.zero import GatheredParameters, Init, ZeroParamStatus

__all__ = ["partition_parameters", "GatheredParameters", "Init", "ZeroParamStatus"]
