"""Expert parallelism against none: time per step, the all-to-all's bytes, the bytes each rank holds.

    python -m launch --nproc-per-node 2 bench/expert_parallel.py [--rounds 5] [--steps 2]

Workload: the Hugging Face Mixtral of bench/moe.py (transformers, random init, fp32, 4 layers,
hidden 128, 8 experts top-2, ``m(**b).loss`` with its load-balancing term, global balance), a
global batch of 8 rows of 128 tokens on 2 ranks (data 2), accumulation 2, AdamW, ZeRO 0, gloo.
Variants: ``expert_parallel: {size: 2}`` (each rank holds 4 of the 8 experts of every layer, tokens
dispatched by all-to-all) against none (every rank holds every expert), and a second copy of the
baseline whose ratio is the run's noise floor. Times are interleaved medians, the slowest rank's
(bench/common.py); tokens/s counts the global batch's tokens.

The engine against the same expert parallelism written by hand (issue 44): both with each
micro-batch's own load-balancing term (``moe.load_balance: micro_batch``, what a hand loop computes),
the hand loop reusing the engine's dispatch (``engine.experts.parallel.ExpertShards``: each rank keeps
its half of the experts, tokens go to their expert's rank by all-to-all), DDP with ``no_sync`` on the
dense part, the experts' gradients divided by the data ranks (their tokens came from every rank):
engine / hand is the engine's own overhead, at equal memory (the same parameters, gradients and
AdamW state per rank), in wall-clock time (slowest rank) and in CPU time (mean over ranks: what each
computes, without waiting for a core or a peer).

Bytes, counted (not timed): what one optimizer step's all-to-alls send to other ranks (the rows of
``all_to_all_single`` whose destination is another rank, the count exchanges included; forward,
backward and the counting forward of the global balance), and the parameters plus optimizer state
one rank holds (distinct storages, ``engine.memory.storage_bytes``). Results:
bench/results/expert_parallel_w<W>.json (rank 0 prints a table).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import argparse
import contextlib
import copy

import torch
import torch.distributed as dist

import engine
from bench.common import adamw, add_record_argument, cpu_interleaved, interleaved, save
from bench.moe import SEQ, VOCAB, hf_loss, mixtral
from torch.nn.parallel import DistributedDataParallel

from engine.adapters.torch_internals import ddp_ignore
from engine.distributed.mesh import MeshGroups, MeshLayout
from engine.distributed.process_group import init_distributed, strip_local_rank_arg
from engine.experts.parallel import ExpertShards
from engine.memory import format_bytes, storage_bytes

GLOBAL_BATCH, ACCUMULATION = 8, 2
VARIANTS = {"none": 1, "none, second copy (noise floor)": 1, "expert 2": 2}
ENGINE_TERM, HAND_TERM = "engine expert 2, micro-batch term", "hand expert 2, micro-batch term"


def lm_batch() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


@contextlib.contextmanager
def counted_all_to_all(total: list[int]):
    """Inside: every ``dist.all_to_all_single`` adds to ``total[0]`` the bytes it sends to other ranks."""
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        size = dist.get_world_size(group)
        me = dist.get_group_rank(group, dist.get_rank()) if group is not None else dist.get_rank()
        rows = input_split_sizes or [input.shape[0] // size] * size
        row_bytes = input[:1].numel() * input.element_size() if input.shape[0] else 0
        total[0] += sum(count for rank, count in enumerate(rows) if rank != me) * row_bytes
        return original(output, input, output_split_sizes, input_split_sizes, group, async_op)

    dist.all_to_all_single = counting
    try:
        yield
    finally:
        dist.all_to_all_single = original


def hand_expert_parallel(model, mine: dict):
    """One optimizer step of expert parallelism written by hand (see the module docstring)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = MeshLayout(world, expert=world)
    shards = ExpertShards(MeshGroups(layout, "cpu", rank), layout, rank)
    shards.apply(model, None)
    ddp_ignore(model, shards.names())
    ddp = DistributedDataParallel(model)
    optimizer = adamw(model.parameters())
    rows = mine["input_ids"].shape[0] // ACCUMULATION
    micro_batches = [{key: value[i * rows:(i + 1) * rows] for key, value in mine.items()} for i in range(ACCUMULATION)]

    def step():
        for i, micro_batch in enumerate(micro_batches):
            with ddp.no_sync() if i < ACCUMULATION - 1 else contextlib.nullcontext():
                (ddp(**micro_batch).loss / ACCUMULATION).backward()
        for held in shards.parameters:
            held.param.grad.div_(world)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def held_by_this_rank(eng) -> int:
    """Parameters and optimizer state of this rank (distinct storages)."""
    state = [value for entries in eng.optimizer.state.values() for value in entries.values() if torch.is_tensor(value)]
    return storage_bytes(list(eng.module.parameters()) + state)


