"""This rank's per-device batches of a map-style dataset, one per optimizer step.

Every rank derives the same epoch order (a permutation seeded with ``seed + epoch``, or
the identity). Global step ``b`` of the epoch covers exactly ``order[b*G:(b+1)*G]``, and
rank ``r`` takes the contiguous slice of it that starts after the samples of ranks
``0..r-1``. Ranks may get different sizes (balanced plans). The global order does not
depend on the world size, so a single process can rebuild any global batch with
:meth:`DistributedBatches.global_batch_indices` (e.g. a full-batch reference run), and a
run can resume on a different number of ranks with the same ``train_batch_size``.

Position and epochs. The object remembers the next batch to produce: ``(epoch, step)``.
Iterating yields the rest of the current epoch and advances the position as each batch
is handed out; when the epoch's last batch has been handed out the position moves to
``(epoch + 1, 0)``, so the next ``for`` loop runs the next epoch with a new order and no
``set_epoch`` call is needed. A loop that stops early (``break``) continues where it
stopped. ``state_dict()`` / ``load_state_dict()`` save and restore the position: after a
resume the next batch is the one an uninterrupted run would have produced.
``set_epoch(e)`` jumps to the start of epoch ``e``, except that it keeps the position when
already in epoch ``e``, so the DistributedSampler habit of calling ``set_epoch(epoch)`` at
the top of each epoch stays correct after a mid-epoch resume.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import default_collate

from engine.batching.plan import split_evenly

log = logging.getLogger("engine")


class DistributedBatches:
    """Iterable over this rank's per-device batches, one per optimizer step.

    ``plan`` needs ``world_size``, ``rank``, ``train_batch_size`` (G) and
    ``per_device_batch_sizes`` (every rank's share of G) -- an ``engine.BatchPlan``.

    ``drop_last=True`` drops the epoch's final incomplete global batch. With
    ``drop_last=False`` it is yielded, its n < G samples spread as evenly as possible (the
    first ``n % world_size`` ranks get one more). The engine splits each rank's share into
    ``plan.gradient_accumulation_steps`` micro-batches, so every share must be at least
    that: a dataset whose last batch is too small for this is rejected here.
    """

    def __init__(self, dataset, plan, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, collate_fn: Callable[[list], Any] | None = None):
        self.dataset = dataset
        self.rank = plan.rank
        self.world_size = plan.world_size
        self.train_batch_size = plan.train_batch_size
        self.per_device_batch_sizes = tuple(plan.per_device_batch_sizes)
        self.accumulation_steps = getattr(plan, "gradient_accumulation_steps", 1)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.collate_fn = collate_fn or default_collate
        self.dataset_size = len(dataset)
        self._check()
        self._epoch = 0
        self._step = 0

    def _check(self) -> None:
        sizes, G, W = self.per_device_batch_sizes, self.train_batch_size, self.world_size
        if len(sizes) != W or sum(sizes) != G or min(sizes) < 1:
            raise ValueError(
                f"plan.per_device_batch_sizes {sizes} must hold {W} positive sizes "
                f"summing to train_batch_size {G}."
            )
        if not 0 <= self.rank < W:
            raise ValueError(f"plan.rank {self.rank} is outside [0, {W}).")
        if self.dataset_size == 0:
            raise ValueError("the dataset is empty.")
        if self.drop_last and self.dataset_size < G:
            raise ValueError(
                f"the dataset has {self.dataset_size} samples, fewer than one global batch "
                f"(train_batch_size {G}); with drop_last=True there is nothing to train on. "
                f"Use a smaller train_batch_size or drop_last=False."
            )
        remainder, A = self.dataset_size % G, self.accumulation_steps
        if not self.drop_last and 0 < remainder < W * A:
            raise ValueError(
                f"with drop_last=False the last global batch has {remainder} samples; "
                f"{W} ranks x {A} accumulation steps need at least {W * A} so that no "
                f"micro-batch is empty. Use drop_last=True or a dataset size whose "
                f"remainder modulo {G} is 0 or at least {W * A}."
            )

    # ------------------------------------------------------------------ index arithmetic

    def __len__(self) -> int:
        """Optimizer steps (global batches) per epoch."""
        full, remainder = divmod(self.dataset_size, self.train_batch_size)
        return full + (1 if remainder and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def _check_step(self, step: int) -> None:
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} is outside [0, {len(self)}) for this epoch.")

    def global_batch_indices(self, epoch: int, step: int) -> list[int]:
        """The dataset indices of global batch ``step`` of ``epoch``, over all ranks."""
        self._check_step(step)
        G = self.train_batch_size
        return self.epoch_order(epoch)[step * G:(step + 1) * G]

    def rank_sizes(self, step: int) -> tuple[int, ...]:
        """Every rank's number of samples at ``step`` (differs only in a short last batch)."""
        self._check_step(step)
        n = min(self.train_batch_size, self.dataset_size - step * self.train_batch_size)
        return split_evenly(n, self.world_size)  # the plan's own rule: first ranks get the extra

    def rank_indices(self, epoch: int, step: int, rank: int | None = None) -> list[int]:
        """The dataset indices ``rank`` (default: this rank) takes at ``step`` of ``epoch``."""
        self._check_step(step)
        return self._rank_share(self.epoch_order(epoch), step, self.rank if rank is None else rank)

    def _rank_share(self, order: list[int], step: int, rank: int) -> list[int]:
        """``rank``'s contiguous slice of global batch ``step`` of an epoch's ``order``."""
        sizes = self.rank_sizes(step)
        start = step * self.train_batch_size + sum(sizes[:rank])
        return order[start:start + sizes[rank]]

    # ------------------------------------------------------------------ iteration and position

    def __iter__(self) -> Iterator[Any]:
        epoch = self._epoch
        order = self.epoch_order(epoch)  # once per epoch, not per batch
        for step in range(self._step, len(self)):
            batch = self.collate_fn([self.dataset[i] for i in self._rank_share(order, step, self.rank)])
            # Advance before handing the batch out: a checkpoint taken while the caller
            # trains on it must resume at the next one.
            if step + 1 < len(self):
                self._step = step + 1
            else:
                self._epoch, self._step = epoch + 1, 0
            yield batch

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        """Index within the epoch of the next batch to be produced."""
        return self._step

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``; a no-op when already in it (keeps a resumed step)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}.")
        if epoch != self._epoch:
            self._epoch, self._step = epoch, 0

    def use(self, dataset, collate_fn: Callable[[list], Any] | None = None) -> None:
        """Read ``dataset`` with ``collate_fn`` from now on, keeping the position: a new object for
        the same data (``eng.batches`` given a dataset made anew each epoch)."""
        if len(dataset) != self.dataset_size:
            raise ValueError(f"use(): the dataset holds {len(dataset)} samples, this position counts "
                             f"{self.dataset_size}; make new DistributedBatches for other data")
        self.dataset, self.collate_fn = dataset, collate_fn or default_collate

    _MUST_MATCH = ("dataset_size", "train_batch_size", "shuffle", "drop_last")

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self._epoch, "step": self._step, "seed": self.seed}
        state.update({key: getattr(self, key) for key in self._MUST_MATCH})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (the seed is restored too)."""
        mismatched = [f"{key}: saved {state[key]!r}, now {getattr(self, key)!r}"
                      for key in self._MUST_MATCH
                      if key in state and state[key] != getattr(self, key)]
        if mismatched:
            raise ValueError("cannot resume: the data order would differ ("
                             + "; ".join(mismatched) + ").")
        if not 0 <= state["step"] < len(self):
            raise ValueError(f"saved step {state['step']} is outside [0, {len(self)}).")
        self.seed = state["seed"]
        self._epoch, self._step = state["epoch"], state["step"]


def batches_for(previous: DistributedBatches | None, dataset, plan, *, shuffle: bool, seed: int, drop_last: bool,
                collate_fn: Callable[[list], Any] | None) -> DistributedBatches:
    """``previous`` going on with ``dataset`` when it is the same data — known by its length and order
    options (``shuffle``, ``seed``, ``drop_last``), not by the Python object, so a dataset (or
    ``collate_fn``) made anew each epoch keeps the position — else new batches from epoch 0, with a
    warning when ``previous`` was under way."""
    if previous is not None and (previous.dataset_size, previous.shuffle, previous.seed, previous.drop_last) \
            == (len(dataset), shuffle, seed, drop_last):
        previous.use(dataset, collate_fn)  # the same data order: new objects, the position kept
        return previous
    if previous is not None and (previous.epoch, previous.step) != (0, 0):
        log.warning("eng.batches(): other data (length %d, shuffle %s, seed %s, drop_last %s; was %d, %s, %s, "
                    "%s): it starts at epoch 0, batch 0, and automatic checkpoints save its position from now on "
                    "(the previous data stopped at epoch %d, batch %d). Pass the same data and options to go on "
                    "where it was", len(dataset), shuffle, seed, drop_last, previous.dataset_size, previous.shuffle,
                    previous.seed, previous.drop_last, previous.epoch, previous.step)
    return DistributedBatches(dataset, plan, shuffle=shuffle, seed=seed, drop_last=drop_last, collate_fn=collate_fn)

