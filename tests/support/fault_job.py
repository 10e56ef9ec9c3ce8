"""The training job of tests/distributed/test_fault.py: the loop of docs/checkpoints.md with automatic
checkpoints, on a float64 model with SGD + momentum and a warm-up schedule, so that a step
counted twice or lost shows in the parameters, the momentum and the learning rate.

As a script, under torchrun (every rank writes ``OUT/rank<r>.pt``, a :func:`snapshot`)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        tests/support/fault_job.py OUT --stage 3 --kill-rank 1 --kill-at 11

``--kill-at N``: rank ``--kill-rank`` kills itself (SIGKILL) in its N-th micro-batch loss,
on the first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT 0). ``--term-at N``: every
rank sends itself SIGTERM there instead; ``--int-at N``: SIGINT (a Ctrl-C), with the default
``stop_signals``. ``--kill-in-write N`` / ``--term-in-write N``: the signal comes from inside the
background write of checkpoint ``step_N`` instead (SIGKILL on rank ``--kill-rank``, first attempt
only; SIGTERM on every rank), before its checksums. ``--blocking``: ``checkpoint.async: false``. ``--until-stopped``: every rank prints ``ready <pid>``
once its engine handles stop signals, then trains (slowly, without periodic saves) until one
stops it; with ``--no-checkpoint`` its config has no ``checkpoint`` section (a Ctrl-C just ends it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `tests` and `engine` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import engine
from engine.state import checkpoint
from tests.support.reference import mlp, mse

GLOBAL_BATCH, MICRO, STEPS, DATASET_SIZE = 8, 2, 8, 28  # 3 steps per epoch: resumes cross epochs
EVERY_STEPS, KEEP_LAST, DATA_SEED = 2, 2, 3
LR, MOMENTUM, WARMUP = 0.1, 0.9, 3


def config(stage: int, directory, **checkpoint) -> dict:
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO, "seed": 0,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": STEPS,
                                                               "warmup_num_steps": WARMUP}},
            "checkpoint": {"dir": str(directory), "every_steps": EVERY_STEPS, "keep_last": KEEP_LAST,
                           **checkpoint}}


def signal_in_background_write(step: int, sig: int) -> None:
    """Send ``sig`` to this process from inside the background write of ``step_<step>``, once
    its files are written and before their checksums and publish."""
    checksums = checkpoint._agreed_checksums

    def signalled(tmp, rank, world_size):
        if threading.current_thread() is not threading.main_thread() and f"step_{step:08d}" in tmp.name:
            os.kill(os.getpid(), sig)
            time.sleep(0.5)  # SIGTERM: the main thread's handler runs meanwhile; SIGKILL: never returns
        return checksums(tmp, rank, world_size)

    checkpoint._agreed_checksums = signalled


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randn(DATASET_SIZE, 8, generator=g, dtype=torch.float64),
                                          torch.randn(DATASET_SIZE, 3, generator=g, dtype=torch.float64))


class FaultyLoss:
    """``mse``, with a signal sent to this process in its ``at``-th call (1-based). Every call
    also draws from torch's generator, as dropout would, so that random generators restored
    at the wrong state show in the draw a snapshot makes."""

    def __init__(self, at: int | None = None, sig: int = signal.SIGTERM):
        self.at, self.sig, self.calls = at, sig, 0

    def __call__(self, model, batch):
        self.calls += 1
        torch.rand(1)
        if self.calls == self.at:
            os.kill(os.getpid(), self.sig)
        return mse(model, batch)


class SlowLoss(FaultyLoss):
    """A training step that takes a while, so that a signal usually comes inside a window."""

    def __call__(self, model, batch):
        time.sleep(0.01)
        return super().__call__(model, batch)


def train(eng, loss_fn=None, steps: int = STEPS):
    """The documented loop; returns its DistributedBatches. eng.batches() called again with the
    same arguments returns the same object, which goes on with the next epoch."""
    loss_fn = loss_fn or FaultyLoss()
    data = dataset()
    batches = eng.batches(data, shuffle=True, seed=DATA_SEED)
    while eng.global_steps < steps:
        for batch in eng.batches(data, shuffle=True, seed=DATA_SEED):
            if eng.global_steps >= steps:
                break
            eng.train_batch(batch, loss_fn)
    return batches


def momentum(eng) -> dict[str, torch.Tensor]:
    """{parameter name: momentum buffer} of the parameters this rank's optimizer holds (whole)."""
    names = {id(p): n for n, p in eng.module.named_parameters()}
    out = {}
    for group in eng.optimizer.param_groups:
        for p in group["params"]:
            buffer = eng.optimizer.state[p]["momentum_buffer"]
            out[names[id(p)]] = (buffer.full_tensor() if hasattr(buffer, "full_tensor") else buffer).detach().clone()
    return out


def snapshot(eng, batches) -> dict:
    """What must equal the uninterrupted run's: parameters, momentum, counters, learning rate,
    data position and the random generators (a draw after training)."""
    return {"params": eng.full_state_dict(), "momentum": momentum(eng),
            "counters": (eng.micro_steps, eng.global_steps, eng.global_samples, eng.skipped_steps),
            "lr": eng.optimizer.param_groups[0]["lr"],
            "data": batches.state_dict(),
            "rand": torch.rand(3),
            "resumed_from": eng.autosave.resumed_from if eng.autosave is not None else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--term-at", type=int, default=None)
    parser.add_argument("--int-at", type=int, default=None)
    parser.add_argument("--kill-in-write", type=int, default=None)
    parser.add_argument("--term-in-write", type=int, default=None)
    parser.add_argument("--blocking", action="store_true")
    parser.add_argument("--until-stopped", action="store_true")
    parser.add_argument("--no-checkpoint", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    out = Path(args.out)
    if args.until_stopped:
        settings = config(args.stage, out / "checkpoints", every_steps=None)
        if args.no_checkpoint:
            del settings["checkpoint"]
        eng = engine.initialize(mlp(0), settings)
        sys.stdout.write(f"ready {os.getpid()}\n")  # one write: torchrun's `python -u` would split a print
        sys.stdout.flush()
        train(eng, SlowLoss(), steps=10**9)
    eng = engine.initialize(mlp(0), config(args.stage, out / "checkpoints", **{"async": not args.blocking}))
    if first_attempt and args.kill_in_write is not None and eng.rank == args.kill_rank:
        signal_in_background_write(args.kill_in_write, signal.SIGKILL)
    elif args.term_in_write is not None:
        signal_in_background_write(args.term_in_write, signal.SIGTERM)
    loss_fn = FaultyLoss()
    if first_attempt and args.kill_at is not None and eng.rank == args.kill_rank:
        loss_fn = FaultyLoss(args.kill_at, signal.SIGKILL)
    elif args.term_at is not None:
        loss_fn = FaultyLoss(args.term_at, signal.SIGTERM)
    elif args.int_at is not None:
        loss_fn = FaultyLoss(args.int_at, signal.SIGINT)
    batches = train(eng, loss_fn)
    torch.save(snapshot(eng, batches), out / f"rank{eng.rank}.pt")
    eng.close()


if __name__ == "__main__":
    main()
