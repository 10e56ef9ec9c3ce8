"""What one synchronisation a window costs a pipeline: the schedule and optimizer step the engine
runs, without its window logic, with and without one small all-gather before the step.

    python -m launch --nproc-per-node 2 bench/pipeline_sync.py [--rounds 24] [--steps 3]

Workload: bench/pipeline.py's (the 4.2M-parameter MLP in two stages, global batch 64 in 8
micro-batches, AdamW, fp32, gloo, 1F1B). Variants, alternating round by round, the slowest
rank's time counting: the hand-driven schedule; the engine's ``train_batch``; the engine's
strategy running the same schedule (its stages, its loss callback returning the micro-batch's
mean / 8) then its optimizer step, with nothing else; the same with one all-gather of 8
numbers before the step (what an exact window must do: no stage steps before every stage's
gradient is known finite). Rank 0 prints the table; nothing is saved.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import torch
from torch.distributed.pipelining import Schedule1F1B

from bench.common import GLOBAL_BATCH, batch, interleaved, mlp, start_ranks
from bench.pipeline import ACCUMULATION, engine_run, hand
from engine.distributed.collectives import small_sum


def schedule_and_step(model, data, synchronised: bool):
    """The engine's strategy: its schedule, then (``synchronised``) one small all-gather, then its step."""
    _, eng = engine_run(model, data, "1f1b")
    strategy = eng.strategy
    x, y = data
    labels = y.chunk(ACCUMULATION)

    def loss_fn(outputs, index):
        return torch.nn.functional.mse_loss(outputs, labels[int(index[0])]) / ACCUMULATION

    def step():
        strategy.schedules.run(x, ACCUMULATION, loss_fn, train=True)
        if synchronised:
            small_sum(torch.zeros(8, dtype=torch.float64))
        strategy.optimizer_step()
        strategy.zero_grad()

    return step


def main(argv=None):
    args, info, _, _ = start_ranks(__doc__.splitlines()[0], rounds=24, argv=argv)
    model, data = mlp(), batch(GLOBAL_BATCH)
    runs = {"hand 1F1B": hand(copy.deepcopy(model), data, Schedule1F1B, info.rank),
            "engine 1F1B (train_batch)": engine_run(copy.deepcopy(model), data, "1f1b")[0],
            "schedule + step": schedule_and_step(copy.deepcopy(model), data, synchronised=False),
            "schedule + one all-gather + step": schedule_and_step(copy.deepcopy(model), data, synchronised=True)}
    times = interleaved(runs, args.rounds, args.steps, warmup=1, distributed=True)
    if info.rank == 0:
        print(f"{'variant':36s} {'ms/step':>8s} {'vs hand':>8s}")
        for name, seconds in times.items():
            print(f"{name:36s} {seconds * 1e3:8.1f} {seconds / times['hand 1F1B']:8.3f}")


if __name__ == "__main__":
    main()
