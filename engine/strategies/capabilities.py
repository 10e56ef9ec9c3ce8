"""What a holder does inside an accumulation window, as one record the layers above ask once.

The window machine plans its position checks around a holder's collectives, the accounting
counts the loss copies its statistics see, the experts' runner asks whether a window's forwards
may all run before its backwards, the tuner flips the activation-checkpointing switch and the
monitor asks whether the model it measures is whole. Each holder answers all of it in one
:class:`WindowCapabilities` (``Strategy.capabilities()``), built from its state after ``setup``.

Two answers change while the run goes on and are therefore calls, read where they are needed:
whether a window communicates before its closing backward (DDP rebuilds its buckets in the
forward after its first synced backward; FSDP's ZeRO-2 stops communicating early once it defers
its reduction, a decision ``defer_reduction: auto`` revisits after every window) and whether a
forward gathers (ZeRO-3 does not while its window defers). Every other answer is fixed by then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.strategies.model_transforms import CheckpointSwitch


def fixed(answer: bool) -> Callable[[], bool]:
    """A question whose answer does not change over the run, asked as the changing ones are."""
    return lambda: answer


@dataclass(frozen=True)
class WindowCapabilities:
    """How a holder's collectives fall in a window, and what it lets the layers above do."""

    # Whether a window may issue collectives before the backward that closes it (a reduction in
    # every backward, a gather in a forward, DDP's buffer broadcast or bucket rebuild): the ranks
    # then compare their positions at the window's start too, not only before that backward. Asked
    # at each window's start.
    communicates_before_closing_backward: Callable[[], bool]
    # Whether a forward issues collectives (parameters gathered, parameters held apart exchanged):
    # the ranks then compare positions before every training forward, not only a window's first.
    # Asked before each forward after a window's first micro-step has been prepared.
    forward_communicates: Callable[[], bool]
    # Whether gradients are reduced (or shards gathered) over several ranks (data × context beyond
    # one rank); otherwise a window's closing backward pairs no collective of its own.
    reduces_gradients_over_ranks: bool
    # Whether the window-statistics reduction sums over every rank (no pipeline or tensor dimension):
    # the gradient's squared-norm share then travels in it.
    statistics_span_world: bool
    # Whether every forward of a window may run before its backwards (``Strategy.hold_forwards``):
    # one process, or a holder that reduces after the window anyway.
    can_hold_forwards: bool
    # How many of the ranks holding one replica's window statistics this rank's loss records stand for
    # in their reduction: 1 where each computes the loss, under a pipeline every stage on the last
    # stage and none elsewhere.
    loss_copies: int = 1
    # Whether the holder's ``module`` holds every layer of the model (a pipeline stage holds some).
    holds_every_layer: bool = True
    # ``activation_checkpointing: auto``: the switch of the model's checkpointed blocks, which the
    # micro-size tuner flips between windows; None otherwise.
    checkpoint_switch: CheckpointSwitch | None = None
