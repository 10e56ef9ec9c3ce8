"""``deepspeed.moe``: what scripts import from it without training mixture-of-experts layers
(``deepspeed.moe.utils``). DeepSpeed's ``MoE`` layer (``deepspeed.moe.layer``) is not provided:
its names say what to use (docs/migrating.md)."""

from engine.compat.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
