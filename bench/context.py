"""Context parallelism (Ulysses or ring): activation memory per rank against sequence length, and
time per optimizer step of the engine against the same step written by hand (and, for ring, against
ring attention's simplest alternative: keys and values all-gathered).

    python -m launch --nproc-per-node 2 bench/context.py [--method ulysses|ring] [--rounds 6] [--steps 2]

Workload: the shipped GPT (examples/gpt.py: 2 blocks, width 128, 4 heads, vocabulary 256,
fp32), a global batch of 4 rows, 2 micro-batches of 2 rows, right-padded rows of random
lengths, a (sum, count) token loss, SGD, gloo, context 2 on 2 ranks (data 1).

Memory: the bytes a micro-batch's forward saves for the backward (distinct storages, the
parameters excluded: ``engine.memory``'s way of counting) on one rank, for the whole sequence
in one process (context 1) and for one rank's part under context 2, per sequence length.

Time: the engine (``context_parallel: {size: 2}``) against a hand loop that does the same with
PyTorch directly — slices each row's head and tail chunks, numbers their positions, wraps the
model's SDPA in the same exchange (``engine.context.ulysses.UlyssesExchange``'s all-to-all, or
``engine.context.ring.RingExchange``'s ring attention, so that only the engine's own overhead is in
the ratio), backward of each micro-batch's token sum, one
all-reduce of the gradients per window, divides by the window's token count, steps. With
``--method ring`` a third variant, ``gathered``, is that hand loop with the attention written the
simple way: every rank's keys and values all-gathered (differentiably: the backward sends each
rank the gradients of its part, an all-to-all, and sums them), the
part's queries over the whole sequence by SDPA with the causal mask of global positions; its
activations are measured too (it saves the whole sequence's keys and values per layer); and a
fourth, ``ulysses``, the engine with ``method: ulysses`` on the same batches, so that ring / Ulysses
is a ratio of medians from one run. Variants
interleaved, the slowest rank's time, median over rounds; tokens/s counts every padded
position of the global batch. CPU time per step (mean over ranks, median over rounds) as well:
on a shared machine, what each variant computes without the time spent waiting for a core.

Results: bench/results/context_w<W>.json, context_ring_w<W>.json (rank 0 prints a table).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import argparse
import copy
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import engine
from bench.common import add_record_argument, cpu_interleaved, interleaved, save
from engine.context.ring import RingExchange
from engine.context.sharding import ContextShards
from engine.context.ulysses import SequenceAttention, UlyssesExchange
from engine.distributed.collectives import all_to_all
from engine.distributed.process_group import init_distributed, strip_local_rank_arg
from engine.memory import storages
from examples.gpt import GPT, GPTConfig

ROWS, MICRO, VOCAB = 4, 2, 256


def model(length: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=length, n_layer=2, n_head=4, n_embd=128))


def rows(length: int) -> dict:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (ROWS, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (ROWS,), generator=g)
    labels = torch.randint(0, VOCAB, (ROWS, length), generator=g)
    labels[torch.arange(length)[None, :] >= lengths[:, None]] = -100
    return {"tokens": tokens, "labels": labels}


def token_sum(m, batch):
    logits = m(batch["tokens"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
    return loss, (batch["labels"] != -100).sum()


def saved_bytes(run, parameters) -> int:
    """Bytes the forward in ``run()`` saves for backward, parameters excluded."""
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = run()
    held = storages(parameters)
    total = sum(size for address, size in storages(saved).items() if address not in held)
    del output
    return total


class GatheredAlongSequence(torch.autograd.Function):
    """Every rank's (..., part, d) concatenated along the sequence; the backward returns each rank the
    sum over ranks of the gradients of its part."""

    @staticmethod
    def forward(ctx, tensor):
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        pieces = torch.stack(grad.chunk(dist.get_world_size(), dim=-2))
        return all_to_all(pieces, None).sum(dim=0)


class GatheredExchange:
    """Ring attention's simplest alternative: the keys and values of every rank gathered (autograd
    differentiates the all-gather), this part's queries over the whole sequence, causal by position."""

    def __init__(self, shards: ContextShards):
        self.shards = shards

    def check_causal(self, causal: bool, what: str) -> None:
        assert causal, what

    def sdpa(self, what, func, query, key, value, *rest, **kwargs):
        length = query.shape[-2] * self.shards.size
        keys, values = (GatheredAlongSequence.apply(t) for t in (key, value))
        allowed = self.shards.positions(length)[:, None] >= self.shards.gathered_positions(length)[None, :]
        return func(query, keys, values, attn_mask=allowed, scale=kwargs.get("scale"))


