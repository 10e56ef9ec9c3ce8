"""Packing (``packing: true``) against the token budget with padding, same ``micro_batch_tokens``, on
skewed lengths (most documents short, a few long), in one run: time per optimizer step, real tokens
per second, the share of computed positions that were padding, and peak memory.

    python bench/packing.py [--rounds 5] [--steps 1]
    python -m launch --nproc-per-node 2 bench/packing.py

Workload: a Hugging Face Llama (2 layers, width 128, 4 heads, vocabulary 64, sdpa, fp32) trained by
its own ``.loss``, AdamW; a per-device batch of right-padded rows (``bench.token_budget``'s skewed
lengths). Both variants bound a micro-batch by the same N tokens: the token budget by its padded
tokens (rows of similar length, each micro-batch trimmed to its longest row), packing by its real
tokens (documents end to end in one row of at most N, no padding at all), so both hold at most N
computed positions per micro-batch — the same activation bound. Packing runs attention within each
document (``engine.attention``; each variant's ``attention`` in the results names the implementation
that ran). Variants interleaved, median over rounds; a second copy of the token budget gives the noise
floor. Results: bench/results/latest/packing_w<W>.json (``--record``: bench/results/packing_w<W>.json).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import engine
from bench.common import adamw, add_record_argument, interleaved, save
from bench.token_budget import skewed_batch
from engine.distributed.process_group import init_distributed, strip_local_rank_arg

VOCAB = 64


def llama(longest: int):
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=longest)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def own_loss(model, batch):
    return model(**batch).loss


def main(argv=None):
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--rows", type=int, default=64, help="per-device batch (documents)")
    parser.add_argument("--longest", type=int, default=512, help="longest document (tokens)")
    parser.add_argument("--long-rows", type=int, default=4, help="long documents per device batch")
    parser.add_argument("--budget", type=int, default=1024, help="micro_batch_tokens (N)")
    add_record_argument(parser)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)
    skewed = skewed_batch(args.rows, args.longest, args.long_rows, seed=info.rank)
    # the model's own loss shifts its labels itself: labels are the input ids, -100 at the padding
    batch = {"input_ids": skewed["input_ids"], "attention_mask": skewed["attention_mask"],
             "labels": skewed["input_ids"].masked_fill(skewed["attention_mask"] == 0, -100)}
    model = llama(args.longest)
    base = {"train_batch_size": args.rows * info.world_size, "micro_batch_tokens": args.budget,
            "monitor": {"enabled": True, "progress": False}}
    configs = {f"token budget {args.budget} (padded)": {},
               f"packing, {args.budget} tokens per row": {"packing": True},
               f"token budget {args.budget}, second copy (noise floor)": {}}
    engines = {name: engine.initialize(copy.deepcopy(model), {**base, **extra}, optimizer=adamw, loss_fn=own_loss)
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
    rows = {}
    for name, eng in engines.items():
        window = eng.last_window
        rows[name] = {"ms_per_step": times[name] * 1e3, "real_tokens_per_s": window.real_tokens / times[name],
                      "micro_steps": window.micro_steps, "computed_tokens": window.padded_tokens,
                      "real_tokens": window.real_tokens, "padding_fraction": 1 - window.real_tokens / window.padded_tokens,
                      "peak_memory_mb": peaks[name] / 2**20,
                      # which attention ran: packing's per-document implementation (engine.attention) or sdpa
                      "attention": getattr(getattr(eng.module, "config", None), "_attn_implementation", None)}
    baseline = next(iter(rows))
    for row in rows.values():
        row["speedup_vs_token_budget"] = rows[baseline]["ms_per_step"] / row["ms_per_step"]
    if info.rank == 0:
        print(f"{'variant':48s} {'ms/step':>8s} {'speedup':>8s} {'tok/s':>8s} {'micro':>5s} {'padding':>8s} "
              f"{'peak MiB':>8s}")
        for name, row in rows.items():
            print(f"{name:48s} {row['ms_per_step']:8.1f} {row['speedup_vs_token_budget']:7.2f}x "
                  f"{row['real_tokens_per_s']:8.0f} {row['micro_steps']:5d} {row['padding_fraction']:8.1%} "
                  f"{row['peak_memory_mb']:8.1f}")
        save(f"packing_w{info.world_size}", {"rows": args.rows, "longest": args.longest, "budget": args.budget,
                                             "variants": rows}, record=args.record)
    for eng in engines.values():
        eng.close()


if __name__ == "__main__":
    main()
