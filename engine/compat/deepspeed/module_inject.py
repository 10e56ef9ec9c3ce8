"""``deepspeed.module_inject`` (``replace_transformer_layer``, ...): not provided; every name says what to use."""
from engine.compat.deepspeed.not_provided import refusing_getattr

__getattr__ = refusing_getattr("deepspeed.module_inject")
