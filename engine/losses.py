"""Losses written on a model's outputs: ``loss_fn(outputs, labels)`` for batches ``(inputs, labels)``.

The engine calls a loss as ``loss_fn(model, micro_batch)``; a pipeline calls it on the last
stage as ``loss_fn(outputs, labels)`` (the model is spread over several ranks there).
``@engine.loss_on_outputs`` turns the second kind into the first, so one script runs
unchanged with and without a pipeline::

    @engine.loss_on_outputs
    def loss_fn(outputs, labels):
        return F.cross_entropy(outputs, labels)      # a mean, or (sum, count)

    eng.train_batch((inputs, labels), loss_fn)        # pipeline.stages: 1, 2, 4, ...
"""

from __future__ import annotations

from typing import Any, Callable


class OutputsLoss:
    """``fn(outputs, labels)`` as the engine's ``loss_fn(model, (inputs, labels))``: the model is
    called with ``inputs`` (a tuple: several arguments). A pipeline calls ``on_outputs``."""

    def __init__(self, fn: Callable[[Any, Any], Any]):
        if not callable(fn):
            raise TypeError(f"loss_on_outputs needs a function fn(outputs, labels); got {type(fn).__name__}")
        self.on_outputs = fn

    def __call__(self, model, micro_batch):
        inputs, labels = micro_batch
        outputs = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        return self.on_outputs(outputs, labels)


def loss_on_outputs(fn: Callable[[Any, Any], Any]) -> OutputsLoss:
    """Decorate ``fn(outputs, labels)`` so that it trains with or without a pipeline."""
    return OutputsLoss(fn)


def outputs_loss_of(loss_fn) -> Callable[[Any, Any], Any]:
    """What a pipeline's last stage calls: the function under ``@loss_on_outputs``, or
    ``loss_fn`` itself (under a pipeline a plain function takes ``(outputs, labels)``)."""
    return getattr(loss_fn, "on_outputs", loss_fn)
