"""``colossalai.nn``: the learning-rate schedules of the legacy examples (``lr_scheduler``)."""

from engine.compat.colossalai.nn import lr_scheduler

__all__ = ["lr_scheduler"]
