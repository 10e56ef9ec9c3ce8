"""Where an accelerate script is in its accumulation window, and the one place the engine's window
is closed.

accelerate's ``accumulate()`` counts micro-steps: gradients sync when the count reaches
``gradient_accumulation_steps`` or the data loader is at its last batch; the wrapped optimizer and
scheduler act only then. The door counts the same way (:meth:`Window.enter_micro_step`), and at a
syncing micro-step the first of ``optimizer.step()`` / ``accelerator.clip_grad_norm_()`` closes the
engine's window: ``eng.step()`` when the window is full, ``eng.flush()`` when the data ended first
(a short window, weighted by what it holds). Every later call in the same micro-step finds it
closed. The engine weights every micro-batch by its share of the whole window, so the script's
per-micro-batch ``optimizer.step()`` trains the global batch's objective.

A mixture of experts whose ``.loss`` adds its routers' load-balancing term (``output_router_logits``,
``moe.load_balance: global``) needs the whole window's router counts before its first backward, which
a loop of one forward and backward per micro-batch never has. Such a window is held
(:meth:`Window.held_forward`): each training forward keeps its micro-batch and returns the model's
outputs computed without gradients (what the script logs: the micro-batch's own loss); ``backward``
only checks that it was given that ``.loss``; the close runs the kept micro-batches as one engine
window, ``eng.train_batch(engine.MicroBatches(kept), model_loss)``, whose term is the global batch's
(the engine counts the window's routers first). One more forward per micro-batch than ``train_batch``.
"""

from __future__ import annotations

import torch

import engine
from engine.compat.accelerate.data import LoaderPosition
from engine.errors import EngineUsageError


class Window:
    """accelerate's ``GradientState`` for one Accelerator, over one :class:`engine.Engine`."""

    def __init__(self, steps: int, sync_with_dataloader: bool, position: LoaderPosition):
        self.steps, self.sync_with_dataloader, self.position = steps, sync_with_dataloader, position
        self.step = 0  # micro-steps counted by accumulate() since the last sync
        self.sync_gradients = True
        self.engine: engine.Engine | None = None
        self.inside_accumulate = 0
        self.closed: bool | None = None  # this micro-step's close: None (not yet), applied or skipped
        self.backwards = 0  # of the window in progress
        self.held: list[dict] | None = None  # a held window's micro-batches (None: micro-steps run as they come)
        self._held_loss = None  # the .loss the last held forward returned

    def enter_micro_step(self) -> None:
        """``accumulate()`` is entered: this micro-step syncs at the window's end or the data's."""
        if self.sync_with_dataloader and self.position.end_of_dataloader:
            self.step = 0
            self.sync_gradients = True
        else:
            self.step += 1
            self.sync_gradients = self.step % self.steps == 0
        self.closed = None

    def backward(self, loss) -> None:
        if self.steps > 1 and not self.inside_accumulate:
            raise EngineUsageError(
                f"accelerator.backward(loss) outside `with accelerator.accumulate(model):` while "
                f"gradient_accumulation_steps is {self.steps}: wrap each micro-step (forward, backward, "
                "optimizer.step(), scheduler.step(), optimizer.zero_grad()) in accumulate(model)")
        eng = self.require_engine("accelerator.backward()")
        if self.held is None:
            eng.backward(loss)
        elif loss is not self._held_loss:
            raise EngineUsageError(
                "accelerator.backward(loss): the model's routers add a load-balancing term to .loss, so its "
                "window is run again as a whole at the optimizer step (the term is the global batch's); pass "
                "model(**batch).loss unchanged, or set moe.load_balance: micro_batch in microstep_config")
        self.backwards += 1
        self.closed = None

    def held_forward(self, eng: engine.Engine, args: tuple, kwargs: dict):
        """A training forward of a held window: its micro-batch kept, the outputs computed without gradients."""
        if args:
            raise EngineUsageError("a model whose routers add a load-balancing term to .loss is called with its "
                                   "batch as keywords in a held window: model(**batch)")
        self.held.append(kwargs)
        with torch.no_grad():
            outputs = eng(**kwargs)
        self._held_loss = getattr(outputs, "loss", None)
        return outputs

    def close(self) -> bool | None:
        """Close the engine's window if this micro-step syncs and it is still open; returns whether this
        micro-step's close applied an update (None: nothing closed here)."""
        if not self.sync_gradients or self.closed is not None or self.backwards == 0:
            return self.closed
        eng = self.require_engine("optimizer.step()")
        if self.held is not None:
            held, self.held, self._held_loss = self.held, [], None
            eng.train_batch(engine.MicroBatches(held), model_loss)
        elif eng.is_gradient_accumulation_boundary():
            eng.step()
        else:
            eng.flush()  # the data ended before the window: a short window
        self.backwards = 0
        self.closed = bool(eng.last_window.step.applied)
        return self.closed

    def zero_grad(self) -> None:
        if self.sync_gradients and self.engine is not None:
            self.engine.zero_grad()  # never wipes a window in progress

    def require_engine(self, what: str) -> engine.Engine:
        if self.engine is None:
            raise EngineUsageError(f"{what} before the model and its optimizer were prepared: call "
                                   "accelerator.prepare(model, optimizer, ...) first")
        return self.engine

    def grad_norm(self) -> torch.Tensor | None:
        """The whole window's gradient norm before clipping, at its close (None when not computed)."""
        norm = self.engine.last_window.step.grad_norm if self.engine is not None else None
        return None if norm is None else torch.as_tensor(norm)


def model_loss(model, micro_batch):
    """A held window's loss: the model's own ``.loss`` of the micro-batch, as the script computed it."""
    return model(**micro_batch).loss
