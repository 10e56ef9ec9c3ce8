"""A training step through the Trainer door (engine.compat.transformers.Trainer) against transformers'
own Trainer and against Microstep's own loop, on the same dense run: ratios of medians.

    python -m launch --nproc-per-node 2 bench/trainer_facade.py [--rounds 5] [--steps 6]

Workload: a float32 Llama of 4 layers, width 256, vocabulary 1024, rows of 128 tokens, all real (so
transformers' Trainer is exact here too and only time is compared), per_device_train_batch_size 4,
gradient_accumulation_steps 4, 2 ranks (gloo): global batch 32 rows. AdamW (transformers' adamw_torch,
learning rate 1e-4, constant), max_grad_norm 1.0. Variants:

* ``door``: the door's Trainer (DDP, ZeRO 0), each optimizer step one engine window of the data loader's
  micro-batches (``eng.train_batch(engine.MicroBatches(...))``);
* ``transformers``: transformers' own Trainer (accelerate's DDP, ``no_sync`` over the window);
* ``own loop``: ``engine.initialize`` with the same settings and ``eng.train_batch(batch, loss_fn)`` on
  this rank's 16 rows, ``loss_fn = m(**b).loss``.

A step is timed from ``on_step_begin`` to ``on_step_end`` (the window's forwards, backwards, clipping and
optimizer step; its micro-batches already collated), the own loop's ``train_batch``, in wall time (the
slowest rank's) and in CPU time (the process's, averaged over the ranks: on a machine shared with other
work, what the variant computes without waiting for a core). Each round builds every variant afresh
(rotating order) and trains ``--steps`` steps, of which the first two are warm-up.
Result: bench/results/trainer_facade_w<W>.json.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import transformers

import engine
from bench.common import add_record_argument, save
from engine.compat.transformers import Trainer, TrainingArguments

MICRO, ACCUMULATION, SEQUENCE, VOCAB, WARMUP = 4, 4, 128, 1024, 2


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQUENCE)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def rows(count: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (count, SEQUENCE), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def clocks() -> tuple[float, float]:
    """Wall seconds, and CPU seconds of this process (what it computes, without waiting for a core)."""
    return time.perf_counter(), time.process_time()


class StepClock(transformers.TrainerCallback):
    """(wall, CPU) seconds from each step's begin to its end."""

    def __init__(self):
        self.seconds, self.started = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = clocks()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(tuple(now - then for now, then in zip(clocks(), self.started)))


def trainer_steps(trainer_cls, args_cls, model, data, steps: int) -> list[tuple[float, float]]:
    clock = StepClock()
    args = args_cls(output_dir=tempfile.mkdtemp(prefix="trainer_facade_"), per_device_train_batch_size=MICRO,
                    gradient_accumulation_steps=ACCUMULATION, max_steps=steps, learning_rate=1e-4,
                    lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_steps=1_000_000,
                    use_cpu=True, disable_tqdm=True, seed=0)
    trainer_cls(model=copy.deepcopy(model), args=args, train_dataset=data, callbacks=[clock]).train()
    return clock.seconds


def own_loop_steps(model, data, steps: int) -> list[tuple[float, float]]:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}
    eng = engine.initialize(copy.deepcopy(model), config, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    share = MICRO * ACCUMULATION
    mine = data[eng.plan.rank * share:(eng.plan.rank + 1) * share]
    batch = {key: torch.stack([row[key] for row in mine]) for key in mine[0]}
    seconds = []
    for _ in range(steps):
        started = clocks()
        eng.train_batch(batch, lambda m, b: m(**b).loss)
        seconds.append(tuple(now - then for now, then in zip(clocks(), started)))
    eng.close()
    return seconds


def over_ranks(seconds: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Each step's wall time on the slowest rank, and its CPU time averaged over the ranks."""
    wall, cpu = torch.tensor(seconds, dtype=torch.float64).T.contiguous()
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return wall.tolist(), (cpu / dist.get_world_size()).tolist()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    engine.strip_local_rank_arg(argv)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    info = engine.init_distributed()
    torch.set_num_threads(1)
    model, data = llama(), rows(MICRO * ACCUMULATION * info.world_size * args.steps)
    runs = {
        "door": lambda: trainer_steps(Trainer, TrainingArguments, model, data, args.steps),
        "transformers": lambda: trainer_steps(transformers.Trainer, transformers.TrainingArguments, model, data,
                                              args.steps),
        "own loop": lambda: own_loop_steps(model, data, args.steps),
    }
    samples = {measure: {name: [] for name in runs} for measure in ("wall", "cpu")}
    names = list(runs)
    for index in range(args.rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            wall, cpu = over_ranks(runs[name]()[WARMUP:])
            samples["wall"][name] += wall
            samples["cpu"][name] += cpu
    medians = {measure: {name: statistics.median(values) for name, values in by_name.items()}
               for measure, by_name in samples.items()}
    ratios = {measure: {"door / transformers": m["door"] / m["transformers"],
                        "door / own loop": m["door"] / m["own loop"]} for measure, m in medians.items()}
    if info.rank == 0:
        for measure in medians:
            for name, value in medians[measure].items():
                count = len(samples[measure][name])
                print(f"{measure:>4} {name:>14}: {value * 1000:8.1f} ms per step (median of {count})")
            for name, value in ratios[measure].items():
                print(f"{measure:>4} {name:>20}: {value:.3f}")
        save(f"trainer_facade_w{info.world_size}", {"world_size": info.world_size, "rounds": args.rounds, "steps": args.steps,
                                "median_seconds": medians, "ratios": ratios, "samples": samples}, record=args.record)

if __name__ == "__main__":
    main()
