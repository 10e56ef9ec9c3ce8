"""``deepspeed.compression``: the ``helper`` functions scripts import (DeepSpeed-Chat's LoRA);
DeepSpeed's compression training itself is not provided."""

from engine.compat.deepspeed.compression import helper

__all__ = ["helper"]
