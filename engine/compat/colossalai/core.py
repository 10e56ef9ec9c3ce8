"""``from colossalai.core import global_context as gpc``: the legacy global context."""

from engine.compat.colossalai.context import gpc as global_context

__all__ = ["global_context"]
