"""One accumulation window's records on this rank, its totals over the ranks, and the report
of a closed window."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.accounting import MIXED_KINDS
from engine.batching.token_budget import TokenCost
from engine.errors import EngineUsageError
from engine.strategies.base import StepResult




@dataclass
class Window:
    """One accumulation window in progress on this rank."""

    micro_steps: int = 0
    samples: int = 0  # local samples seen (as planned in the manual loop, real in train_batch)
    item_weighted: bool | None = None  # (sum, count) losses
    # Kept as lists and summed at the boundary: no tensor op per micro-step besides backward.
    losses: list = field(default_factory=list)  # detached micro-batch losses
    loss_weights: list = field(default_factory=list)  # samples (mean losses) or 1 (sums)
    counts: list = field(default_factory=list)  # items of (sum, count) losses
    exact_counts: bool = False  # units must be summed over ranks at the boundary
    planned_steps: int | None = None  # set by train_batch; the manual loop follows the plan
    tokens: TokenCost | None = None  # the window's micro-batches, when split by tokens
    failure: Exception | None = None  # loss_fn failed on this rank in a window run to its end (a pipeline)
    backward_since_step: bool = False
    # training forwards not yet back-propagated: a window's held forwards are several; a forward whose
    # loss the script dropped (its own error caught) stays counted, as it always did
    forwarded: int = 0
    training_forwards: int = 0  # forwards for a backward, failed ones included
    forwards: list = field(default_factory=list)  # this micro-step's forwards, as the window split records them

    def loss_total(self) -> torch.Tensor:
        """Σ loss × weight over the window's micro-steps (0-dim, float64); 0 where this rank holds
        no loss (a pipeline stage before the last)."""
        if not self.losses:
            return torch.zeros((), dtype=torch.float64)
        losses = torch.stack(self.losses).double()
        return losses @ torch.tensor(self.loss_weights, dtype=torch.float64, device=losses.device)

    def units(self):
        """What the window's mean divides by: local samples, or local items."""
        if not self.item_weighted:
            return self.samples
        return sum(torch.as_tensor(c, dtype=torch.float64) for c in self.counts)

    def check_same_kind(self, item_weighted: bool) -> None:
        """One kind of loss per window: means, or (sum, count) pairs."""
        if self.item_weighted is None:
            self.item_weighted = item_weighted
        elif self.item_weighted != item_weighted:
            raise EngineUsageError(MIXED_KINDS)


@dataclass
class WindowReport:
    """Statistics of the last closed window (for logging; the loss is read lazily)."""

    loss: torch.Tensor | None = None
    samples: int = 0
    items: torch.Tensor | None = None
    step: StepResult = field(default_factory=lambda: StepResult(applied=False))
    lr: float | None = None  # the learning rate this window's update used (first param group)
    peak_memory_bytes: int | None = None  # measured when the monitor records the window
    micro_steps: int = 0  # on each rank
    real_tokens: int | None = None  # split by tokens: real and padded (computed) tokens, all ranks
    padded_tokens: int | None = None