def main(argv=None) -> None:
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)
    model, batch = mixtral(), lm_batch()
    share = GLOBAL_BATCH // info.world_size
    mine = {key: value[info.rank * share:(info.rank + 1) * share] for key, value in batch.items()}
    engines, sent, held = {}, {}, {}
    for name, expert in VARIANTS.items():
        eng = engine.initialize(copy.deepcopy(model), {
            "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": ACCUMULATION,
            "expert_parallel": {"size": expert}}, optimizer=adamw)
        eng.train_batch(mine, hf_loss)  # optimizer state exists from here on
        total = [0]
        with counted_all_to_all(total):
            eng.train_batch(mine, hf_loss)
        sent[name], held[name] = total[0], held_by_this_rank(eng)
        engines[name] = eng
    runs = {name: (lambda eng=eng: eng.train_batch(mine, hf_loss)) for name, eng in engines.items()}
    per_micro_batch = engine.initialize(copy.deepcopy(model), {
        "train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": ACCUMULATION,
        "expert_parallel": {"size": 2}, "moe": {"load_balance": "micro_batch"}}, optimizer=adamw)
    runs[ENGINE_TERM] = lambda: per_micro_batch.train_batch(mine, hf_loss)
    runs[HAND_TERM] = hand_expert_parallel(copy.deepcopy(model), mine)
    times = interleaved(runs, rounds=args.rounds, steps=args.steps, warmup=1, distributed=True)
    cpu = cpu_interleaved({name: runs[name] for name in (ENGINE_TERM, HAND_TERM)}, args.rounds, args.steps)
    tokens = GLOBAL_BATCH * SEQ
    rows = [{"variant": name, "expert_size": expert, "seconds": times[name], "tokens_per_second": tokens / times[name],
             "ratio": times["none"] / times[name], "all_to_all_bytes_sent_per_step": sent[name],
             "parameter_and_optimizer_bytes_per_rank": held[name], "held_ratio": held[name] / held["none"]}
            for name, expert in VARIANTS.items()]
    if info.rank == 0:
        print(f"{'variant':34} {'s/step':>8} {'tokens/s':>9} {'speed':>6} {'all-to-all sent':>16} "
              f"{'params+optimizer':>17} {'ratio':>6}")
        for row in rows:
            print(f"{row['variant']:34} {row['seconds']:8.3f} {row['tokens_per_second']:9.0f} {row['ratio']:6.3f} "
                  f"{format_bytes(row['all_to_all_bytes_sent_per_step']):>16} "
                  f"{format_bytes(row['parameter_and_optimizer_bytes_per_rank']):>17} {row['held_ratio']:6.2f}")
        against_hand, cpu_against_hand = times[ENGINE_TERM] / times[HAND_TERM], cpu[ENGINE_TERM] / cpu[HAND_TERM]
        print(f"{ENGINE_TERM}: {times[ENGINE_TERM]:.3f} s/step, CPU {cpu[ENGINE_TERM]:.3f} s/step; {HAND_TERM}: "
              f"{times[HAND_TERM]:.3f} s/step, CPU {cpu[HAND_TERM]:.3f} s/step; engine / hand {against_hand:.3f}, "
              f"in CPU time {cpu_against_hand:.3f}")
        print("results:", save(f"expert_parallel_w{info.world_size}", {
            "rounds": args.rounds, "steps": args.steps, "global_batch": GLOBAL_BATCH, "accumulation": ACCUMULATION,
            "sequence": SEQ, "rows": rows, "against_hand": {
                "engine_seconds": times[ENGINE_TERM], "hand_seconds": times[HAND_TERM], "ratio": against_hand,
                "engine_cpu_seconds": cpu[ENGINE_TERM], "hand_cpu_seconds": cpu[HAND_TERM],
                "cpu_ratio": cpu_against_hand}}, record=args.record))
    for eng in (*engines.values(), per_micro_batch):
        eng.close()


if __name__ == "__main__":
    main()
