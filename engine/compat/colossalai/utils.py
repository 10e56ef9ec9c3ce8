"""``colossalai.utils``: ``get_dataloader``, ``get_current_device``, ``print_rank_0`` as the
legacy examples call them."""
from __future__ import annotations

import functools

import torch
from torch.utils.data import DataLoader, DistributedSampler

from engine.compat.colossalai.context import ParallelMode, gpc
from engine.distributed.process_group import get_rank
from engine.state.rng import seed_everything

__all__ = ["get_dataloader", "get_current_device", "print_rank_0", "DataParallelSampler"]


class DataParallelSampler(DistributedSampler):
    """Colossal-AI's sampler: this data-parallel rank's share of ``dataset`` (padded to equal
    shares unless ``drop_last``), shuffled with ``seed + epoch``; the epoch advances by itself
    at each pass, so every epoch has its own order without ``set_epoch`` (which still sets it)."""

    def __init__(self, dataset, shuffle: bool = False, seed: int = 0, drop_last: bool = False):
        super().__init__(dataset, num_replicas=gpc.get_world_size(ParallelMode.DATA),
                         rank=gpc.get_local_rank(ParallelMode.DATA), shuffle=shuffle, seed=seed, drop_last=drop_last)

    def __iter__(self):
        indices = super().__iter__()  # drawn now, with the current epoch
        if self.shuffle:
            self.epoch += 1
        return indices


def _seeding_workers(seed: int):
    """A ``worker_init_fn`` seeding each worker's torch, NumPy and ``random`` with ``seed``
    (every worker the same seed, as Colossal-AI does)."""
    return functools.partial(_seed_worker, seed)


def _seed_worker(seed: int, worker_id: int) -> None:
    seed_everything(seed)


def get_dataloader(dataset, shuffle: bool = False, seed: int = 1024, add_sampler: bool = True,
                   drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0, **kwargs) -> DataLoader:
    """Colossal-AI's: a ``DataLoader`` over this data-parallel rank's share of ``dataset``
    (a :class:`DataParallelSampler` when there are several data-parallel ranks and
    ``add_sampler``), other keywords (``batch_size``, ``collate_fn``, ...) passed to
    ``DataLoader``. As in Colossal-AI, ``seed`` seeds the workers only (torch, NumPy and
    ``random``, every worker alike); the sampler shuffles with its own seed 0 (and the epoch),
    a single rank with torch's global generator (which ``launch_from_torch`` seeded), and
    ``drop_last`` drops the last short batch, never samples from a rank's share.
    ``pin_memory`` applies with CUDA only."""
    pin_memory = pin_memory and torch.cuda.is_available()
    common = {"drop_last": drop_last, "pin_memory": pin_memory, "num_workers": num_workers,
              "worker_init_fn": _seeding_workers(seed)}
    if add_sampler and gpc.get_world_size(ParallelMode.DATA) > 1:
        return DataLoader(dataset, sampler=DataParallelSampler(dataset, shuffle=shuffle), **common, **kwargs)
    return DataLoader(dataset, shuffle=shuffle, **common, **kwargs)


def get_current_device() -> torch.device:
    """This process's CUDA device, or the CPU."""
    return torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")


def print_rank_0(message: str, logger=None) -> None:
    """Print (or log with ``logger.info``) on rank 0 only."""
    if get_rank() == 0:
        if logger is None:
            print(message, flush=True)
        else:
            logger.info(message)
