"""Train a small GPT on the Mossgate corpus, one optimizer step per global batch of lines.

    python examples/train_lm.py                                     # one process
    python -m launch --nproc-per-node 2 examples/train_lm.py        # two (torchrun)
    python -m launch --nproc-per-node 2 --launcher deepspeed examples/train_lm.py
    python examples/train_lm.py --steps 50 --out runs/try --set optimizer.params.lr=1e-3
    python examples/train_lm.py --hf-model gpt2                     # transformers' GPT-2 class
    python examples/train_lm.py --micro-batch-tokens 1024           # micro-batches by tokens

Samples are lines of examples/data/corpus.txt (character tokens, one line per sample,
right-padded, padding labelled -100), so micro-batches hold different numbers of real
tokens. The loss function returns ``(loss_sum, num_tokens)`` and the engine weights every
token of the global batch equally, whatever the micro-batch size, the accumulation or the
number of processes: with the config's fixed ``train_batch_size`` one process and two
train the same model (to float rounding).

``--micro-batch-tokens N`` forms each rank's micro-batches by padded tokens instead of a
fixed number of lines (``micro_batch_tokens``): lines of similar length go together, each
micro-batch is trimmed to its own longest line, and the update is the same.

With ``--set checkpoint.dir=DIR --set checkpoint.every_steps=N`` it saves every N steps (and on
Ctrl-C / SIGTERM, at the next boundary); the same command again resumes there, the data order
included (``eng.batches`` keeps its position in the checkpoint).

Writes into --out: ``loss.png`` (train and held-out loss against step), the monitor's
``metrics.jsonl`` (and any other monitor file the config names; relative monitor paths
are taken inside --out) and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import engine
from engine.cli import add_override_argument
from engine.distributed.process_group import strip_local_rank_arg

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CONFIG = REPO / "configs" / "lm_tiny.yaml"
DEFAULT_CORPUS = HERE / "data" / "corpus.txt"
HF_MODELS = ("gpt2",)
TRANSFORMERS_HINT = "pip install transformers"

if str(HERE) not in sys.path:  # gpt.py sits next to this file
    sys.path.insert(0, str(HERE))
from gpt import GPT, GPTConfig  # noqa: E402


# -- data ------------------------------------------------------------------------------
class CharTokenizer:
    """Characters of the corpus; id 0 is the line boundary ("\\n"), used before and after
    every line, so a model learns where lines start and end."""

    BOUNDARY = 0

    def __init__(self, text: str):
        self.chars = ["\n"] + sorted(set(text) - {"\n"})
        self.ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.ids[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


class Lines(torch.utils.data.Dataset):
    """One sample per line: boundary + characters + boundary, cut to ``block_size + 1`` ids."""

    def __init__(self, lines: list[str], tokenizer: CharTokenizer, block_size: int):
        edge = [CharTokenizer.BOUNDARY]
        self.samples = [torch.tensor((edge + tokenizer.encode(line) + edge)[:block_size + 1])
                        for line in lines]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.samples[index]


def collate(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: inputs with 0, labels (the next token) with -100; the
    attention mask marks real inputs (what micro_batch_tokens reads the lengths from)."""
    width = max(len(s) for s in samples) - 1
    inputs = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for row, sample in enumerate(samples):
        inputs[row, :len(sample) - 1] = sample[:-1]
        labels[row, :len(sample) - 1] = sample[1:]
        mask[row, :len(sample) - 1] = 1
    return {"input_ids": inputs, "labels": labels, "attention_mask": mask}


def split_lines(text: str, eval_every: int) -> tuple[list[str], list[str]]:
    """Every ``eval_every``-th line is held out for evaluation."""
    lines = [line for line in text.splitlines() if line.strip()]
    train = [line for i, line in enumerate(lines) if i % eval_every != eval_every - 1]
    held_out = [line for i, line in enumerate(lines) if i % eval_every == eval_every - 1]
    return train, held_out


