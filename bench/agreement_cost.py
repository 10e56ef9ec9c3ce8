"""What the ranks' position check costs per optimizer step: before the backward that closes a
window (at ZeRO-0 the window's only check) and, at ZeRO-3, before every forward too (its
gathers) the ranks compare where they are, one all-gather of five integers on the gloo control
group. The engine as it is against the same engine with the check skipped, in one run, at
ZeRO-0 and ZeRO-3; and the all-gather alone.

    python -m launch --nproc-per-node 2 bench/agreement_cost.py [--rounds 12] [--steps 3]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import torch.distributed as dist

import engine
from bench.common import GLOBAL_BATCH, interleaved, mse, save, start_ranks
from engine.distributed.collectives import positions_of_ranks

MICRO = 8


def unchecked(eng):
    """The engine without the position check (what it did before the check existed). Benchmark only."""
    eng.windows.agree = lambda point: None
    return eng


def main(argv=None):
    args, info, model, data = start_ranks(__doc__.splitlines()[0], rounds=12, argv=argv)
    variants, engines = {}, []
    for stage in (0, 3):
        config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
                  "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        checked = engine.initialize(copy.deepcopy(model), config)
        plain = unchecked(engine.initialize(copy.deepcopy(model), config))
        engines += [checked, plain]
        variants[f"stage {stage}, no check"] = lambda e=plain: e.train_batch(data, mse)
        variants[f"stage {stage}, with the check"] = lambda e=checked: e.train_batch(data, mse)
    times = interleaved(variants, args.rounds, args.steps, distributed=True)
    alone = []
    for _ in range(200):
        start = time.perf_counter()
        positions_of_ranks([0, 1, 2, 3, 4], "bench")
        alone.append(time.perf_counter() - start)
    alone_s = statistics.median(alone)
    accumulation = GLOBAL_BATCH // (MICRO * info.world_size)
    if info.rank == 0:
        for name, t in times.items():
            base = times[name.replace("with the check", "no check")]
            print(f"{name:28s} {t * 1e3:8.1f} ms/step   ratio {t / base:.3f}")
        print(f"{'the all-gather alone':28s} {alone_s * 1e3:8.3f} ms; per step: 1 at ZeRO-0, "
              f"{accumulation + 1} at ZeRO-3 (accumulation {accumulation})")
        save(f"agreement_cost_w{info.world_size}", {
            "workload": f"MLP 4.2M params, global batch {GLOBAL_BATCH}, micro {MICRO}, accumulation {accumulation}, "
                        f"AdamW, {info.world_size} ranks, gloo, train_batch",
            "ms_per_step": {k: v * 1e3 for k, v in times.items()}, "ms_per_agreement": alone_s * 1e3,
            "agreements_per_step": {"stage 0": 1, "stage 3": accumulation + 1}}, record=args.record)
    for eng in engines:
        unchecked(eng).close()
    dist.barrier()


if __name__ == "__main__":
    main()
