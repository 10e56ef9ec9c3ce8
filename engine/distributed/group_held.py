"""Parameters held apart: split between the ranks of a subgroup of the gradient-reduction group,
each rank holding one slice, and reduced over the ranks holding the same slice (their replicas).

The holders (``engine.strategies``) keep such parameters out of their data sharding or DDP,
reduce their gradients through :meth:`GroupHeldParameters.reduce_gradients_` at the boundary,
count each slice once in the gradient norm (:meth:`GroupHeldParameters.slices`), gather them
whole for a full state dict, and store them resharded in a checkpoint. They ask nothing else and
never which parallelism split them (``engine.strategies.parallelize`` builds the object); a model
with nothing held apart has :class:`NoGroupHeldParameters` (``NO_GROUP_HELD``), which answers
"none" to every question.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class HeldParameter:
    """One parameter held apart, as this rank holds it."""

    name: str  # in the model it was split from
    param: torch.nn.Parameter  # this rank's slice: dim 0 is ``full_shape[0] / size``
    full_shape: torch.Size


class GroupHeldParameters(ABC):
    """The parameters a model holds apart, and what the holders do with them."""

    # Whether a forward exchanges activations over the group (every forward is then collective)
    exchanges_in_forward = False
    # Into how many slices the group cuts each of them
    size = 1

    def __init__(self):
        self.parameters: list[HeldParameter] = []
        self._by_name: dict[str, HeldParameter] = {}  # the same, by name (checkpoints look them up per key)
        self._held: set[int] = set()  # ids of their parameters

    def hold(self, entry: HeldParameter) -> None:
        """Register ``entry``'s parameter as held apart."""
        self.parameters.append(entry)
        self._by_name[entry.name] = entry
        self._held.add(id(entry.param))

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is held apart."""
        return id(param) in self._held

    @property
    def holds_any(self) -> bool:
        return bool(self.parameters)

    def names(self) -> list[str]:
        return [entry.name for entry in self.parameters]

    def entry(self, name: str) -> HeldParameter | None:
        return self._by_name.get(name)

    def slices(self, param: torch.Tensor) -> int:
        """For the gradient norm: into how many slices the ranks cut ``param`` (1: not held apart)."""
        return self.size if self.holds(param) else 1

    @abstractmethod
    def reduce_gradients_(self, bucket_bytes: int | None = None) -> None:
        """At the boundary: the gradients held apart reduced as the dense ones are (their average
        over the gradient-reduction group, of the whole batch)."""

    @abstractmethod
    def whole(self, state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
        """``state`` with every tensor held apart (``prefix`` + its name) gathered whole (collective)."""

    @abstractmethod
    def placed(self, tensor: torch.Tensor, entry: HeldParameter) -> torch.Tensor:
        """This rank's slice of a tensor shaped like ``entry``'s parameter as a checkpoint stores it,
        so that it loads onto another split (a DTensor)."""


class NoGroupHeldParameters(GroupHeldParameters):
    """Nothing held apart: no parameter, nothing to reduce or gather."""

    def reduce_gradients_(self, bucket_bytes=None):
        pass

    def whole(self, state, prefix=""):
        return state

    def placed(self, tensor, entry):
        raise LookupError(f"{entry.name} is not held apart")


NO_GROUP_HELD = NoGroupHeldParameters()  # never registers anything: shared by every holder
