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
* checksums: what the save spends on the checksum of every file (each rank reads back and
  checksums its share of the files; a load checks the same), median of ``--saves``, against
  the save's time; on the LM example and on bench.common's 4.2M-parameter MLP with AdamW
  (a 50 MB checkpoint).

Results: bench/results/checkpoint_cost_w<ranks>.json (rank 0 prints a table).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import torch
import torch.distributed as dist

import engine
from bench.common import add_record_argument, batch, interleaved, mlp, save, shared_temp_directory
from bench.common import mse as bench_mse
from engine.state.checkpoint import damaged_files, verify_checkpoint
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


def checksum_time(path, info, repeats: int) -> float:
    """Median (slowest rank) of reading back and checksumming this rank's share of ``path``'s
    files: the work a save adds for the manifest's checksums (and a load's check)."""
    manifest = verify_checkpoint(path)
    times = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        damaged_files(path, manifest, info.rank, info.world_size)
        times.append(slowest(time.perf_counter() - start))
    return statistics.median(times)


def mlp_checkpoint_cost(directory, info, repeats: int):
    """(save seconds, checksum seconds, bytes) for bench.common's MLP with AdamW after one step."""
    eng = engine.initialize(mlp(), {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 64 // info.world_size,
                                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
    x, y = batch(64)
    share = 64 // info.world_size
    eng.train_batch((x[info.rank * share:(info.rank + 1) * share], y[info.rank * share:(info.rank + 1) * share]),
                    bench_mse)
    saves = []
    path = Path(directory) / "mlp"
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        eng.save_checkpoint(path)
        saves.append(slowest(time.perf_counter() - start))
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    checksum_s = checksum_time(path, info, repeats)
    eng.close()
    return statistics.median(saves), checksum_s, size


def main(argv=None):
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2, help="steps per round and variant")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--agreements", type=int, default=200)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)

    config = engine.load_config(DEFAULT_CONFIG, ["monitor.enabled=false"])
    model, dataset = lm_workload(config)
    directory = shared_temp_directory("checkpoint_cost_", info.rank)
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
    checksum_s = checksum_time(path, info, args.saves)
    mlp_save_s, mlp_checksum_s, mlp_size = mlp_checkpoint_cost(directory, info, args.saves)

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
        "ms_checksums_per_save": checksum_s * 1e3,
        "checksums_vs_save": checksum_s / save_s,
        "mlp_ms_per_save": mlp_save_s * 1e3,
        "mlp_ms_checksums_per_save": mlp_checksum_s * 1e3,
        "mlp_checksums_vs_save": mlp_checksum_s / mlp_save_s,
        "mlp_checkpoint_bytes": mlp_size,
    }
    if info.rank == 0:
        print(f"{'step (no checkpoint section)':40s} {step * 1e3:9.1f} ms")
        print(f"{'step, stop signals watched':40s} {times['step, stop signals watched'] * 1e3:9.1f} ms"
              f"   ratio {results['watched_vs_plain']:.3f}")
        print(f"{'stop-signal agreement alone':40s} {agreement_s * 1e3:9.3f} ms   "
              f"{results['agreement_vs_step'] * 100:.3f}% of a step")
        print(f"{'automatic save':40s} {save_s * 1e3:9.1f} ms   {results['save_vs_step']:.2f} steps, "
              f"{size / 1e6:.2f} MB")
        print(f"{'checksums within that save':40s} {checksum_s * 1e3:9.1f} ms   "
              f"{results['checksums_vs_save']:.1%} of the save")
        print(f"{'MLP 4.2M, AdamW: save':40s} {mlp_save_s * 1e3:9.1f} ms   {mlp_size / 1e6:.1f} MB")
        print(f"{'MLP 4.2M, AdamW: checksums within it':40s} {mlp_checksum_s * 1e3:9.1f} ms   "
              f"{results['mlp_checksums_vs_save']:.1%} of the save")
        params = sum(p.numel() for p in model.parameters())
        save(f"checkpoint_cost_w{info.world_size}", {
            "workload": f"examples/train_lm.py GPT ({params / 1e3:.0f}k parameters), configs/lm_tiny.yaml "
                        f"(global batch 64 lines, accumulation {plain.plan.gradient_accumulation_steps} on "
                        f"{info.world_size} rank(s)), AdamW, monitor off",
            "rounds": args.rounds, "steps_per_round": args.steps, "saves": args.saves, **results}, record=args.record)
    plain.close()
    watched.close()
    if info.rank == 0:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