def token_loss(model, batch):
    """(sum of the per-token cross-entropies, number of real tokens): item-weighted."""
    output = model(batch["input_ids"])
    logits = getattr(output, "logits", output)  # a transformers ModelOutput, or our tensor
    labels = batch["labels"]
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                               ignore_index=-100, reduction="sum")
    return loss_sum, (labels != -100).sum()


# -- model -------------------------------------------------------------------------------
def build_model(args, constants: dict, vocab_size: int) -> torch.nn.Module:
    dims = dict(vocab_size=vocab_size, block_size=constants.get("BLOCK_SIZE", 192),
                n_layer=constants.get("N_LAYER", 2), n_head=constants.get("N_HEAD", 4),
                n_embd=constants.get("N_EMBD", 64))
    if args.hf_model is None:
        return GPT(GPTConfig(**dims))
    return build_hf_model(args.hf_model, **dims)


def build_hf_model(name: str, *, vocab_size, block_size, n_layer, n_head, n_embd):
    """transformers' GPT2LMHeadModel built from a config with our small dimensions and our
    tokenizer's vocabulary: random weights, nothing downloaded."""
    if name not in HF_MODELS:
        raise SystemExit(f"error: --hf-model {name!r}: supported: {', '.join(HF_MODELS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: never reach a hub
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise SystemExit(
            f"error: --hf-model {name} needs the transformers package, which is not installed. "
            f"Install it with `{TRANSFORMERS_HINT}`, or drop --hf-model to train the example's "
            "own GPT (examples/gpt.py)."
        ) from None
    config = GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_embd=n_embd,
                        n_layer=n_layer, n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=CharTokenizer.BOUNDARY,
                        eos_token_id=CharTokenizer.BOUNDARY, use_cache=False)
    return GPT2LMHeadModel(config)


def sample_line(module, tokenizer: CharTokenizer, seed: int) -> str | None:
    """One generated line (every rank runs it: a sharded model gathers in its forward)."""
    if not isinstance(module, GPT):
        return None
    start = torch.tensor([[CharTokenizer.BOUNDARY]], device=next(module.parameters()).device)
    generator = torch.Generator(device=start.device).manual_seed(seed)
    out = module.generate(start, module.config.block_size - 1, temperature=0.7,
                          stop_token=CharTokenizer.BOUNDARY, generator=generator)
    return tokenizer.decode(out[0, 1:].tolist()).split("\n")[0]


# -- config --------------------------------------------------------------------------------
def load_run_config(args, out: Path) -> tuple[engine.Config, int]:
    """The config with the run's own adjustments: the step count reaches the schedule and
    the monitor, and relative monitor files land in ``out``."""
    overrides = list(args.overrides)
    if args.micro_batch_tokens is not None:  # the token budget replaces the fixed accumulation
        overrides += [f"micro_batch_tokens={args.micro_batch_tokens}", "gradient_accumulation_steps=null"]
    config = engine.load_config(args.config, overrides)
    steps = args.steps or config.constants.get("STEPS", 300)
    overridden = {text.partition("=")[0].strip() for text in args.overrides}
    adjust = {}
    if args.steps and config.scheduler is not None and "total_num_steps" in config.scheduler.params \
            and "scheduler.params.total_num_steps" not in overridden:
        adjust["scheduler.params.total_num_steps"] = steps
    if config.monitor.total_steps is None or args.steps:
        adjust["monitor.total_steps"] = steps
    for key in ("jsonl", "csv", "tensorboard"):
        path = getattr(config.monitor, key)
        if path and not Path(path).is_absolute():
            adjust[f"monitor.{key}"] = str(out / path)
    return (engine.load_config(config, adjust) if adjust else config), steps


