"""Activation checkpointing chosen by measurement (``activation_checkpointing: auto``), one process
on CPU, the LM example (examples/gpt.py, 4 layers, width 64, 192 tokens, global batch 32):

    python -m bench.checkpointing_choice [--rounds 6] [--repeats 3] [--fits-without 2]

1. ``explore`` without a memory limit: both series (checkpointing off / on) per micro size,
   samples/s and the measured CPU peak (engine.memory);
2. a limit that lets checkpointing-off fit up to micro size ``--fits-without`` (default 2) only:
   ``explore`` with the lever and without it (then the choice is among the sizes that fit off);
3. the two choices trained interleaved: steady-state time per step, as a ratio.

Results: bench/results/checkpointing_choice.json (``python -m engine explore`` plots such series).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools

import torch

import engine
from bench.common import add_record_argument, interleaved, save
from bench.model_transforms import lm, lm_loss, tokens
from engine.autotune.report import format_table

GLOBAL = 32


def explored(model, batch, limit=None, lever=True, repeats=3):
    config = {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": "explore",
              "activation_checkpointing": "auto" if lever else {"enabled": False},
              **({"auto_memory_limit": float(limit)} if limit else {})}
    eng = engine.initialize(copy.deepcopy(model), config, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3))  # stateless: peaks do not grow after step 1
    eng.micro_batch_tuner.repeats = repeats
    eng.micro_batch_tuner.explore(eng, batch, lm_loss)
    return eng


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="timed windows per explore candidate")
    parser.add_argument("--fits-without", type=int, default=2, choices=(1, 2, 4, 8, 16),
                        help="the largest micro size the limit lets fit without checkpointing")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, batch = lm(layers=4, width=64), tokens(GLOBAL)

    free = explored(model, batch, repeats=args.repeats).micro_batch_tuner.explored
    print("no limit:\n" + format_table(free))
    peak = {(row.micro_batch_size, row.checkpointing): row.peak_memory_bytes for row in free}
    limit = (peak[(args.fits_without, False)] + peak[(2 * args.fits_without, False)]) // 2
    chosen = {}
    for name, lever in (("with the checkpointing lever", True), ("micro size only", False)):
        eng = explored(model, batch, limit, lever, args.repeats)
        chosen[name] = eng
        print(f"\nlimit {limit:,} B, {name}:\n" + format_table(eng.micro_batch_tuner.explored))

    times = interleaved({name: functools.partial(eng.train_batch, batch, lm_loss) for name, eng in chosen.items()},
                        args.rounds, 1)
    ratio = times["with the checkpointing lever"] / times["micro size only"]
    for name, eng in chosen.items():
        print(f"{name:30s} micro {eng.plan.train_micro_batch_size_per_gpu:3d}, checkpointing "
              f"{eng.micro_batch_tuner.checkpointing}: {times[name] * 1e3:8.1f} ms/step")
    print(f"with the lever / micro size only: {ratio:.3f}")
    save("checkpointing_choice", {
        "workload": f"examples/gpt.py, 4 layers, width 64, 192 tokens, global batch {GLOBAL}, SGD, 1 process, "
                    "1 thread",
        "no_limit": [dataclasses.asdict(row) for row in free], "limit_bytes": limit,
        "fits_without_checkpointing": args.fits_without,
        "choices": {name: {"micro": eng.plan.train_micro_batch_size_per_gpu,
                           "checkpointing": eng.micro_batch_tuner.checkpointing,
                           "explored": [dataclasses.asdict(row) for row in eng.micro_batch_tuner.explored],
                           "ms_per_step": times[name] * 1e3} for name, eng in chosen.items()},
        "ratio_with_lever_over_micro_size_only": ratio}, record=args.record)


if __name__ == "__main__":
    main()
