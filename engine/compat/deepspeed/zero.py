"""``deepspeed.zero``: ``GatheredParameters`` and ``Init`` as DeepSpeed's scripts use them.

``GatheredParameters(params, modifier_rank=None)`` gathers the whole model of the engine whose
module holds ``params`` (``deepspeed.initialize`` registers every engine it builds): inside
the block ``model_engine.module``'s parameters are whole on every rank, at ZeRO-3 too, so a
script can read or export them; with ``modifier_rank`` that rank's values at the end of the
block are written back into every rank's shards (initialising a layer after
``initialize``). Parameters of no engine (a plain model) are whole already: nothing to do,
as in DeepSpeed. Enter it on every rank.

``Init()`` is accepted and builds the model whole: Microstep shards it in ``initialize``
(the peak while building is the whole model, not a shard of it).
"""
from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["GatheredParameters", "Init", "register"]

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def register(eng) -> None:
    """Make ``eng`` (an ``engine.Engine``) findable by ``GatheredParameters``."""
    _ENGINES.add(eng)


def _owner(params):
    """The registered engine whose module holds any of ``params``, or None."""
    wanted = {id(p) for p in params}
    for eng in list(_ENGINES):
        if any(id(p) in wanted for p in eng.module.parameters()):
            return eng
    return None


class GatheredParameters(contextlib.AbstractContextManager):
    """DeepSpeed's ``zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)``."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [] if params is None else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._context = None

    def __enter__(self):
        eng = _owner(self.params) if self.enabled else None
        if eng is not None:
            self._context = eng.gathered_parameters(self.modifier_rank)
            self._context.__enter__()
        return self

    def __exit__(self, *exc_info):
        context, self._context = self._context, None
        if context is not None:
            return context.__exit__(*exc_info)
        return None


class Init(contextlib.AbstractContextManager):
    """DeepSpeed's ``zero.Init(...)``: the model is built whole and sharded by ``initialize``."""

    def __init__(self, *args, enabled: bool = True, **kwargs):
        self.enabled = enabled

    def __exit__(self, *exc_info):
        return None
