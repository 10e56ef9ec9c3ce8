"""``deepspeed.ops``: ``adam`` (``FusedAdam``, ``DeepSpeedCPUAdam`` as torch's Adam); DeepSpeed's
kernels (``lamb``, ``sparse_attention``, ``transformer``) are not provided: each name says what to use."""

from engine.compat.deepspeed.ops import adam, lamb, sparse_attention, transformer

__all__ = ["adam", "lamb", "sparse_attention", "transformer"]
