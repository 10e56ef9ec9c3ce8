"""``deepspeed.moe``: what scripts import from it without training mixture-of-experts layers
(``deepspeed.moe.utils``). DeepSpeed's ``MoE`` layer itself is not provided: docs/migrating.md."""

from engine.compat.deepspeed.moe import utils

__all__ = ["utils"]
