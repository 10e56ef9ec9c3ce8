"""Shared benchmark helpers: the workload, interleaved timing, result files.

Timings are compared within one run: variants alternate round by round so that machine
noise hits them alike, and each variant's per-step time is the median over rounds.

Result files go to bench/results/latest/ (untracked); ``--record`` writes bench/results/, the
tracked files docs/benchmarks.md quotes, so that trying a documented command changes no figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results"  # recorded: tracked, quoted by docs/benchmarks.md
LATEST = RESULTS / "latest"  # any other run's (.gitignore)


def add_record_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", action="store_true",
                        help="write the tracked bench/results/ file that docs/benchmarks.md quotes "
                             "(default: bench/results/latest/, untracked)")


def results_directory(record: bool) -> Path:
    """Where a run's result files go: bench/results/ when recorded, else bench/results/latest/."""
    return RESULTS if record else LATEST


def mlp(width: int = 1024, depth: int = 4, seed: int = 0) -> torch.nn.Module:
    """depth × (width × width) linear layers with GELU: 4.2M parameters at the defaults."""
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1])


def batch(size: int, width: int = 1024, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, width, generator=g), torch.randn(size, width, generator=g)


def mse(model, micro_batch):
    x, y = micro_batch
    return torch.nn.functional.mse_loss(model(x), y)


GLOBAL_BATCH = 64


ADAMW = {"lr": 1e-4}  # the benchmarks' optimizer: AdamW with these settings


def adamw(params):
    return torch.optim.AdamW(params, **ADAMW)


def start_ranks(description: str, rounds: int, argv=None, steps: int = 3, add_arguments=None):
    """The start of a multi-rank benchmark: arguments (``--rounds``, ``--steps``, ``--record``, and what
    ``add_arguments(parser)`` adds), the process group, one thread per rank, and the workload: (args,
    dist info, model, this rank's share of the global batch)."""
    from engine.distributed.process_group import init_distributed, strip_local_rank_arg

    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    add_record_argument(parser)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)
    x, y = batch(GLOBAL_BATCH)
    share = GLOBAL_BATCH // info.world_size
    data = x[info.rank * share:(info.rank + 1) * share], y[info.rank * share:(info.rank + 1) * share]
    return args, info, mlp(), data


def rotating_rounds(runs: dict[str, Callable[[], None]], rounds: int,
                    measure: Callable[[Callable[[], None]], float]) -> dict[str, list[float]]:
    """Each variant's ``measure(run)`` in every round, the variants in a rotating order (none always
    runs first)."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            samples[name].append(measure(runs[name]))
    return samples


def wall_seconds(steps: int, distributed: bool) -> Callable[[Callable[[], None]], float]:
    """Seconds per call over ``steps`` calls; ``distributed``: the ranks start together and the
    slowest rank's time counts."""
    def measure(run) -> float:
        if distributed:
            dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            run()
        elapsed = torch.tensor((time.perf_counter() - start) / steps)
        if distributed:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed)
    return measure


def cpu_seconds(steps: int) -> Callable[[Callable[[], None]], float]:
    """CPU seconds per call over ``steps`` calls, averaged over the ranks (started together): on a
    machine shared with other work, what the variant itself computes, without waiting for a core."""
    def measure(run) -> float:
        dist.barrier()
        start = time.process_time()
        for _ in range(steps):
            run()
        spent = torch.tensor((time.process_time() - start) / steps)
        dist.all_reduce(spent)
        return float(spent) / dist.get_world_size()
    return measure


def interleaved(variants: dict[str, Callable[[], None]], rounds: int, steps: int, warmup: int = 2,
                distributed: bool = False) -> dict[str, float]:
    """Median seconds per call of each variant, the variants alternating every round (``rotating_rounds``).
    ``distributed``: every rank runs the same sequence, starts each measurement together and the
    slowest rank's time counts."""
    for run in variants.values():
        for _ in range(warmup):
            run()
    samples = rotating_rounds(variants, rounds, wall_seconds(steps, distributed))
    return {name: statistics.median(values) for name, values in samples.items()}


def cpu_interleaved(runs: dict, rounds: int, steps: int) -> dict[str, float]:
    """Median over rounds of the CPU seconds per step, averaged over ranks (``cpu_seconds``), the
    variants rotating as in ``interleaved``."""
    samples = rotating_rounds(runs, rounds, cpu_seconds(steps))
    return {name: statistics.median(values) for name, values in samples.items()}


def save(name: str, payload: dict, record: bool = False) -> Path:
    """Write ``name``.json into ``results_directory(record)``; its path."""
    directory = results_directory(record)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                           "cpu": platform.processor() or platform.machine(),
                           "threads": torch.get_num_threads()}, **payload}
    path = directory / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def shared_temp_directory(prefix: str, rank: int) -> str:
    """A new temporary directory made by rank 0, its path broadcast to every rank."""
    directory = tempfile.mkdtemp(prefix=prefix) if rank == 0 else None
    if dist.is_initialized():
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        directory = box[0]
    return directory
