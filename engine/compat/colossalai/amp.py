"""``from colossalai.amp import AMP_TYPE``: the enum Colossal-AI configs and scripts name
(a config's ``fp16 = dict(mode=AMP_TYPE.TORCH)`` becomes Microstep's ``fp16`` section)."""

from engine.config.colossalai import AMP_TYPE

__all__ = ["AMP_TYPE"]