# -- output ----------------------------------------------------------------------------------
def plot_losses(path: Path, train: list[tuple[int, float]], held_out: list[tuple[int, float]],
                title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        axes.plot(*zip(*train), lw=1.2, label="train (per-token, global batch)")
    if held_out:
        axes.plot(*zip(*held_out), "o-", lw=1.5, ms=4, label="held-out lines")
    axes.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("cross-entropy (nats / token)")
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


# -- main -------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="config file (.yaml, .json, .py)")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps (default: the config's constants.STEPS); also sets "
                             "the schedule's total_num_steps and the monitor's total")
    parser.add_argument("--out", default=None, help="output directory (default runs/<config name>)")
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="text file, one sample per line")
    parser.add_argument("--hf-model", choices=HF_MODELS, default=None,
                        help="train transformers' GPT2LMHeadModel (small, from a config) instead "
                             "of examples/gpt.py; needs the transformers package")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, metavar="N",
                        help="form micro-batches of at most N padded tokens (lines x longest line) "
                             "instead of the config's fixed micro-batches (sets micro_batch_tokens)")
    add_override_argument(parser)
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.micro_batch_tokens is not None and args.micro_batch_tokens < 1:
        parser.error("--micro-batch-tokens must be at least 1")
    return args


def main(argv=None) -> dict:
    strip_local_rank_arg(argv)
    args = parse_args(argv)
    out = Path(args.out or Path("runs") / Path(args.config).stem)
    config, steps = load_run_config(args, out)
    constants = config.constants
    text = Path(args.corpus).read_text(encoding="utf-8")
    tokenizer = CharTokenizer(text)
    train_lines, held_out_lines = split_lines(text, constants.get("EVAL_HOLDOUT_EVERY", 10))
    block_size = constants.get("BLOCK_SIZE", 192)
    eval_every = constants.get("EVAL_EVERY", 25)
    seed = config.seed if config.seed is not None else 0

    torch.manual_seed(seed)  # the same initial model on every rank
    model = build_model(args, constants, tokenizer.vocab_size)
    eng = engine.initialize(model, config, loss_fn=token_loss)
    rank0 = eng.rank == 0
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        kind = f"transformers {type(model).__name__}" if args.hf_model else "GPT (examples/gpt.py)"
        print(f"{kind}: {sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters, "
              f"vocab {tokenizer.vocab_size}; {len(train_lines)} train / {len(held_out_lines)} "
              f"held-out lines\n", end="", flush=True)
        if eng.plan.micro_batch_tokens:
            split = f"micro-batches of at most {eng.plan.micro_batch_tokens} padded tokens"
        else:
            split = (f"{eng.plan.train_micro_batch_size_per_gpu} per micro-batch x "
                     f"{eng.plan.gradient_accumulation_steps} accumulation steps")
        print(f"global batch {eng.plan.train_batch_size} lines = {eng.plan.world_size} data-parallel rank(s) x "
              f"{split}; {steps} steps\n", end="", flush=True)

    # eng.batches: automatic checkpoints (checkpoint.dir) save its position, and a resumed run goes on from it
    data = eng.batches(Lines(train_lines, tokenizer, block_size), shuffle=True, seed=seed, drop_last=True,
                       collate_fn=collate)
    held_out = Lines(held_out_lines, tokenizer, block_size)
    # this data-parallel rank's share (the ranks of a tensor group evaluate the same lines)
    eval_batch = collate([held_out[i] for i in range(eng.plan.rank, len(held_out), eng.plan.world_size)])

    def evaluate(step: int) -> None:
        loss = eng.eval_batch(eval_batch)
        eval_losses.append((step, loss))
        if eng.monitor is not None:
            eng.monitor.log_eval(step, loss)
        elif rank0:
            print(f"eval step {step} | loss {loss:.4f}\n", end="", flush=True)

    train_losses: list[tuple[int, float]] = []
    eval_losses: list[tuple[int, float]] = []
    tokens = torch.zeros((), dtype=torch.float64)
    real_and_padded = [0, 0]  # input positions, when micro-batches are formed by tokens
    first_step = eng.global_steps  # > 0 when resumed from checkpoint.dir
    evaluate(first_step)
    batches = iter(())
    start = time.perf_counter()
    while eng.global_steps < steps:
        batch = next(batches, None)
        if batch is None:  # the next epoch: eng.batches' DistributedBatches moves on by itself
            batches = iter(data)
            continue
        train_losses.append((eng.global_steps + 1, eng.train_batch(batch)))
        if eng.last_window.items is not None:
            tokens += eng.last_window.items.cpu()
        if eng.last_window.padded_tokens is not None:
            real_and_padded[0] += eng.last_window.real_tokens
            real_and_padded[1] += eng.last_window.padded_tokens
        if eng.global_steps % eval_every == 0 or eng.global_steps == steps:
            evaluate(eng.global_steps)
    seconds = time.perf_counter() - start
    sample = sample_line(eng.module, tokenizer, seed)
    if eng.monitor is not None:
        eng.monitor.close()

    summary = {
        "steps": eng.global_steps, "world_size": eng.world_size,
        "train_batch_size": eng.plan.train_batch_size,
        "micro_batch_size": eng.plan.train_micro_batch_size_per_gpu,
        "accumulation_steps": eng.plan.gradient_accumulation_steps,
        "micro_batch_tokens": eng.plan.micro_batch_tokens,
        "padding_fraction": 1 - real_and_padded[0] / real_and_padded[1] if real_and_padded[1] else None,
        "first_step": first_step,
        "first_loss": train_losses[0][1] if train_losses else None,
        "last_loss": train_losses[-1][1] if train_losses else None,
        "first_eval_loss": eval_losses[0][1], "last_eval_loss": eval_losses[-1][1],
        "train_losses": train_losses, "eval_losses": eval_losses,
        "seconds": seconds, "seconds_per_step": seconds / max(len(train_losses), 1),
        "tokens": int(tokens), "tokens_per_s": float(tokens) / seconds if seconds > 0 else math.nan,
        "sample": sample, "out": str(out),
    }
    if rank0:
        png = out / "loss.png"
        split = (f"micro_batch_tokens {eng.plan.micro_batch_tokens}" if eng.plan.micro_batch_tokens
                 else f"accumulation {eng.plan.gradient_accumulation_steps}")
        plot_losses(png, train_losses, eval_losses,
                    f"{Path(args.config).name}: {eng.world_size} process(es), global batch "
                    f"{eng.plan.train_batch_size} lines, {split}")
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        summary["png"] = str(png)
        print_summary(summary, config, out, png)
    eng.close()
    return summary


