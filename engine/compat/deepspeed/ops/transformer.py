"""``deepspeed.ops.transformer`` (``DeepSpeedTransformerLayer``, ...): not provided; every name says what to use."""
from engine.compat.deepspeed.not_provided import refusing_getattr

__getattr__ = refusing_getattr("deepspeed.ops.transformer")
