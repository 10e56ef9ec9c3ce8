"""Gradient accumulation made visible: with ``gradient_accumulation = 4`` the parameter
moves only at iterations 3 and 7.

    python examples/param_unchanged.py                                   # one process
    python -m launch --nproc-per-node 2 examples/param_unchanged.py      # two, torchrun
    python -m launch --nproc-per-node 2 --launcher deepspeed examples/param_unchanged.py

Every rank feeds its own data and prints the same (unsharded) parameter.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import engine
from engine.cli import add_override_argument
from engine.distributed.process_group import strip_local_rank_arg

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "param_unchanged.py"


def main(argv=None) -> list[int]:
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="config file (.py, .yaml, .json)")
    add_override_argument(parser)
    args = parser.parse_args(argv)
    config = engine.load_config(args.config, args.overrides)
    iterations = config.constants.get("NUM_ITERATIONS", 8)
    in_features = config.constants.get("IN_FEATURES", 16)

    torch.set_printoptions(linewidth=200)  # one line per iteration
    # Each line is printed in one write (its newline included, end=""): torchrun runs workers
    # unbuffered, where print writes text and newline apart and ranks would splice their lines.
    torch.manual_seed(0)  # the same initial model on every rank
    eng = engine.initialize(torch.nn.Linear(in_features, 1), config)
    prefix = f"rank {eng.rank}: " if eng.world_size > 1 else ""
    data = torch.Generator().manual_seed(1000 + eng.rank)  # each rank its own samples

    def first_elements() -> torch.Tensor:
        return eng.full_state_dict()["weight"].flatten()[:10]

    updated = []
    previous = first_elements()
    for iteration in range(iterations):
        micro_batch = eng.plan.micro_batch_sizes[iteration % eng.plan.gradient_accumulation_steps]
        x = torch.randn(micro_batch, in_features, generator=data)
        y = torch.randn(micro_batch, 1, generator=data)
        loss = torch.nn.functional.mse_loss(eng(x), y)
        eng.backward(loss)
        eng.step()
        current = first_elements()
        print(f"{prefix}iteration {iteration}, first 10 elements of param: {current}\n", end="", flush=True)
        if not torch.equal(current, previous):
            updated.append(iteration)
        previous = current
    print(f"{prefix}parameter updated at iterations {updated} "
          f"(gradient_accumulation_steps = {eng.plan.gradient_accumulation_steps})\n", end="", flush=True)
    eng.close()
    return updated


if __name__ == "__main__":
    main()
