"""``import deepspeed.comm as dist``: DeepSpeed's collectives module, over ``torch.distributed``
and the process group Microstep joined (``init_distributed`` joins the one the launcher
describes). ``get_rank`` / ``get_world_size`` answer 0 / 1 before any group exists."""
from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as _dist
from torch.distributed import ProcessGroup, ReduceOp  # noqa: F401 -- DeepSpeed's names

from engine.distributed.process_group import get_rank, get_world_size, init_distributed as _join_group, \
    read_launch_env
from engine.errors import EngineUsageError

__all__ = ["init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank", "barrier",
           "all_reduce", "broadcast", "all_gather", "gather", "reduce", "new_group", "destroy_process_group",
           "ReduceOp", "ProcessGroup"]


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30), init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Join the process group the launcher describes (torchrun, ``python -m launch``, the
    deepspeed launcher, Slurm); a group that exists already is kept. ``dist_backend``: nccl,
    gloo or None (nccl with CUDA, else gloo)."""
    if init_method is not None or rank != -1 or world_size != -1:
        raise EngineUsageError(
            "init_distributed(init_method=, rank=, world_size=): Microstep joins the process group its launcher "
            "describes in the environment; start the script with torchrun, python -m launch or the deepspeed "
            "launcher instead")
    if dist_init_required is False:
        return
    _join_group(timeout.total_seconds(), dist_backend or "auto")


def is_initialized() -> bool:
    return _dist.is_available() and _dist.is_initialized()


def get_local_rank() -> int:
    return read_launch_env().local_rank


def barrier(group=None, async_op: bool = False, device_ids=None):
    return _dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return _dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor, src: int, group=None, async_op: bool = False):
    return _dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    return _dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def gather(tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False):
    return _dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def reduce(tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False):
    return _dist.reduce(tensor, dst=dst, op=op, group=group, async_op=async_op)


def new_group(ranks=None, **kwargs):
    return _dist.new_group(ranks=ranks, **kwargs)


def destroy_process_group(group=None) -> None:
    _dist.destroy_process_group(group)
