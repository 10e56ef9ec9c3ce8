"""``deepspeed.zero``: ``GatheredParameters``, ``Init`` and ``ZeroParamStatus`` as DeepSpeed's scripts use them.

ZeRO-3 on the torch backend holds each parameter as an FSDP2 shard (a ``DTensor``). Such a
parameter carries DeepSpeed's marks of a partitioned one, so scripts that test for them take
their ZeRO-3 branch: ``ds_id``, ``ds_shape`` / ``ds_numel`` (the whole parameter's),
``ds_status`` (``ZeroParamStatus.NOT_AVAILABLE``, ``AVAILABLE`` inside a block gathering it).

``GatheredParameters(params, modifier_rank=None, enabled=True)`` gathers exactly the sharded
parameters it is given, each whole on every rank for the block: every torch operation on
such a parameter inside the block (``p.data``, ``p.data.cpu()``, ``p.copy_(x)``,
``module.state_dict()``, ...) sees the whole plain tensor, as the same object does inside
DeepSpeed's block. With ``modifier_rank``, that rank's whole values at the end of the block are
every rank's, each rank keeping its own shard of them. Given every parameter of an engine's model,
the engine gathers the model at once (``engine.Engine.gathered_parameters``): its module then
holds whole parameters too, which the sharded objects given stand for. Parameters that are whole
already (ZeRO 0-2 between windows) need no gathering; with ``modifier_rank`` the engine holding
them writes that rank's values into its shards and replicas. Enter the block on every rank, with
the same parameters in the same order, as in DeepSpeed.

``Init()`` is accepted and builds the model whole: Microstep shards it in ``initialize``
(the peak while building is the whole model, not a shard of it).
"""
from __future__ import annotations

import contextlib
import enum
import itertools
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register"]

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()
_NEXT_ID = itertools.count()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's states of a partitioned parameter (``p.ds_status``)."""

    AVAILABLE = 1  # whole on this rank (inside a gathering block)
    NOT_AVAILABLE = 2  # this rank holds its shard only
    INFLIGHT = 3  # being gathered (DeepSpeed's prefetch; never set here)

    def __eq__(self, other):
        # DeepSpeed's own enum (backend: deepspeed marks the parameters with it) compares by name
        if isinstance(other, enum.Enum) and type(other).__name__ == "ZeroParamStatus":
            return self.name == other.name
        return NotImplemented

    __hash__ = enum.Enum.__hash__


def register(eng) -> None:
    """Make ``eng`` (an ``engine.Engine``) findable by ``GatheredParameters`` and mark its
    sharded parameters as DeepSpeed marks partitioned ones."""
    _ENGINES.add(eng)
    for param in eng.module.parameters():
        if isinstance(param, DTensor) and not hasattr(param, "ds_id"):
            param.ds_id = next(_NEXT_ID)
            param.ds_shape = param.shape  # a DTensor's shape is the whole parameter's
            param.ds_numel = param.numel()
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _owner(params):
    """The registered engine whose module holds any of ``params``, or None."""
    wanted = {id(p) for p in params}
    for eng in list(_ENGINES):
        if any(id(p) in wanted for p in eng.module.parameters()):
            return eng
    return None


class _WholeParameters(TorchFunctionMode):
    """For the block: each torch operation on one of the sharded parameters runs on its whole value
    (a plain tensor), so the parameter object reads and writes as a whole one. Other tensors pass
    through untouched."""

    def __init__(self, whole: dict):
        super().__init__()
        self.whole = whole  # id(param) -> (param, its whole value)

    @classmethod
    def gathered(cls, params: list[DTensor]) -> _WholeParameters:
        """Each of ``params`` gathered alone (one collective each, in order, on every rank)."""
        return cls({id(p): (p, p.full_tensor().detach().requires_grad_(p.requires_grad)) for p in params})

    @property
    def params(self) -> list[DTensor]:
        return [param for param, _ in self.whole.values()]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__hash__:  # the parameter stays the same key (optimizer state, sets)
            return func(*args, **(kwargs or {}))
        return func(*self._swap(args), **self._swap(kwargs or {}))

    def _swap(self, value):
        if isinstance(value, torch.Tensor):
            entry = self.whole.get(id(value))
            return entry[1] if entry is not None and entry[0] is value else value
        if type(value) in (list, tuple):
            return type(value)(self._swap(item) for item in value)
        if type(value) is dict:
            return {key: self._swap(item) for key, item in value.items()}
        return value

    def write_back(self, modifier_rank: int) -> None:
        """``modifier_rank``'s whole values into every rank's shards."""
        with torch.no_grad():
            for param, value in self.whole.values():
                value = value.detach().to(param.dtype).contiguous()
                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.broadcast(value, src=modifier_rank)
                # Each rank's piece by the parameter's own placements, cut locally (no collective)
                piece = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(piece.to_local())


def _set_status(params, status: ZeroParamStatus) -> None:
    for param in params:
        if hasattr(param, "ds_status"):
            param.ds_status = status


def _covers_model(eng, sharded: list[DTensor]) -> bool:
    """Whether ``sharded`` holds every sharded parameter of ``eng``'s module (a whole-model gather)."""
    given = {id(p) for p in sharded}
    return all(id(p) in given for p in eng.module.parameters() if isinstance(p, DTensor))


class GatheredParameters(contextlib.AbstractContextManager):
    """DeepSpeed's ``zero.GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)``."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [] if params is None else list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._mode = None
        self._context = None

    def __enter__(self):
        if not self.enabled or not self.params:
            return self
        sharded = [p for p in self.params if isinstance(p, DTensor)]
        whole = [p for p in self.params if not isinstance(p, DTensor)]
        eng = _owner(self.params)
        if eng is not None and (whole or _covers_model(eng, sharded)):
            # The engine's own gather of the whole model (one pass over its units); it writes a modifier's
            # values into its shards / replicas. The sharded objects given stand for the gathered ones.
            names = {id(p): name for name, p in eng.module.named_parameters()}
            self._context = eng.gathered_parameters(self.modifier_rank)
            self._context.__enter__()
            if sharded:
                gathered = dict(eng.module.named_parameters())
                self._mode = _WholeParameters({id(p): (p, gathered[names[id(p)]]) for p in sharded})
        elif sharded:  # exactly these, one by one
            self._mode = _WholeParameters.gathered(sharded)
        if self._mode is not None:
            _set_status(sharded, ZeroParamStatus.AVAILABLE)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc_info):
        mode, self._mode = self._mode, None
        context, self._context = self._context, None
        if mode is not None:
            mode.__exit__(*exc_info)
            _set_status(mode.params, ZeroParamStatus.NOT_AVAILABLE)
            if context is None and self.modifier_rank is not None and exc_info[0] is None:
                mode.write_back(self.modifier_rank)
        if context is not None:
            return context.__exit__(*exc_info)
        return None


class Init(contextlib.AbstractContextManager):
    """DeepSpeed's ``zero.Init(...)``: the model is built whole and sharded by ``initialize``."""

    def __init__(self, *args, enabled: bool = True, **kwargs):
        self.enabled = enabled

    def __exit__(self, *exc_info):
        return None
