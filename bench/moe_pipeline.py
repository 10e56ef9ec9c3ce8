"""Global-batch load balancing under a pipeline: what learning the window's router counts costs.

    python -m launch --nproc-per-node 2 bench/moe_pipeline.py [--rounds 5] [--steps 2] [--schedule gpipe]

Workload: bench/moe.py's Mixtral (4 layers, hidden 128, 8 experts top-2, router_aux_loss_coef 0.02, fp32),
its global batch of 16 rows of 128 tokens in 4 micro-batches, AdamW, ``m(**b).loss``, cut into one pipeline
stage per rank (1F1B, or GPipe with ``--schedule gpipe``). Variants: ``moe.load_balance: global`` (1F1B:
a counting schedule of every micro-batch without gradients, one small sum of the stages' router counts,
then the training schedule; GPipe: the training schedule's forwards count, the sum runs between its
forwards and its backwards: exact both), and the same model with ``output_router_logits`` false (no term,
nothing counted: the floor any way of counting could reach), plus a second copy of it whose ratio is the
run's noise floor. Every row of one schedule holds that schedule's memory profile (GPipe: every
micro-batch's activations until its backwards, with or without the term). Interleaved medians
(bench/common.py). Results: bench/results/moe_pipeline_w<W>[_gpipe].json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import argparse
import copy

import torch

import engine
from bench.common import adamw, add_record_argument, interleaved, save
from bench.moe import ACCUMULATION, GLOBAL_BATCH, SEQ, hf_loss, lm_batch, mixtral
from engine.distributed.process_group import init_distributed, strip_local_rank_arg

VARIANTS = {"without the term": False, "without the term, second copy (noise floor)": False, "global": True}


def main(argv=None) -> None:
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe"))
    add_record_argument(parser)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)
    batch = lm_batch()  # every stage of the one replica gets the whole batch
    engines = {}
    for name, routed in VARIANTS.items():
        model = mixtral()
        model.config.output_router_logits = routed
        engines[name] = engine.initialize(copy.deepcopy(model), {
            "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": ACCUMULATION,
            "pipeline": {"stages": info.world_size, "schedule": args.schedule}}, optimizer=adamw)
    times = interleaved({name: (lambda eng=eng: eng.train_batch(batch, hf_loss)) for name, eng in engines.items()},
                        rounds=args.rounds, steps=args.steps, warmup=1, distributed=True)
    base = times["without the term"]
    rows = [{"variant": name, "seconds": seconds, "ratio": seconds / base} for name, seconds in times.items()]
    if info.rank == 0:
        print(f"pipeline of {info.world_size} stages, {args.schedule}; global counts: "
              f"{engines['global'].experts.global_counts}")
        for row in rows:
            print(f"{row['variant']:45} {row['seconds']:8.3f} s/step {row['ratio']:6.3f}")
        suffix = "" if args.schedule == "1f1b" else f"_{args.schedule}"
        print("results:", save(f"moe_pipeline_w{info.world_size}{suffix}", {
            "schedule": args.schedule, "global_counts": engines["global"].experts.global_counts, "rounds": args.rounds, "steps": args.steps, "global_batch": GLOBAL_BATCH, "accumulation": ACCUMULATION,
            "sequence": SEQ, "rows": rows}, record=args.record))


if __name__ == "__main__":
    main()
