"""What a held forward keeps until its window's backwards: its loss, and the head's input in place of
the head's and loss's saved activations.

Holding a window's forwards (``moe.global_counts: hold_forwards``) keeps every micro-batch's saved
activations until the window's counts are known. Activation checkpointing reduces a block to its
input; what follows the last block does not shrink: a Hugging Face causal language model's
``lm_head`` saves its input, its cross entropy the log-probabilities — one number per token and
vocabulary entry, the largest tensor a checkpointed forward saves (Mixtral in ``bench/moe.py``:
514 KiB of the 1.4 MiB a micro-batch saves; four held, four times) — and the model's output holds
the logits, as large again.

:class:`HeldForward` runs the model's ``loss_function(logits, labels, ...)`` on ``lm_head(x)``
inside one ``torch.utils.checkpoint`` region that starts at the head's input ``x``: the forward
saves ``x`` only, the backward recomputes the head and the loss. The logits the model returns keep
their own graph (a loss the caller builds from ``.logits`` still reaches the head; one more head
product per forward pays for it), and of an output with a ``.loss`` only that loss is kept for the
backward (``kept``): its logits and router logits are freed unless the caller keeps them. The
values are the same operations on the same numbers, so the gradients are bitwise those of the
plain forward. The
region applies where the model hands its loss function the head's output itself; a model that
changes the logits first (a soft cap), or that has no output head with a ``loss_function``, runs
as written.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.utils.checkpoint


def _head_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost Hugging Face model in ``model`` with an output head and a loss function."""
    for module in model.modules():
        if hasattr(type(module), "loss_function") and hasattr(module, "get_output_embeddings") \
                and isinstance(module.get_output_embeddings(), torch.nn.Module):
            return module
    return None


class HeldForward:
    """``running()``: the forward inside saves the head's input, not the head's and loss's
    activations; ``kept(output)``: what of its output the window keeps for the backward."""

    def __init__(self, model: torch.nn.Module):
        self._model = _head_model(model)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # the head's last (output, input)

    @staticmethod
    def kept(output):
        """A model output's ``.loss`` alone (what the backward reads of it), anything else as it is."""
        return output.loss if isinstance(getattr(output, "loss", None), torch.Tensor) else output

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        model = self._model
        if model is None:
            yield
            return
        head = model.get_output_embeddings()
        own = vars(model).get("_loss_function")  # set through transformers' setter: the user's, if any
        original = model.loss_function

        def remember(module, args, output):
            self._last = (output, args[0]) if args and isinstance(args[0], torch.Tensor) else None

        def loss_function(logits, labels, *args: Any, **kwargs: Any):
            last, self._last = self._last, None
            if last is None or last[0] is not logits or not torch.is_grad_enabled():
                return original(logits, labels, *args, **kwargs)
            loss = torch.utils.checkpoint.checkpoint(lambda x: original(head(x), labels, *args, **kwargs), last[1],
                                                     use_reentrant=False, preserve_rng_state=True)
            self._last = None  # the head's call inside the region is no forward's own
            return loss

        hook = head.register_forward_hook(remember)
        model.loss_function = loss_function
        try:
            yield
        finally:
            hook.remove()
            self._last = None
            if own is None:
                del model._loss_function
            else:
                model.loss_function = own
