"""What the precision policy changes: the accumulated gradient's error as the window grows,
and the bytes ZeRO-2/3 gather per step (counted, not timed).

    python -m bench.precision_policy                      # the error table (one process)
    python -m launch --nproc-per-node 2 bench/precision_policy.py --bytes   # gathered bytes

Error: one window of A micro-steps over a fixed global batch of 64 (so each micro-batch holds
64/A samples) on an fp32 MLP in bf16, SGD with lr 1 and no momentum, so the parameter update
*is* the window's gradient. The error is the norm of the difference to the float64 full-batch
gradient, relative to that gradient's norm. fp32 accumulation (the default) adds each
micro-step's bf16 gradient into an fp32 sum; bf16 accumulation
(``data_types.grad_accum_dtype: bf16``) rounds the running sum to bf16 after every add.
Results: bench/results/precision_policy.json (and _bytes_w<W>.json).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import torch
import torch.nn.functional as F

import engine

ACCUMULATIONS = (1, 2, 4, 8, 16, 32, 64)
GLOBAL = 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 8))


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL, 32, generator=g), torch.randn(GLOBAL, 8, generator=g)


def _mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def reference_gradient(model: torch.nn.Module, batch) -> list[torch.Tensor]:
    """The float64 full-batch gradient."""
    exact = copy.deepcopy(model).double()
    _mse(exact, tuple(t.double() for t in batch)).backward()
    return [p.grad for p in exact.parameters()]


def window_gradient(model: torch.nn.Module, batch, accumulation: int, config: dict) -> list[torch.Tensor]:
    """The gradient one engine window of ``accumulation`` micro-steps applies (SGD, lr 1)."""
    eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": GLOBAL, "gradient_accumulation_steps": accumulation,
                                                  **config}, optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    before = [p.detach().double().clone() for p in eng.module.parameters()]
    eng.train_batch(batch, _mse)
    return [b - p.detach().double() for b, p in zip(before, eng.module.parameters())]


def relative_error(got: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """‖got − expected‖ / ‖expected‖ over the whole gradient."""
    difference = sum(float((g - e).pow(2).sum()) for g, e in zip(got, expected))
    return (difference / sum(float(e.pow(2).sum()) for e in expected)) ** 0.5


def accumulation_errors(accumulations=ACCUMULATIONS) -> dict[str, dict[int, float]]:
    """{mode: {A: relative error}} for fp32 and bf16 accumulation (and fp32 training, for scale)."""
    model, batch = _model(), _batch()
    expected = reference_gradient(model, batch)
    modes = {"fp32 training": {},
             "bf16, fp32 accumulation": {"bf16": {"enabled": True}},
             "bf16, bf16 accumulation": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}}
    return {mode: {a: relative_error(window_gradient(model, batch, a, config), expected) for a in accumulations}
            for mode, config in modes.items()}


def gathered_bytes(rank: int, world: int, stage: int, precision: dict, accumulation: int = 4) -> int:
    """Bytes this rank all-gathers for one optimizer step at ZeRO ``stage`` (2 ranks or more)."""
    from bench.comm_count import CommCounter
    from bench.common import mlp

    config = {"train_batch_size": 8 * world, "gradient_accumulation_steps": accumulation,
              "zero_optimization": {"stage": stage, "shard_unit_size": 1}, **precision}
    eng = engine.initialize(mlp(width=256, depth=4), config, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    g = torch.Generator().manual_seed(rank)
    batch = (torch.randn(8, 256, generator=g), torch.randn(8, 256, generator=g))
    eng.train_batch(batch, _mse)  # warm-up: lazy initialisation
    with CommCounter() as comm:
        eng.train_batch(batch, _mse)
    eng.close()
    return comm.bytes["all_gather"]


PRECISIONS = {"bf16 autocast (fp32 parameters gathered)": {"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}},
              "bf16 parameters (default)": {"bf16": {"enabled": True}}}


def main(argv=None) -> None:
    from bench.common import save

    argv = sys.argv[1:] if argv is None else argv
    record = "--record" in argv  # as every bench's --record (bench/common.py)
    if "--bytes" in argv:
        import torch.distributed as dist

        from bench.common import start_ranks

        start_ranks("gathered bytes per step", rounds=1, argv=[])
        rows = {f"stage {stage}": {name: gathered_bytes(dist.get_rank(), dist.get_world_size(), stage, precision) for name, precision in PRECISIONS.items()}
                for stage in (2, 3)}
        if dist.get_rank() == 0:
            for stage, row in rows.items():
                print(stage, row)
            save(f"precision_policy_bytes_w{dist.get_world_size()}", rows, record=record)
        return
    errors = accumulation_errors()
    print("| A | " + " | ".join(errors) + " |")
    print("|---|" + "---|" * len(errors))
    for a in ACCUMULATIONS:
        print(f"| {a} | " + " | ".join(f"{errors[mode][a]:.2e}" for mode in errors) + " |")
    save("precision_policy", {mode: {str(a): e for a, e in row.items()} for mode, row in errors.items()}, record=record)


if __name__ == "__main__":
    main()
