"""``deepspeed.runtime.data_pipeline``: not provided; every name says what to use."""
from engine.compat.deepspeed.not_provided import refusing_getattr

__getattr__ = refusing_getattr("deepspeed.runtime.data_pipeline")
