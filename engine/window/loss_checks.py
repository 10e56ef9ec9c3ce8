"""What a ``loss_fn`` must look like, checked where the engine first meets it, so that a
mistake is named with its fix instead of failing deep inside the engine or inside torch.

Two calls exist (``engine.losses``): without a pipeline ``loss_fn(model, micro_batch)``; on a
pipeline's last stage ``loss_fn(outputs, labels)`` (no stage holds the whole model). A plain
function written for the other call is recognised by its first parameter's name, on every rank
alike before anything runs (a pipeline's other stages never call it, so only a check that
needs no call says the same thing everywhere). ``@engine.loss_on_outputs`` serves both.

A loss returns a scalar tensor (the mean over the micro-batch), a pair ``(loss_sum,
num_items)``, or a Hugging Face output with a ``loss``; a pair whose second element is not a
count (e.g. ``(loss, logits)``) is refused with what was returned.
"""

from __future__ import annotations

import functools
import inspect

import torch

from engine.errors import EngineUsageError

# First parameters that say which call a plain function was written for.
MODEL_NAMES = frozenset({"model", "module", "engine", "eng", "net", "network", "m"})
OUTPUT_NAMES = frozenset({"outputs", "output", "out", "logits", "preds", "pred", "predictions", "prediction",
                          "y_pred", "y_hat", "yhat", "input"})  # `input`: torch's own losses, F.* and nn.*Loss

ON_OUTPUTS_FIX = ("write it on the outputs and decorate it with @engine.loss_on_outputs, which serves both calls:\n"
                  "    @engine.loss_on_outputs\n"
                  "    def loss_fn(outputs, labels):\n"
                  "        return F.cross_entropy(outputs, labels)   # a mean, or (loss_sum, num_items)\n"
                  "and give batches (inputs, labels)")


def _parameters(loss_fn) -> list[inspect.Parameter] | None:
    """``loss_fn``'s parameters as a call sees them (a module's: its forward's), None when
    Python cannot tell (some builtins)."""
    target = loss_fn.forward if isinstance(loss_fn, torch.nn.Module) else loss_fn
    try:
        return list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None


def _written(parameters: list[inspect.Parameter]) -> str:
    return "(" + ", ".join(p.name for p in parameters) + ")"


def check_loss_signature(loss_fn, on_outputs: bool) -> None:
    """Refuse a ``loss_fn`` written for the other call, or one that cannot take two arguments
    (``on_outputs``: a pipeline calls ``loss_fn(outputs, labels)``). Once per function."""
    try:
        hash(loss_fn)
    except TypeError:  # an unhashable callable: checked at every call
        _check_signature(loss_fn, on_outputs)
    else:
        _check_signature_once(loss_fn, on_outputs)


def _check_signature(loss_fn, on_outputs: bool) -> None:
    if hasattr(loss_fn, "on_outputs"):  # @engine.loss_on_outputs: right under both calls
        return
    parameters = _parameters(loss_fn)
    if parameters is None:
        return
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_more = any(p.kind == p.VAR_POSITIONAL for p in parameters)
    required = [p for p in positional if p.default is p.empty]
    call = "loss_fn(outputs, labels)" if on_outputs else "loss_fn(model, micro_batch)"
    if len(required) > 2 or (len(positional) < 2 and not takes_more):
        raise EngineUsageError(f"loss_fn: the engine calls {call} (two arguments); yours takes "
                               f"{_written(parameters)}")
    first = positional[0].name.lower() if positional else ""
    if not on_outputs and first in OUTPUT_NAMES:
        raise EngineUsageError(
            f"loss_fn: without a pipeline the engine calls loss_fn(model, micro_batch); yours takes "
            f"{_written(parameters)}, a model's outputs. Decorate it with @engine.loss_on_outputs (the engine then "
            f"calls the model on each micro-batch's inputs and your function on (outputs, labels), for batches "
            f"(inputs, labels)), or write loss_fn(model, micro_batch)")


_check_signature_once = functools.lru_cache(maxsize=32)(_check_signature)


def written_for_model(loss_fn) -> bool:
    """Whether ``loss_fn`` was written as ``loss_fn(model, micro_batch)`` (its first parameter names a
    model; not ``@engine.loss_on_outputs``)."""
    if hasattr(loss_fn, "on_outputs"):
        return False
    parameters = _parameters(loss_fn)
    positional = [p for p in parameters or () if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return bool(positional) and positional[0].name.lower() in MODEL_NAMES


def model_call_refused(loss_fn) -> EngineUsageError:
    """The error of a ``loss_fn(model, micro_batch)`` under a pipeline with batches ``(inputs, labels)``."""
    return EngineUsageError(
        f"loss_fn: under a pipeline the last stage calls loss_fn(outputs, labels), with the model's outputs (the "
        f"model is spread over the stages: none can call it); yours takes {_written(_parameters(loss_fn) or [])}. "
        "Give a mapping batch with 'input_ids' and 'labels' and the last stage applies a Hugging Face causal "
        f"language model's own loss (m(**batch).loss); or, to train with and without a pipeline, {ON_OUTPUTS_FIX}")


def check_loss(loss) -> None:
    """A loss to back-propagate: a scalar tensor that requires grad."""
    check_scalar_loss(loss)
    if not loss.requires_grad:
        raise EngineUsageError(
            "the loss does not require grad: it was computed without the model's parameters, or "
            "under torch.no_grad()"
        )


def check_scalar_loss(loss) -> None:
    """A loss to add up (an evaluation's too): a scalar tensor."""
    if not isinstance(loss, torch.Tensor):
        raise EngineUsageError(f"the loss must be a tensor; got {type(loss).__name__}")
    if loss.dim() != 0:
        raise EngineUsageError(
            f"the loss must be a scalar (0-dim) tensor, the mean over the micro-batch; got shape "
            f"{tuple(loss.shape)} — reduce it with .mean() (or return (loss.sum(), count))"
        )


def failed_on_another_rank(what: str) -> EngineUsageError:
    """The error of the ranks whose peer's ``loss_fn`` failed in ``what`` (a window, an evaluation)
    that every rank ran to its end (a pipeline's last stage computes the losses)."""
    return EngineUsageError(f"loss_fn(outputs, labels) failed on another rank, which raises its error itself; "
                            f"this {what} is abandoned on every rank")