class HandContext:
    """The context-parallel step written directly: shard, positions, exchanged SDPA, sum, all-reduce, step."""

    def __init__(self, length: int, rank: int, size: int, method: str):
        self.model = model(length)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.shards = ContextShards(size, rank)
        exchanges = {"ring": lambda: RingExchange(self.shards, None, list(range(size))),
                     "ulysses": lambda: UlyssesExchange(self.shards, None),
                     "gathered": lambda: GatheredExchange(self.shards)}
        exchange = exchanges[method]()
        for block in self.model.blocks:
            forward = block.attn.forward

            def attention(x, forward=forward):
                with SequenceAttention(exchange, "attention"):
                    return forward(x)

            block.attn.forward = attention
        self.positions = self.shards.positions(length)

    def loss(self, micro):
        """The token sum of this rank's part of a micro-batch, and its count."""
        tokens, labels = self.shards.split(micro["tokens"]), self.shards.split(micro["labels"])
        logits = self.model(tokens, position_ids=self.positions.expand(tokens.shape[0], -1))
        return (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"),
                (labels != -100).sum())

    def step(self, batch):
        count = torch.zeros((), dtype=torch.float64)
        for start in range(0, ROWS, MICRO):
            loss, tokens = self.loss({k: v[start:start + MICRO] for k, v in batch.items()})
            loss.backward()
            count += tokens
        grads = [p.grad for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads] + [count.float().reshape(1)])
        dist.all_reduce(flat)
        total = flat[-1]
        for g, piece in zip(grads, flat[:-1].split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g)).div_(total)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def main(argv=None):
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--method", choices=("ulysses", "ring"), default="ulysses")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)
    size = info.world_size
    memory, speed = [], []
    for length in args.lengths:
        batch = rows(length)
        whole = model(length)
        micro = {k: v[:MICRO] for k, v in batch.items()}
        alone = saved_bytes(lambda: token_sum(whole, micro)[0], list(whole.parameters()))
        cfg = {"train_batch_size": ROWS, "train_micro_batch_size_per_gpu": MICRO,
               "context_parallel": {"size": size, "method": args.method}, "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}
        eng = engine.initialize(copy.deepcopy(whole), cfg)
        part = eng.context.shard(micro)
        with eng.context.running():
            split = saved_bytes(lambda: token_sum(eng.module, part)[0], list(eng.module.parameters()))
        memory.append({"length": length, "context_1_bytes": alone, "context_2_bytes": split,
                       "ratio": split / alone})
        hand = HandContext(length, info.rank, size, args.method)
        runs = {"engine": lambda: eng.train_batch(batch, token_sum), "hand": lambda: hand.step(batch)}
        if args.method == "ring":
            gathered = HandContext(length, info.rank, size, "gathered")
            runs["gathered"] = lambda: gathered.step(batch)
            ulysses = engine.initialize(copy.deepcopy(whole), {
                **cfg, "context_parallel": {"size": size, "method": "ulysses"}})
            runs["ulysses"] = lambda: ulysses.train_batch(batch, token_sum)
            ulysses_part = ulysses.context.shard(micro)
            with ulysses.context.running():
                memory[-1]["ulysses_bytes"] = saved_bytes(lambda: token_sum(ulysses.module, ulysses_part)[0],
                                                          list(ulysses.module.parameters()))
            memory[-1]["ulysses_ratio"] = memory[-1]["ulysses_bytes"] / alone
            memory[-1]["gathered_bytes"] = saved_bytes(lambda: gathered.loss(micro)[0],
                                                       list(gathered.model.parameters()))
            memory[-1]["gathered_ratio"] = memory[-1]["gathered_bytes"] / alone
        times = interleaved(runs, rounds=args.rounds, steps=args.steps, distributed=True)
        cpu = cpu_interleaved(runs, rounds=args.rounds, steps=args.steps)
        tokens = ROWS * length
        speed.append({"length": length, "engine_s": times["engine"], "hand_s": times["hand"],
                      "engine_tokens_per_s": tokens / times["engine"], "hand_tokens_per_s": tokens / times["hand"],
                      "ratio": times["engine"] / times["hand"], "engine_cpu_s": cpu["engine"],
                      "hand_cpu_s": cpu["hand"], "cpu_ratio": cpu["engine"] / cpu["hand"]})
        if "gathered" in runs:
            speed[-1].update({"gathered_s": times["gathered"], "gathered_tokens_per_s": tokens / times["gathered"],
                              "gathered_cpu_s": cpu["gathered"], "gathered_cpu_ratio": cpu["engine"] / cpu["gathered"],
                              "ulysses_s": times["ulysses"], "ulysses_cpu_s": cpu["ulysses"],
                              "ulysses_ratio": times["engine"] / times["ulysses"],
                              "ulysses_cpu_ratio": cpu["engine"] / cpu["ulysses"]})
            ulysses.close()
        eng.close()
    if info.rank == 0:
        load = os.getloadavg()
        print(f"context {size} ({args.method}) on {info.world_size} ranks (load {load[0]:.1f})")
        print("length  activations/rank ctx1  ctx2      ratio | engine tok/s  hand tok/s  engine/hand: time  CPU time")
        for m, s in zip(memory, speed):
            print(f"{m['length']:6d}  {m['context_1_bytes'] / 2**20:16.1f} MiB {m['context_2_bytes'] / 2**20:6.1f} MiB "
                  f"{m['ratio']:.2f} | {s['engine_tokens_per_s']:12.0f} {s['hand_tokens_per_s']:11.0f} "
                  f"{s['ratio']:17.3f} {s['cpu_ratio']:9.3f}")
            if "gathered_bytes" in m:
                print(f"        gathered by hand: activations {m['gathered_bytes'] / 2**20:.1f} MiB "
                      f"({m['gathered_ratio']:.2f}), {s['gathered_tokens_per_s']:.0f} tok/s, engine/gathered CPU time {s['gathered_cpu_ratio']:.3f}")
                print(f"        the engine with Ulysses, same run: activations {m['ulysses_bytes'] / 2**20:.1f} MiB "
                      f"({m['ulysses_ratio']:.2f}), ring / Ulysses time {s['ulysses_ratio']:.3f}, "
                      f"CPU time {s['ulysses_cpu_ratio']:.3f} ({s['engine_cpu_s'] * 1e3:.1f} / "
                      f"{s['ulysses_cpu_s'] * 1e3:.1f} ms)")
        name = "context" if args.method == "ulysses" else f"context_{args.method}"
        save(f"{name}_w{info.world_size}", {"method": args.method, "load_average": load, "rows": ROWS, "micro_batch": MICRO,
                                             "memory": memory, "speed": speed}, record=args.record)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
