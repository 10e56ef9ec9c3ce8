"""The engine's own time in a pipeline window: ``train_batch`` outside the stages' schedule run.

    python -m launch --nproc-per-node 2 bench/pipeline_overhead.py [--steps 40]

Workload: bench/pipeline.py's (the 4.2M-parameter MLP in two stages, global batch 64 in 8 micro-batches,
AdamW, fp32, gloo), under GPipe and 1F1B. Each ``train_batch`` is timed whole, and the time inside
``StageSchedules.run`` (the stages' order on torch's runtime, which the engine hands the window to) is
subtracted: what is left is the window executor's and machine's work — the window's cut, the last stage's
loss reads are inside the run —, the window statistics' reduction, the boundary and the optimizer step.
A change to the window executor shows here without the schedule's own spread, which on a 2-core VM moves
bench/pipeline.py's ratios by several percent run to run. Rank 0 prints the medians; nothing is saved.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import torch.distributed as dist

from bench.common import GLOBAL_BATCH, batch, start_ranks
from bench.pipeline import engine_run, loss_fn


def window_times(eng, data, steps: int) -> tuple[float, float, float]:
    """Medians over ``steps`` windows, in ms: ``train_batch``, its schedule run, and the rest."""
    schedules = eng.strategy.schedules
    run, inside = schedules.run, [0.0]

    def timed(*args, **kwargs):
        began = time.perf_counter()
        run(*args, **kwargs)
        inside[0] += time.perf_counter() - began

    schedules.run = timed
    whole, scheduled = [], []
    for _ in range(steps):
        inside[0] = 0.0
        began = time.perf_counter()
        eng.train_batch(data, loss_fn)
        whole.append(time.perf_counter() - began)
        scheduled.append(inside[0])
    rest = [a - b for a, b in zip(whole, scheduled)]
    return tuple(1e3 * sorted(values)[len(values) // 2] for values in (whole, scheduled, rest))


def main(argv=None):
    args, info, model, _ = start_ranks(__doc__.splitlines()[0], rounds=1, steps=40, argv=argv)
    data = batch(GLOBAL_BATCH)
    results = {}
    for schedule in ("gpipe", "1f1b"):
        step, eng = engine_run(copy.deepcopy(model), data, schedule)
        for _ in range(3):  # the schedule built, the optimizer's state made
            step()
        dist.barrier()
        results[schedule] = window_times(eng, data, args.steps)
        eng.close()
    if info.rank == 0:
        print(f"{'schedule':10s} {'train_batch':>12s} {'schedule run':>13s} {'the rest':>9s}  (ms, medians)")
        for schedule, (whole, scheduled, rest) in results.items():
            print(f"{schedule:10s} {whole:12.2f} {scheduled:13.2f} {rest:9.3f}")


if __name__ == "__main__":
    main()
