"""What automatic micro-batch sizing costs, in one process: one out-of-memory recovery
(failing in the forward, or at the end of the backward) and one ``explore``, each relative
to a normal optimizer step; and the steady-state cost of ``auto`` against a fixed size.

    python bench/autotune_cost.py [--repeats 5]

Workload: the 4.2M-parameter MLP of bench/common.py behind a layer that raises
torch.OutOfMemoryError (what CUDA raises) for micro-batches above 16; per-device batch 64,
AdamW, fp32. Results: bench/results/autotune_cost.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import engine
from bench.common import add_record_argument, batch, mlp, mse, save

BATCH, FITS = 64, 16


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")


class MemoryWall(torch.nn.Module):
    """Identity for micro-batches of at most FITS rows; larger ones run out of memory in the
    forward, or in the backward once the layers above it have their gradients."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def forward(self, x):
        if x.shape[0] > FITS:
            if self.where == "forward":
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return _FailInBackward.apply(x)
        return x


def model_with_wall(base, where):
    """``base`` with the wall after its first layer (so its backward is reached)."""
    first, *rest = copy.deepcopy(base)
    return torch.nn.Sequential(first, MemoryWall(where), *rest)


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    base, data = mlp(), batch(BATCH)

    def config(micro):
        return {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": micro,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}

    fixed = engine.initialize(model_with_wall(base, "forward"), config(FITS))
    fixed.train_batch(data, mse)

    def normal_step() -> float:
        return timed(lambda: fixed.train_batch(data, mse))

    ratios: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        # each measurement against a normal step taken right after it
        ratios.setdefault(name, []).append(seconds / normal_step())

    normals = []
    for _ in range(args.repeats):
        normals.append(normal_step())
        for where in ("forward", "backward"):
            auto = engine.initialize(model_with_wall(base, where), config("auto"))
            record(f"first step with recovery (64 -> 32 -> 16), out of memory in the {where}",
                   timed(lambda: auto.train_batch(data, mse)))
            for _ in range(3):
                record(f"later auto steps ({where} case)", timed(lambda: auto.train_batch(data, mse)))
        explore = engine.initialize(model_with_wall(base, "forward"), config("explore"))
        record("first step with explore (1 warm-up + 2 timed windows per size)",
               timed(lambda: explore.train_batch(data, mse)))
    results = {"normal step, fixed micro 16 (ms)": statistics.median(normals) * 1e3}
    results.update({f"{name} (x normal)": statistics.median(values) for name, values in ratios.items()})

    for name, value in results.items():
        print(f"{name:72s} {value:8.2f}")
    save("autotune_cost", {"workload": f"MLP 4.2M params, per-device batch {BATCH}, out of memory above micro {FITS}, "
                                       "AdamW fp32, 1 process, 1 thread", "results": results}, record=args.record)


if __name__ == "__main__":
    main()
