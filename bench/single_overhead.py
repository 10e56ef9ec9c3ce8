"""Engine overhead in one process: time per optimizer step of the engine (manual loop and
train_batch) against the same training written by hand, in one run.

    python bench/single_overhead.py [--rounds 15] [--steps 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import torch

import engine
from bench.common import add_record_argument, batch, interleaved, mlp, mse, save

GLOBAL_BATCH, MICRO = 64, 16


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1: steadier on a shared 2-core machine)")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model = mlp()
    data = batch(GLOBAL_BATCH)
    accumulation = GLOBAL_BATCH // MICRO
    micro_batches = [(x, y) for x, y in zip(data[0].split(MICRO), data[1].split(MICRO))]

    def hand_loop_on(hand_model):
        hand_opt = torch.optim.AdamW(hand_model.parameters(), lr=1e-4)

        def hand_loop():
            for micro_batch in micro_batches:
                (mse(hand_model, micro_batch) / accumulation).backward()
            hand_opt.step()
            hand_opt.zero_grad(set_to_none=True)

        return hand_loop

    hand_loop = hand_loop_on(copy.deepcopy(model))
    # The same hand loop on a second copy: where the tensors sit in memory alone moves step
    # times by a few percent; this row shows that noise floor.
    control = hand_loop_on(copy.deepcopy(model))

    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    manual = engine.initialize(copy.deepcopy(model), config)
    whole = engine.initialize(copy.deepcopy(model), config)

    def engine_manual():
        for micro_batch in micro_batches:
            manual.backward(mse(manual, micro_batch))
            manual.step()

    def engine_train_batch():
        whole.train_batch(data, mse)

    times = interleaved({"hand": hand_loop, "hand, second copy (noise floor)": control,
                         "engine manual loop": engine_manual, "engine train_batch": engine_train_batch},
                        args.rounds, args.steps)
    ratios = {name: t / times["hand"] for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:32s} {t * 1e3:8.2f} ms/step   ratio {ratios[name]:.3f}")
    save("single_overhead", {"workload": f"MLP 4.2M params, global batch {GLOBAL_BATCH}, micro {MICRO}, "
                                         f"accumulation {accumulation}, AdamW, 1 process",
                             "ms_per_step": {k: v * 1e3 for k, v in times.items()}, "ratio_vs_hand": ratios}, record=args.record)


if __name__ == "__main__":
    main()
