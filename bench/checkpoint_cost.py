"""Automatic checkpoints on the language-model example: the time of a save against a step's,
and what watching for stop signals adds to every step.

    python -m launch --nproc-per-node 2 bench/checkpoint_cost.py [--rounds 10] [--steps 2] [--saves 5]
    python bench/checkpoint_cost.py                                    # one process

Workload: examples/train_lm.py's GPT with configs/lm_tiny.yaml (global batch 64 lines,
accumulation 4 over all ranks, AdamW, a (sum, count) token loss), monitor off. Rows:

* step: ``train_batch`` without a ``checkpoint`` section, against the same with one
  (``checkpoint.dir`` set, no periodic save): the difference is the stop-signal agreement
  at every boundary. The two engines train their own copies and alternate round by round;
  the slowest rank's time counts.
* the agreement alone: ``StopSignals.agreed()`` (one all-reduce of one integer on the gloo
  control group), median of many calls.
* save: an automatic save (``step_<N>`` with the data position, keep_last 1), median of
  ``--saves``; its size on disk.

Results: bench/results/checkpoint_cost_w<ranks>.json (rank 0 prints a table).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import torch
import torch.distributed as dist

import engine
from bench.common import interleaved, save
from engine.distributed.process_group import init_distributed, strip_local_rank_arg
from examples.train_lm import (DEFAULT_CONFIG, DEFAULT_CORPUS, CharTokenizer, Lines, build_model,
                               collate, split_lines, token_loss)


def lm_workload(config):
    """The example's model and training lines, as examples/train_lm.py builds them."""
    text = DEFAULT_CORPUS.read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    lines, _ = split_lines(text, config.constants["EVAL_HOLDOUT_EVERY"])
    torch.manual_seed(config.seed)
    model = build_model(SimpleNamespace(hf_model=None), config.constants, tokenizer.vocab_size)
    return model, Lines(lines, tokenizer, config.constants["BLOCK_SIZE"])


def endless(eng, dataset):
    batches = eng.batches(dataset, seed=0, collate_fn=collate)
    while True:
        yield from batches


def slowest(seconds: float) -> float:
    if not dist.is_initialized():
        return seconds
    value = torch.tensor(seconds)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def main(argv=None):
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2, help="steps per round and variant")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--agreements", type=int, default=200)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)

    config = engine.load_config(DEFAULT_CONFIG, ["monitor.enabled=false"])
    model, dataset = lm_workload(config)
    directory = tempfile.mkdtemp(prefix="checkpoint_cost_") if info.rank == 0 else None
    if dist.is_initialized():
        box = [directory]
        dist.broadcast_object_list(box, src=0)
        directory = box[0]
    plain = engine.initialize(copy.deepcopy(model), config, loss_fn=token_loss)
    watched = engine.initialize(copy.deepcopy(model), engine.load_config(
        config, {"checkpoint.dir": directory, "checkpoint.keep_last": 1}), loss_fn=token_loss)
    plain_data, watched_data = endless(plain, dataset), endless(watched, dataset)

    times = interleaved({"step": lambda: plain.train_batch(next(plain_data)),
                         "step, stop signals watched": lambda: watched.train_batch(next(watched_data))},
                        args.rounds, args.steps, distributed=dist.is_initialized())

    agreement = []
    for _ in range(args.agreements):
        start = time.perf_counter()
        watched.autosave.stop.agreed()
        agreement.append(time.perf_counter() - start)
    agreement_s = slowest(statistics.median(agreement))

    saves = []
    for _ in range(args.saves):
        watched.train_batch(next(watched_data))  # a new step number each time
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        path = watched.autosave.save(watched)
        saves.append(slowest(time.perf_counter() - start))
    save_s = statistics.median(saves)
    size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())

    step = times["step"]
    results = {
        "ms_per_step": times["step"] * 1e3,
        "ms_per_step_stop_signals_watched": times["step, stop signals watched"] * 1e3,
        "watched_vs_plain": times["step, stop signals watched"] / step,
        "ms_per_stop_signal_agreement": agreement_s * 1e3,
        "agreement_vs_step": agreement_s / step,
        "ms_per_save": save_s * 1e3,
        "save_vs_step": save_s / step,
        "checkpoint_bytes": size,
        "every_100_steps_overhead": save_s / (100 * step),
    }
    if info.rank == 0:
        print(f"{'step (no checkpoint section)':40s} {step * 1e3:9.1f} ms")
        print(f"{'step, stop signals watched':40s} {times['step, stop signals watched'] * 1e3:9.1f} ms"
              f"   ratio {results['watched_vs_plain']:.3f}")
        print(f"{'stop-signal agreement alone':40s} {agreement_s * 1e3:9.3f} ms   "
              f"{results['agreement_vs_step'] * 100:.3f}% of a step")
        print(f"{'automatic save':40s} {save_s * 1e3:9.1f} ms   {results['save_vs_step']:.2f} steps, "
              f"{size / 1e6:.2f} MB")
        params = sum(p.numel() for p in model.parameters())
        save(f"checkpoint_cost_w{info.world_size}", {
            "workload": f"examples/train_lm.py GPT ({params / 1e3:.0f}k parameters), configs/lm_tiny.yaml "
                        f"(global batch 64 lines, accumulation {plain.plan.gradient_accumulation_steps} on "
                        f"{info.world_size} rank(s)), AdamW, monitor off",
            "rounds": args.rounds, "steps_per_round": args.steps, "saves": args.saves, **results})
    plain.close()
    watched.close()
    if info.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
