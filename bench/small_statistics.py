"""What summing a few numbers over the ranks costs: ``dist.all_reduce`` against one all-gather and
a sum in rank order (``engine.distributed.collectives.small_sum``, which the window statistics, the
gradient norm and the overflow vote use), each after a step of work, as in training (so the
ranks arrive a little apart, as they do at a window's end).

    python -m launch --nproc-per-node 2 bench/small_statistics.py [--rounds 30] [--steps 20]

Each variant, ``steps`` times per measurement: a 512×1024 by 1024×1024 matrix product, then the
reduction of 12 float64 numbers (a window's statistics, the squared norm, a batch fingerprint). Reported: the
milliseconds the reduction adds to a step over the work alone, the median over rounds, the
slowest rank's. Results: bench/results/small_statistics_w<W>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from bench.common import interleaved, save, start_ranks
from engine.distributed.collectives import small_sum

NUMBERS = 12


def main(argv=None):
    args, info, _, _ = start_ranks(__doc__.splitlines()[0], rounds=30, argv=argv, steps=20)
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    stats = torch.arange(NUMBERS, dtype=torch.float64)

    def work():
        return a @ b

    def all_reduce():
        work()
        dist.all_reduce(stats.clone())

    def gathered_sum():
        work()
        small_sum(stats.clone())

    times = interleaved({"work alone": work, "work, then dist.all_reduce": all_reduce,
                         "work, then small_sum (all-gather)": gathered_sum}, args.rounds, args.steps, distributed=True)
    if info.rank != 0:
        return
    base = times["work alone"]
    added = {name: (t - base) * 1e3 for name, t in times.items() if name != "work alone"}
    print(f"work alone: {base * 1e3:.2f} ms per step ({info.world_size} ranks, {NUMBERS} float64 numbers)")
    for name, ms in added.items():
        print(f"{name:36s} adds {ms:6.3f} ms")
    save(f"small_statistics_w{info.world_size}", {
        "workload": f"{NUMBERS} float64 summed over {info.world_size} ranks after a 512x1024x1024 matmul, gloo, "
                    f"{args.rounds} rounds x {args.steps} steps, median, slowest rank",
        "work_ms": base * 1e3, "added_ms": added}, record=args.record)


if __name__ == "__main__":
    main()
