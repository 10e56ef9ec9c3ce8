"""What a held forward keeps until its window's backwards: its loss, and the final norm's input in
place of the norm's, the head's and the loss's saved activations.

Holding a window's forwards (``moe.global_counts: hold_forwards``) keeps every micro-batch's saved
activations until the window's counts are known. Activation checkpointing reduces a block to its
input; what follows the last block does not shrink: a Hugging Face causal language model's final
norm and ``lm_head`` save their inputs and intermediates, its cross entropy the log-probabilities —
one number per token and vocabulary entry, the largest tensor a checkpointed forward saves (Mixtral
in ``bench/moe.py``: 514 KiB of the 1.4 MiB a micro-batch saves; four held, four times) — and the
model's output holds the logits, as large again.

:class:`HeldForward` runs the model's ``loss_function(logits, labels, ...)`` on ``lm_head(x)``
inside one ``torch.utils.checkpoint`` region; where ``x`` is the whole output of the base model's
last child call and that child is a normalization layer (its final norm), the region starts at the
norm's input and recomputes the norm too, else it starts at ``x``. The forward saves the region's input only; the
backward recomputes the rest. The logits the model returns keep their own graph (a loss the caller
builds from ``.logits`` still reaches the head; one more norm and head product per forward pays for
it), and of an output with a ``.loss`` only that loss is kept for the backward (``kept``): its
logits and router logits are freed unless the caller keeps them. The values are the same
operations on the same numbers, so the gradients are bitwise those of the plain forward. The region
applies where the model hands its loss function the head's output itself; a model that changes the
logits first (a soft cap), or that has no output head with a ``loss_function``, runs as written.
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


def _same_elements(view: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``view`` is ``tensor`` or a view of the same memory, shape and layout (a slice of all of
    it); a tensor subclass (a DTensor, an asynchronous collective's result) only when it is ``tensor``."""
    if view is tensor:
        return True
    if type(view) is not torch.Tensor or type(tensor) is not torch.Tensor:
        return False
    return (view.dtype == tensor.dtype and view.shape == tensor.shape and view.stride() == tensor.stride()
            and view.storage_offset() == tensor.storage_offset()
            and view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr())


def _norm_call(module, args, kwargs, output) -> bool:
    """A normalization layer (its class named ``...Norm...``, as transformers' and torch's are: no random
    numbers drawn, so recomputing it gives the same output) called on one tensor."""
    return "Norm" in type(module).__name__ and len(args) == 1 and not kwargs \
        and isinstance(args[0], torch.Tensor) and isinstance(output, torch.Tensor)


class HeldForward:
    """``running()``: the forward inside saves the final norm's (or the head's) input, not the norm's,
    head's and loss's activations; ``kept(output)``: what of its output the window keeps for the backward."""

    def __init__(self, model: torch.nn.Module):
        self._model = _head_model(model)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # the head's last (output, input)
        # the base model's last child call before the head, if a norm's on one tensor: (module, output, input)
        self._before: tuple[torch.nn.Module, torch.Tensor, torch.Tensor] | None = None

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

        def remember_before(module, args, kwargs, output):
            self._before = (module, output, args[0]) if _norm_call(module, args, kwargs, output) else None

        def loss_function(logits, labels, *args: Any, **kwargs: Any):
            last, before, self._last, self._before = self._last, self._before, None, None
            if last is None or last[0] is not logits or not torch.is_grad_enabled():
                return original(logits, labels, *args, **kwargs)
            norm = before[0] if before is not None and _same_elements(last[1], before[1]) else None
            start = before[2] if norm is not None else last[1]  # the head reads the norm's output whole

            def region(hidden):
                return original(head(norm(hidden) if norm is not None else hidden), labels, *args, **kwargs)

            loss = torch.utils.checkpoint.checkpoint(region, start, use_reentrant=False, preserve_rng_state=True)
            self._last = self._before = None  # the calls inside the region are no forward's own
            return loss

        hooks = [head.register_forward_hook(remember)]
        base = getattr(model, "base_model", None)
        if isinstance(base, torch.nn.Module) and base is not model:
            hooks += [child.register_forward_hook(remember_before, with_kwargs=True) for child in base.children()]
        model.loss_function = loss_function
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            self._last = self._before = None
            if own is None:
                del model._loss_function
            else:
                model.loss_function = own
