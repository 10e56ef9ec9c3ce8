"""What a window whose gradient was not applied does (``faults.non_finite_gradient``): a
non-finite gradient raises ``NonFiniteGradientError`` (``raise``) or is skipped with a warning
(``skip``); an fp16 overflow the loss scaler explains is always skipped with a warning."""

from __future__ import annotations

import logging

from engine.errors import NonFiniteGradientError

log = logging.getLogger("engine")


def raises(policy: str, non_finite: bool) -> bool:
    """Whether a window with this verdict raises (after the engine discarded it)."""
    return non_finite and policy == "raise"


def non_finite_error(step: int) -> NonFiniteGradientError:
    return NonFiniteGradientError(
        f"the gradient of global step {step} holds an inf or nan (e.g. a nan or inf loss, or an "
        "overflow in the forward): the window was not applied — weights, optimizer and scheduler are "
        "as before it, and no checkpoint was written. faults.non_finite_gradient: skip discards such "
        "windows with a warning instead (counted in skipped_steps)")


def warn_skipped(applied: bool, non_finite: bool, step: int) -> None:
    """The warning of a window discarded without raising."""
    if non_finite:
        log.warning("a non-finite gradient (inf or nan) in the window of global step %d: the window is "
                    "discarded, the weights are unchanged (skipped_steps counts it)", step)
    elif not applied:
        log.warning("fp16 overflow: the window of global step %d is discarded and the loss scale "
                    "lowered", step)
