"""``colossalai.utils``: ``get_dataloader``, ``get_current_device``, ``print_rank_0`` as the
legacy examples call them."""
from __future__ import annotations

import random

import torch
from torch.utils.data import DataLoader, DistributedSampler

from engine.distributed.process_group import get_rank, get_world_size

__all__ = ["get_dataloader", "get_current_device", "print_rank_0"]


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32
    random.seed(seed)


def get_dataloader(dataset, shuffle: bool = False, seed: int = 1024, add_sampler: bool = True,
                   drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0, **kwargs) -> DataLoader:
    """Colossal-AI's: a ``DataLoader`` of this process's share of ``dataset`` (a
    ``DistributedSampler`` over the data-parallel ranks when there are several and
    ``add_sampler``, shuffled with ``seed``), other keywords (``batch_size``, ``collate_fn``,
    ...) passed to ``DataLoader``. ``pin_memory`` applies with CUDA only."""
    pin_memory = pin_memory and torch.cuda.is_available()
    if add_sampler and get_world_size() > 1:
        sampler = DistributedSampler(dataset, num_replicas=get_world_size(), rank=get_rank(), shuffle=shuffle,
                                     seed=seed, drop_last=drop_last)
        return DataLoader(dataset, sampler=sampler, drop_last=drop_last, pin_memory=pin_memory,
                          num_workers=num_workers, worker_init_fn=_seed_worker, **kwargs)
    return DataLoader(dataset, shuffle=shuffle, drop_last=drop_last, pin_memory=pin_memory, num_workers=num_workers,
                      worker_init_fn=_seed_worker, generator=torch.Generator().manual_seed(seed), **kwargs)


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