def print_summary(summary: dict, config, out: Path, png: Path) -> None:
    finished = summary["first_step"] >= summary["steps"]  # resumed with nothing left to train
    lines = [
        "",
        f"done: the run had already finished at step {summary['steps']} (checkpoint.dir holds it); nothing left to "
        "train: raise the step count to go on" if finished else
        f"done: {summary['steps']} steps in {summary['seconds']:.1f} s "
        f"({summary['seconds_per_step']:.2f} s/step, {summary['tokens_per_s']:,.0f} tokens/s over "
        f"{summary['world_size']} process(es))",
        *([f"resumed at step {summary['first_step']} (checkpoint.dir): the data went on where the saved run was"]
          if summary["first_step"] else []),
        (f"train loss    {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} (nats/token)"
         if summary["first_loss"] is not None else "train loss    - (no step left to train)"),
        f"held-out loss {summary['first_eval_loss']:.3f} -> {summary['last_eval_loss']:.3f}",
    ]
    if summary["padding_fraction"] is not None:
        lines.append(f"micro_batch_tokens {summary['micro_batch_tokens']}: {summary['padding_fraction']:.1%} of "
                     "the positions computed were padding")
    if summary["sample"] is not None:
        lines.append(f"sample: {summary['sample']}")
    lines.append(f"loss curve: {png}")
    if config.monitor.enabled and config.monitor.jsonl:
        lines.append(f"metrics:    {config.monitor.jsonl}")
    lines.append(f"summary:    {out / 'summary.json'}")
    print("".join(line + "\n" for line in lines), end="", flush=True)


if __name__ == "__main__":
    main()
