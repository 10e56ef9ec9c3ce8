"""What automatic checkpoints every N steps cost a run on the language-model example: the
background save (``checkpoint.async: true``, the default) against the blocking one it
replaces, both against no save.

    python bench/async_checkpoint.py [--every 10] [--rounds 5]          # one process
    python -m launch --nproc-per-node 2 bench/async_checkpoint.py

Workload: examples/train_lm.py's GPT with configs/lm_tiny.yaml (global batch 64 lines, AdamW,
a (sum, count) token loss), monitor off. Three engines train their own copies, each with
``checkpoint.dir`` set (so every variant pays the same stop-signal agreement): no periodic
save; ``every_steps: N`` blocking; ``every_steps: N`` in the background. A round is N
optimizer steps of one variant, starting with the step whose boundary saves, and for the
background variant it ends with ``eng.checkpoints.wait()``, so a write still running at the
round's end is charged to it and never overlaps another variant's round. The variants
alternate round by round (rotating order); the slowest rank's time counts; medians over rounds.

Results: bench/results/async_checkpoint_w<ranks>.json (rank 0 prints a table).
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

import engine
from bench.checkpoint_cost import endless, lm_workload, slowest
from bench.common import add_record_argument, save, shared_temp_directory
from engine.distributed.process_group import init_distributed, strip_local_rank_arg
from examples.train_lm import DEFAULT_CONFIG, token_loss

VARIANTS = ("no save", "blocking save", "background save")


def main(argv=None):
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10, help="optimizer steps between saves")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --every steps per variant")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)

    config = engine.load_config(DEFAULT_CONFIG, ["monitor.enabled=false"])
    model, dataset = lm_workload(config)
    directory = shared_temp_directory("async_checkpoint_", info.rank)
    settings = {"no save": {}, "blocking save": {"every_steps": args.every, "async": False},
                "background save": {"every_steps": args.every, "async": True}}
    engines, data = {}, {}
    for name in VARIANTS:
        section = {"dir": os.path.join(directory, name.replace(" ", "_")), "keep_last": 2, **settings[name]}
        engines[name] = engine.initialize(copy.deepcopy(model), engine.load_config(config, {"checkpoint": section}),
                                          loss_fn=token_loss)
        data[name] = endless(engines[name], dataset)
        for _ in range(args.every - 1):  # warm-up; every round then starts with the step that saves
            engines[name].train_batch(next(data[name]))
        engines[name].checkpoints.wait()

    samples = {name: [] for name in VARIANTS}
    for index in range(args.rounds):
        for name in VARIANTS[index % 3:] + VARIANTS[:index % 3]:
            eng = engines[name]
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            for _ in range(args.every):
                eng.train_batch(next(data[name]))
            eng.checkpoints.wait()
            samples[name].append(slowest((time.perf_counter() - start) / args.every))
    per_step = {name: statistics.median(values) for name, values in samples.items()}
    host_bytes = engines["background save"].checkpoints.host_bytes
    checkpoint = Path(engines["blocking save"].autosave.dir)
    size = max(sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) for path in checkpoint.iterdir())
    for eng in engines.values():
        eng.close()

    base = per_step["no save"]
    results = {f"ms_per_step_{name.replace(' ', '_')}": value * 1e3 for name, value in per_step.items()}
    results.update({f"{name.replace(' ', '_')}_vs_no_save": value / base for name, value in per_step.items()})
    results.update({"every_steps": args.every, "rounds": args.rounds, "checkpoint_bytes": size,
                    "host_bytes_per_rank": host_bytes, "load_average_1min": os.getloadavg()[0]})
    if info.rank == 0:
        print(f"save every {args.every} steps, {args.rounds} rounds, {size / 1e6:.2f} MB per checkpoint, "
              f"{host_bytes / 1e6:.2f} MB host copy per rank, load {os.getloadavg()[0]:.1f}")
        for name in VARIANTS:
            print(f"{name:20s} {per_step[name] * 1e3:9.1f} ms/step   × {per_step[name] / base:.3f}")
        params = sum(p.numel() for p in model.parameters())
        save(f"async_checkpoint_w{info.world_size}", {
            "workload": f"examples/train_lm.py GPT ({params / 1e3:.0f}k parameters), configs/lm_tiny.yaml "
                        f"(global batch 64 lines, accumulation {engines['no save'].plan.gradient_accumulation_steps} "
                        f"on {info.world_size} rank(s)), AdamW, monitor off", **results}, record=args.record)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
