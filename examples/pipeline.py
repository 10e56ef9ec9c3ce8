"""One training script for every pipeline size: an MLP (an nn.Sequential) trained with
``train_batch((inputs, labels), loss_fn)``, unchanged between

    python examples/pipeline.py --set pipeline.stages=1                   # one process, no pipeline
    python -m launch --nproc-per-node 2 examples/pipeline.py              # pipeline 2
    python -m launch --nproc-per-node 4 examples/pipeline.py              # pipeline 2 × data 2

(configs/pipeline.yaml). Rank 0 prints the loss of every step and a checksum of the whole
model; in float64 all three runs print the same numbers (the update is the full-batch one).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import engine
from engine.cli import add_override_argument
from engine.distributed.process_group import strip_local_rank_arg

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "pipeline.yaml"


@engine.loss_on_outputs  # loss_fn(outputs, labels): on the last stage under a pipeline
def loss_fn(outputs, labels):
    return F.mse_loss(outputs, labels)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)).double()


def dataset(samples: int = 64) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 8, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, torch.sin(x[:, :2] * 2) + 0.1 * x[:, 2:4])


def main(argv=None) -> list[str]:
    """Train; returns what rank 0 prints (every rank: its own view of the same numbers)."""
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--epochs", type=int, default=2)
    add_override_argument(parser)
    args = parser.parse_args(argv)
    eng = engine.initialize(model(), engine.load_config(args.config, args.overrides))
    data = eng.batches(dataset(), shuffle=True, seed=0)  # this data-parallel rank's (inputs, labels)
    lines = []
    for _ in range(args.epochs):
        for batch in data:
            loss = eng.train_batch(batch, loss_fn)
            lines.append(f"step {eng.global_steps}: loss {loss:.12f}, lr {eng.lr_scheduler.get_last_lr()[0]:.4f}")
    checksum = sum(float(v.double().sum()) for v in eng.full_state_dict().values())
    lines.append(f"{eng.plan.gradient_accumulation_steps} micro-batches per step on {eng.plan.world_size} "
                 f"data-parallel rank(s); model checksum {checksum:.12f}")
    if eng.rank == 0:
        print("\n".join(lines))
    eng.close()
    return lines


if __name__ == "__main__":
    main()
