"""Micro-batches by token budget against a fixed micro size of the same padded size, on
skewed lengths (most sequences short, a few long), in one run: time per optimizer step,
real tokens per second, the share of computed positions that were padding, and memory.

    python bench/token_budget.py [--rounds 5] [--steps 1]
    python -m launch --nproc-per-node 2 bench/token_budget.py

The fixed variant is what a collate that pads to the batch's longest row and a fixed
``train_micro_batch_size_per_gpu`` give: M = budget / T rows per micro-batch, each padded to
T, so both variants hold at most ``budget`` padded tokens in a micro-batch (the same
activation memory). The token budget groups rows of similar length and trims each
micro-batch to its own longest row.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` and `examples` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch
import torch.nn.functional as F

import engine
from bench.common import adamw, add_record_argument, interleaved, save
from engine.distributed.process_group import init_distributed, strip_local_rank_arg
from gpt import GPT, GPTConfig

VOCAB = 64


def skewed_batch(rows: int, longest: int, long_rows: int, seed: int) -> dict[str, torch.Tensor]:
    """``rows`` right-padded sequences: ``long_rows`` of 3/4..1 × ``longest`` tokens, the rest
    of 1/32..3/16 × ``longest`` (most short, a few long), shuffled; padded to the longest."""
    g = torch.Generator().manual_seed(seed)
    long = torch.randint(longest * 3 // 4, longest + 1, (long_rows,), generator=g)
    short = torch.randint(longest // 32, longest * 3 // 16 + 1, (rows - long_rows,), generator=g)
    lengths = torch.cat([long, short])[torch.randperm(rows, generator=g)]
    width = int(lengths.max())
    mask = torch.arange(width)[None, :] < lengths[:, None]
    ids = torch.randint(1, VOCAB, (rows, width), generator=g).where(mask, torch.zeros((), dtype=torch.long))
    labels = torch.cat([ids[:, 1:], torch.zeros(rows, 1, dtype=torch.long)], 1)
    labels = labels.where(torch.cat([mask[:, 1:], torch.zeros(rows, 1, dtype=torch.bool)], 1), torch.tensor(-100))
    return {"input_ids": ids, "labels": labels, "attention_mask": mask.long()}


def token_loss(model, batch):
    logits = model(batch["input_ids"])
    loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
    return loss_sum, (batch["labels"] != -100).sum()


def main(argv=None):
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--rows", type=int, default=64, help="per-device batch (sequences)")
    parser.add_argument("--longest", type=int, default=512, help="longest sequence (tokens)")
    parser.add_argument("--long-rows", type=int, default=4, help="long sequences per device batch")
    parser.add_argument("--budget", type=int, default=4096, help="micro_batch_tokens (padded tokens)")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)
    batch = skewed_batch(args.rows, args.longest, args.long_rows, seed=info.rank)
    width = batch["input_ids"].shape[1]
    micro = max(1, args.budget // width)  # the fixed micro size of the same padded size
    global_batch = args.rows * info.world_size
    torch.manual_seed(0)
    model = GPT(GPTConfig(VOCAB, block_size=args.longest, n_layer=2, n_head=4, n_embd=128))

    base = {"train_batch_size": global_batch, "monitor": {"enabled": True, "progress": False}}
    if args.rows % micro:
        base["batch_split"] = "balanced"
    configs = {
        f"fixed micro size {micro} ({micro} x {width} padded tokens)": {"train_micro_batch_size_per_gpu": micro},
        f"micro_batch_tokens {args.budget}": {"micro_batch_tokens": args.budget},
        f"micro_batch_tokens {args.budget}, second copy (noise floor)": {"micro_batch_tokens": args.budget},
    }
    engines = {name: engine.initialize(copy.deepcopy(model), {**base, **extra}, optimizer=adamw, loss_fn=token_loss)
               for name, extra in configs.items()}
    peaks = {name: 0 for name in engines}

    def step(name):
        def run():
            eng = engines[name]
            eng.train_batch(batch)
            peaks[name] = max(peaks[name], eng.last_window.peak_memory_bytes or 0)
        return run

    times = interleaved({name: step(name) for name in engines}, args.rounds, args.steps,
                        distributed=info.world_size > 1)
    real_tokens = int(batch["attention_mask"].sum()) * info.world_size  # every rank's batch is alike in shape
    rows = {}
    for name, eng in engines.items():
        window = eng.last_window
        by_tokens = window.padded_tokens is not None
        padded = window.padded_tokens if by_tokens else args.rows * width * info.world_size
        real = window.real_tokens if by_tokens else real_tokens
        largest = max(g.padded_tokens for g in eng.window_split.groups) if by_tokens else micro * width
        rows[name] = {"ms_per_step": times[name] * 1e3, "real_tokens_per_s": real / times[name],
                      "micro_steps": window.micro_steps, "padded_tokens": padded, "real_tokens": real,
                      "padding_fraction": 1 - real / padded, "largest_micro_batch_tokens": largest,
                      "peak_memory_mb": peaks[name] / 2**20}
    baseline = next(iter(rows))
    for row in rows.values():
        row["speedup_vs_fixed"] = rows[baseline]["ms_per_step"] / row["ms_per_step"]
    if info.rank == 0:
        print(f"{'variant':55s} {'ms/step':>8s} {'speedup':>8s} {'tok/s':>8s} {'micro':>5s} "
              f"{'padding':>8s} {'largest':>8s} {'peak MiB':>8s}")
        for name, row in rows.items():
            print(f"{name:55s} {row['ms_per_step']:8.1f} {row['speedup_vs_fixed']:7.2f}x "
                  f"{row['real_tokens_per_s']:8.0f} {row['micro_steps']:5d} {row['padding_fraction']:8.1%} "
                  f"{row['largest_micro_batch_tokens']:8d} {row['peak_memory_mb']:8.1f}")
        lengths = batch["attention_mask"].sum(1)
        save("token_budget" if info.world_size == 1 else f"token_budget_w{info.world_size}", {
            "workload": f"GPT (examples/gpt.py) 2 layers x 128, {info.world_size} process(es), per-device batch "
                        f"{args.rows} sequences: {args.long_rows} of {args.longest * 3 // 4}-{args.longest} tokens, "
                        f"the rest {args.longest // 32}-{args.longest * 3 // 16}; AdamW, fp32, (sum, count) loss",
            "lengths_rank0": lengths.tolist(), "rounds": args.rounds, "steps": args.steps,
            "variants": rows}, record=args.record)
    for eng in engines.values():
        eng.close()


if __name__ == "__main__":
    main()
