"""What ``prepare`` returns for a model, an optimizer and a scheduler: each a front over the engine,
acting as accelerate's wrapper does where the script can see it.

* :class:`PreparedModel` — a module whose forward is the engine's (``eng(**batch)``: the engine
  counts the micro-batch and reads the model's own ``.loss`` as (sum, count)); ``train()`` /
  ``eval()``, ``parameters()`` and the model's own attributes reach the model itself.
* :class:`PreparedOptimizer` — accelerate's ``AcceleratedOptimizer`` surface: ``step()`` closes the
  engine's window at a syncing micro-step (else does nothing), ``zero_grad()`` clears between windows
  only; ``param_groups`` / ``state`` / ``state_dict`` are the optimizer's.
* :class:`PreparedScheduler` — accelerate's ``AcceleratedScheduler`` stepping: when gradients sync and
  the update was applied, ``num_processes`` scheduler steps (one with ``split_batches``), as the
  script's schedule was written for; between syncs nothing (accelerate 1.15 reads its plugin's
  ``adjust_scheduler`` only when set to its non-default False, so its count never moves there either).
"""

from __future__ import annotations

import torch

from engine.compat.accelerate.boundary import Window
from engine.errors import EngineUsageError


class PreparedModel(torch.nn.Module):
    """The prepared model (see the module's docstring); ``module`` is the model the engine holds."""

    def __init__(self, module: torch.nn.Module, window: Window):
        super().__init__()
        self.module = module
        object.__setattr__(self, "window", window)  # not a submodule, not in state_dict

    def forward(self, *args, **kwargs):
        eng = self.window.engine
        if eng is None:  # prepared without an optimizer: evaluation only
            return self.module(*args, **kwargs)
        if self.window.held is not None and torch.is_grad_enabled():  # a routed model's held window
            return self.window.held_forward(eng, args, kwargs)
        return eng(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)


def _wrapped(name: str) -> property:
    """The wrapped optimizer's ``name``, read and written through."""
    return property(lambda self: getattr(self.optimizer, name),
                    lambda self, value: setattr(self.optimizer, name, value))


class PreparedOptimizer(torch.optim.Optimizer):
    """accelerate's optimizer wrapper, over the engine (see the module's docstring). A subclass of
    ``torch.optim.Optimizer`` so that schedulers built on it after ``prepare`` accept it."""

    def __init__(self, optimizer: torch.optim.Optimizer, window: Window):
        # torch's Optimizer.__init__ is not called: every attribute it would set is the wrapped one's
        self.optimizer, self.window = optimizer, window

    param_groups = _wrapped("param_groups")
    state = _wrapped("state")
    defaults = _wrapped("defaults")

    def add_param_group(self, param_group: dict) -> None:
        raise EngineUsageError("optimizer.add_param_group() after prepare(): the engine holds the parameters it was "
                               "given; build the optimizer with every group before accelerator.prepare")

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def step(self, closure=None):
        """At a syncing micro-step: the engine's window closes (once); otherwise nothing changes."""
        if closure is not None:
            raise EngineUsageError("optimizer.step(closure): the engine steps once per window from the gradients "
                                   "its micro-steps accumulated; call optimizer.step() without a closure")
        self.window.close()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        self.window.zero_grad()

    @property
    def step_was_skipped(self) -> bool:
        """Whether this micro-step's close discarded the window (a non-finite gradient, e.g. an fp16 overflow)."""
        return self.window.closed is False

    def train(self) -> None:
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()

    def eval(self) -> None:
        if callable(getattr(self.optimizer, "eval", None)):
            self.optimizer.eval()

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)


class PreparedScheduler:
    """accelerate's scheduler wrapper (see the module's docstring)."""

    def __init__(self, scheduler, window: Window, *, processes: int, split_batches: bool,
                 step_with_optimizer: bool):
        self.scheduler, self.window = scheduler, window
        self.steps_per_update = 1 if split_batches else processes
        self.step_with_optimizer = step_with_optimizer

    def step(self, *args, **kwargs) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.window.sync_gradients or self.window.closed is False:  # no update: no schedule step
            return
        for _ in range(self.steps_per_update):
            total = getattr(self.scheduler, "total_steps", None)  # OneCycleLR stops at its total
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def get_lr(self):
        return self.scheduler.get_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str):
        if name in ("scheduler", "__setstate__") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)
