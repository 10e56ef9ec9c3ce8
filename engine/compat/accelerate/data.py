"""A prepared data loader: this rank's slice of each global batch of the script's ``DataLoader``, as
accelerate shards it, and what the boundary and ``gather_for_metrics`` need to know of it.

Without ``split_batches`` every process gets whole batches of the loader's ``batch_size``: the loader's
batches are taken ``num_processes`` at a time (one global batch of a micro-step) and the k-th process
gets the k-th. With ``split_batches`` each of the loader's batches is one global batch, cut into
``num_processes`` equal slices. As accelerate's ``even_batches`` does, an incomplete last global batch
(``drop_last`` false) is completed with the epoch's first samples, so every process runs the same
number of micro-steps (one process keeps the loader's batches as they are); ``remainder`` says how
many of its samples are real (``gather_for_metrics`` drops the rest). A shuffling loader's order is
drawn from one seed agreed by the ranks (rank 0's ``torch.initial_seed()``, or the
``DataLoaderConfiguration``'s ``data_seed``) plus the epoch: the same permutation on every rank,
another each pass (``set_epoch`` sets it).
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from engine.batching.microbatch import to_device
from engine.errors import EngineUsageError


class LoaderPosition:
    """Where the data loaders being iterated are: accelerate's ``end_of_dataloader`` and ``remainder``
    (a stack: an evaluation loop inside a training loop has its own loader)."""

    def __init__(self):
        self.active: list[PreparedDataLoader] = []

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self.active) and self.active[-1].at_last_batch

    @property
    def remainder(self) -> int:
        """Real samples of the innermost loader's last global batch; -1 when it holds no padding."""
        return self.active[-1].remainder if self.active else -1


class _Epoch:
    """The pass a loader is in; shared with its ``skip_first_batches`` view, which finishes that pass."""

    def __init__(self):
        self.value = 0


class PreparedDataLoader:
    """This rank's batches of ``loader`` (see the module's docstring), moved to ``device``."""

    def __init__(self, loader: DataLoader, *, rank: int, world_size: int, split_batches: bool, seed: int,
                 device: torch.device | None, position: LoaderPosition):
        _check_loader(loader, world_size, split_batches)
        self.loader, self.rank, self.world_size, self.split_batches = loader, rank, world_size, split_batches
        self.seed, self.device, self.position = seed, device, position
        self.epoch = _Epoch()
        self.skip = 0
        self.remainder = -1
        self.at_last_batch = False

    # -- what it is -----------------------------------------------------------------------
    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def batch_size(self) -> int:
        """This process's batch size."""
        size = self.loader.batch_size
        return size // self.world_size if self.split_batches else size

    @property
    def total_batch_size(self) -> int:
        """Samples of one micro-step over every process."""
        return self.loader.batch_size if self.split_batches else self.loader.batch_size * self.world_size

    @property
    def total_dataset_length(self) -> int:
        return len(self.loader.dataset)

    def __len__(self) -> int:
        return max(len(self._rank_batches(count_only=True)) - self.skip, 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch.value = epoch

    def skipping(self, batches: int) -> PreparedDataLoader:
        """A view that starts this pass after its first ``batches`` batches (accelerate's ``skip_first_batches``)."""
        view = copy.copy(self)
        view.skip = batches
        return view

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        rank_batches = self._rank_batches()[self.skip:]
        loader = DataLoader(self.loader.dataset, batch_sampler=rank_batches, collate_fn=self.loader.collate_fn,
                            num_workers=self.loader.num_workers, pin_memory=self.loader.pin_memory,
                            worker_init_fn=self.loader.worker_init_fn)
        self.position.active.append(self)
        self.at_last_batch = False
        try:
            for index, batch in enumerate(loader):
                self.at_last_batch = index == len(rank_batches) - 1
                yield batch if self.device is None else to_device(batch, self.device)
        finally:
            self.position.active.remove(self)
            self.at_last_batch = False
        self.epoch.value += 1

    def _rank_batches(self, count_only: bool = False) -> list[list[int]]:
        """This rank's index lists for the current pass; sets ``remainder``."""
        batches = self._global_batches()
        size = self.loader.batch_size
        if self.world_size == 1:  # accelerate leaves one process's loader as it is: nothing to complete
            if not count_only:
                self.remainder = -1
            return batches
        if self.split_batches:
            remainder = len(batches[-1]) if batches and len(batches[-1]) < size else -1
            batches = [b if len(b) == size else self._completed(b, size, batches) for b in batches]
            share = size // self.world_size
            mine = [b[self.rank * share:(self.rank + 1) * share] for b in batches]
        else:
            groups = [batches[i:i + self.world_size] for i in range(0, len(batches), self.world_size)]
            remainder = -1
            incomplete = bool(groups) and (len(groups[-1]) < self.world_size or len(groups[-1][-1]) < size)
            if incomplete and self.loader.drop_last:  # accelerate drops a last global batch without all its batches
                groups, incomplete = groups[:-1], False
            if incomplete:
                last = [i for b in groups[-1] for i in b]
                remainder = len(last)
                whole = self._completed(last, size * self.world_size, batches)
                groups[-1] = [whole[k * size:(k + 1) * size] for k in range(self.world_size)]
            mine = [group[self.rank] for group in groups]
        if not count_only:
            self.remainder = remainder
        return mine

    def _global_batches(self) -> list[list[int]]:
        """The loader's batches of indices in this pass, the same on every rank."""
        sampler = self.loader.batch_sampler
        if isinstance(sampler, BatchSampler) and isinstance(sampler.sampler, RandomSampler):
            generator = torch.Generator().manual_seed(self.seed + self.epoch.value)
            order = torch.randperm(len(self.loader.dataset), generator=generator).tolist()
            size = sampler.batch_size
            batches = [order[i:i + size] for i in range(0, len(order), size)]
            return batches[:-1] if sampler.drop_last and batches and len(batches[-1]) < size else batches
        return [list(batch) for batch in sampler]

    @staticmethod
    def _completed(indices: list[int], size: int, batches: list[list[int]]) -> list[int]:
        """``indices`` completed to ``size`` with the pass's first samples, cyclically (accelerate's even_batches)."""
        first = [i for b in batches for i in b]
        filled = list(indices)
        while len(filled) < size:
            filled += first[:size - len(filled)]
        return filled


def _check_loader(loader: DataLoader, world_size: int, split_batches: bool) -> None:
    if isinstance(loader.dataset, IterableDataset):
        raise EngineUsageError("prepare(): a DataLoader over an IterableDataset is not sharded by Microstep's "
                               "Accelerator; give a map-style dataset (with __len__ and __getitem__)")
    if loader.batch_size is None:
        raise EngineUsageError("prepare(): the DataLoader has no batch_size (a custom batch_sampler); give "
                               "DataLoader(dataset, batch_size=..., shuffle=..., collate_fn=...)")
    if split_batches and loader.batch_size % world_size:
        raise EngineUsageError(f"split_batches: the DataLoader's batch_size {loader.batch_size} must divide by the "
                               f"{world_size} processes")
