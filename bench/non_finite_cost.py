"""What the non-finite gradient check costs per optimizer step, one process: the engine as it
is against the same engine whose boundary skips the check (the global-norm pass and its host
sync), in one run; with clipping on the norm is computed anyway and the check is free.

    python bench/non_finite_cost.py [--rounds 40] [--steps 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import torch

import engine
from bench.common import add_record_argument, batch, interleaved, mlp, mse, save

GLOBAL_BATCH, MICRO = 64, 16


def without_check(eng):
    """The engine with the boundary's norm pass replaced by a constant: no pass, no host sync
    waiting on it (what the engine did before the check existed). Benchmark only."""
    strategy = eng.strategy
    strategy.grad_squares_share = lambda: None  # not carried in the window's statistics either
    strategy.global_grad_norm = lambda: torch.zeros((), dtype=torch.float64)
    return eng


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, data = mlp(), batch(GLOBAL_BATCH)
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engines = {
        "engine, no check": without_check(engine.initialize(copy.deepcopy(model), config)),
        "engine, no check, second copy (noise floor)": without_check(engine.initialize(copy.deepcopy(model), config)),
        "engine with the non-finite check": engine.initialize(copy.deepcopy(model), config),
    }
    times = interleaved({name: (lambda e=e: e.train_batch(data, mse)) for name, e in engines.items()},
                        args.rounds, args.steps)
    base = times["engine, no check"]
    ratios = {name: t / base for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:45s} {t * 1e3:8.2f} ms/step   ratio {ratios[name]:.3f}")
    # The check alone, timed on a full-size gradient: steadier than the difference of two step times.
    strategy = engines["engine with the non-finite check"].strategy
    for parameter in strategy.module.parameters():  # a full-size gradient where the engine holds it
        parameter.grad = torch.randn_like(parameter)
    check = interleaved({"check": lambda: bool(torch.isfinite(strategy.global_grad_norm()))},
                        args.rounds * 5, args.steps)["check"]
    print(f"the check alone (norm pass + host sync)       {check * 1e3:8.2f} ms/step   "
          f"{check / base:.2%} of a step")
    save("non_finite_cost", {"workload": f"MLP 4.2M params, global batch {GLOBAL_BATCH}, micro {MICRO}, AdamW, "
                                         "1 process, train_batch, no clipping",
                             "ms_per_step": {k: v * 1e3 for k, v in times.items()}, "ratio_vs_no_check": ratios,
                             "check_alone_ms": check * 1e3, "check_fraction_of_step": check / base}, record=args.record)


if __name__ == "__main__":
    main()
