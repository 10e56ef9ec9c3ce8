"""Token budgets under a pipeline: ``micro_batch_tokens`` against a fixed micro size, pipeline 2
(1F1B), on two streams of variable-length windows: what a step costs, the share of computed
positions that were padding, micro-steps and schedules built per window.

    python -m launch --nproc-per-node 2 bench/pipeline_tokens.py [--rounds 8] [--steps 1]

torch's stages run one shape per step, so under a pipeline a token budget cuts all of a
window's micro-batches to one bucket length (``engine.batching.token_budget``, "One shape per
window"); each new shape builds a schedule. Variants, 32 rows per window, budget 2048 padded
tokens (8 rows of the longest possible row, 256):

* fixed 8 rows, padded to 256 — the usual pipeline recipe: one shape, one schedule (baseline);
* fixed 8 rows, padded per batch — a collate padding to the batch's longest row: a schedule
  per new length;
* ``micro_batch_tokens: 2048`` — batches padded per batch, bucketed by the engine.

Streams: *length-grouped* windows (each window's rows of similar length, as a length-grouping
sampler gives; 3 in 4 windows short) and *skewed* windows (in every window 2 rows of 192–256
tokens, the rest 8–48). Every call trains the next window of a repeating stream of 8; the
variants alternate round by round and the slowest rank's time counts.

Results: bench/results/pipeline_tokens_w2.json (rank 0 prints the table).
"""

from __future__ import annotations

import copy
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

import engine
from bench.common import adamw, interleaved, save, start_ranks

VOCAB, WIDTH, ROWS, LONGEST, BUDGET, WINDOWS = 64, 64, 32, 256, 2048, 8


class CausalMix(torch.nn.Module):
    """Each position adds the mean of the positions up to it (a causal model's mixing)."""

    def forward(self, x):
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[None, :, None]
        return x + x.cumsum(1) / steps


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), CausalMix(),
        torch.nn.Linear(4 * WIDTH, WIDTH), torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(),
        torch.nn.Linear(4 * WIDTH, VOCAB))


def window(lengths: torch.Tensor, g: torch.Generator):
    """(input ids, {labels, attention_mask}), right-padded to LONGEST; next-token labels."""
    mask = torch.arange(LONGEST)[None, :] < lengths[:, None]
    ids = torch.randint(1, VOCAB, (len(lengths), LONGEST), generator=g) * mask
    labels = torch.cat([ids[:, 1:], torch.zeros(len(lengths), 1, dtype=torch.long)], 1)
    labels = labels.masked_fill(~torch.cat([mask[:, 1:], torch.zeros(len(lengths), 1, dtype=torch.bool)], 1), -100)
    return ids, {"labels": labels, "attention_mask": mask.long()}


def length_grouped(index, g):
    """Rows within 3/4 of the window's longest: every fourth window 128-256 tokens, the rest 16-64."""
    top = int(torch.randint(128, LONGEST + 1, (), generator=g)) if index % 4 == 3 else \
        int(torch.randint(16, 65, (), generator=g))
    return torch.randint(top * 3 // 4, top + 1, (ROWS,), generator=g)


def skewed(index, g):
    """2 rows of 192-256 tokens, the rest 8-48, shuffled."""
    lengths = torch.cat([torch.randint(192, LONGEST + 1, (2,), generator=g), torch.randint(8, 49, (ROWS - 2,),
                                                                                          generator=g)])
    return lengths[torch.randperm(ROWS, generator=g)]


def stream(lengths_of, seed):
    g = torch.Generator().manual_seed(seed)
    return [window(lengths_of(index, g), g) for index in range(WINDOWS)]


def per_batch(batch):
    """Padded to the batch's own longest row (a collate padding each batch)."""
    width = int(batch[1]["attention_mask"].sum(1).max())
    return batch[0][:, :width], {key: value[:, :width] for key, value in batch[1].items()}


def token_loss(outputs, labels):
    loss = F.cross_entropy(outputs.flatten(0, 1), labels["labels"].flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels["labels"] != -100).sum()


class Variant:
    """One engine training window after window of a repeating stream; counts what each cost."""

    def __init__(self, net, windows, settings, prepare):
        self.eng = engine.initialize(copy.deepcopy(net), {"train_batch_size": ROWS, "pipeline": {"stages": 2},
                                                          **settings}, optimizer=adamw)
        self.batches = itertools.cycle([prepare(batch) for batch in windows])
        self.windows = self.real = self.computed = self.micro_steps = 0

    def __call__(self):
        batch = next(self.batches)
        self.eng.train_batch(batch, token_loss)
        report = self.eng.last_window
        self.windows += 1
        self.micro_steps += report.micro_steps
        self.real += int(batch[1]["attention_mask"].sum())
        # a fixed micro size computes every row at the batch's width
        self.computed += report.padded_tokens or batch[0].numel()

    def summary(self) -> dict:
        return {"micro_steps_per_window": self.micro_steps / self.windows,
                "schedules_built_per_window": self.eng.strategy.schedules.built / self.windows,
                "padding_share": 1 - self.real / self.computed}


def main(argv=None):
    args, info, _, _ = start_ranks(__doc__.splitlines()[0], rounds=8, argv=argv)
    net = model()
    fixed = {"train_micro_batch_size_per_gpu": BUDGET // LONGEST}
    result, lines = {}, []
    for name, lengths_of in (("length-grouped", length_grouped), ("skewed", skewed)):
        windows = stream(lengths_of, seed=1)
        variants = {"fixed 8 rows, padded to 256": Variant(net, windows, fixed, lambda b: b),
                    "fixed 8 rows, padded per batch": Variant(net, windows, fixed, per_batch),
                    f"micro_batch_tokens {BUDGET}": Variant(net, windows, {"micro_batch_tokens": BUDGET}, per_batch)}
        times = interleaved(variants, args.rounds, args.steps, warmup=1, distributed=True)
        baseline = times["fixed 8 rows, padded to 256"]
        result[name] = {key: {"ms_per_step": times[key] * 1e3, "vs_baseline": times[key] / baseline,
                              **variant.summary()} for key, variant in variants.items()}
        for key, row in result[name].items():
            lines.append(f"{name:15s} {key:32s} {row['ms_per_step']:8.1f} {row['vs_baseline']:6.2f} "
                         f"{row['micro_steps_per_window']:6.2f} {row['schedules_built_per_window']:6.2f} "
                         f"{row['padding_share']:7.1%}")
        for variant in variants.values():
            variant.eng.close()
    if info.rank != 0:
        return
    print(f"{'stream':15s} {'variant':32s} {'ms/step':>8s} {'vs':>6s} {'steps':>6s} {'built':>6s} {'padding':>7s}")
    print("\n".join(lines))
    save(f"pipeline_tokens_w{info.world_size}", {
        "workload": f"8-layer token MLP with causal mixing, {ROWS} rows per window of at most {LONGEST} tokens, 2 "
                    f"stages 1F1B, AdamW fp32, 2 ranks gloo, {args.rounds} rounds x {args.steps} steps, median, "
                    "slowest rank; per window: micro-steps, schedules built (over every window run), padding share",
        "streams": result}, record=args.record)


if __name__ == "__main__":
    main()
