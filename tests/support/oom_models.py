"""Models that run out of memory on purpose (they raise the exception CUDA raises,
``torch.OutOfMemoryError``, when a micro-batch is larger than they can hold), and models
whose forward costs virtual time (``explore`` measured without a real clock)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.reference import DTYPE


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.rows = x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {ctx.rows} MiB (in backward)")


class Tripwire(torch.nn.Module):
    """Identity, except that from its ``after_calls``-th forward on, a micro-batch larger than
    ``max_micro`` on one of ``ranks`` (all when None) runs out of memory in ``where``."""

    def __init__(self, max_micro: float = float("inf"), ranks=None, where: str = "forward", after_calls: int = 0):
        super().__init__()
        self.max_micro, self.ranks, self.where, self.after_calls = max_micro, ranks, where, after_calls
        self.calls = 0
        self.trips = 0

    def forward(self, x):
        self.calls += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.size(x) > self.max_micro and self.calls > self.after_calls and (self.ranks is None or rank in self.ranks):
            self.trips += 1
            if self.where == "forward":
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {self.size(x)} MiB")
            return _RaiseInBackward.apply(x)
        return x

    def size(self, x) -> int:
        """What the limit counts: the micro-batch's rows."""
        return x.shape[0]


class TokenTripwire(Tripwire):
    """A Tripwire whose ``max_micro`` counts padded tokens: rows × length of a [rows, length,
    ...] input (for micro-batches formed by ``micro_batch_tokens``)."""

    def size(self, x) -> int:
        return x.shape[0] * x.shape[1]


def tripwire_mlp(seed: int = 0, **tripwire) -> torch.nn.Sequential:
    """tests.support.reference.mlp's shape with a Tripwire after the first layer (sharded models have
    all-gathered that layer when it trips)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), Tripwire(**tripwire),
        torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    ).to(DTYPE)


class VirtualClock:
    """Seconds that pass only when a CostPerCall module says so: explore's measurements
    become exact and independent of the machine's load (``MicroBatchTuner.clock``)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostPerCall(torch.nn.Module):
    """Identity that advances ``clock`` by ``overhead + per_square · rows²`` seconds per
    forward: the fastest micro-batch size for a batch of P rows minimises
    (P/m)·(overhead + per_square·m²), i.e. m = √(overhead/per_square)."""

    def __init__(self, clock: VirtualClock, overhead: float, per_square: float):
        super().__init__()
        self.clock, self.overhead, self.per_square = clock, overhead, per_square

    def forward(self, x):
        self.clock.now += self.overhead + self.per_square * x.shape[0] ** 2
        return x


# Factories for `python -m engine explore` in tests (module:function references); the
# test points MicroBatchTuner.clock at EXPLORE_CLOCK.
EXPLORE_CLOCK = VirtualClock()


def explore_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(CostPerCall(EXPLORE_CLOCK, overhead=0.02, per_square=0.00125),
                               torch.nn.Linear(8, 3)).to(DTYPE)


def explore_batch(size: int):
    g = torch.Generator().manual_seed(0)
    return torch.randn(size, 8, generator=g, dtype=DTYPE), torch.randn(size, 3, generator=g, dtype=DTYPE)


class Block(torch.nn.Module):
    """``x + down(tanh(up(x)))``, after an optional CostPerCall: what it saves for backward (its
    input, the wide hidden activation) a checkpoint drops to its input; a recomputed forward
    costs its virtual time again."""

    def __init__(self, width: int, hidden: int, cost: CostPerCall | None = None):
        super().__init__()
        self.cost = cost if cost is not None else torch.nn.Identity()
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.cost(x))))


class BlockMLP(torch.nn.Module):
    """8 inputs -> ``blocks`` residual Blocks (``activation_checkpointing.blocks: auto`` finds
    them) -> 3 outputs; ``clock``: the VirtualClock its blocks' CostPerCall advance (or None)."""

    def __init__(self, seed: int = 0, blocks: int = 3, width: int = 8, hidden: int = 64,
                 overhead: float = 0.0, per_square: float = 0.0):
        super().__init__()
        torch.manual_seed(seed)
        self.clock = VirtualClock()
        self.blocks = torch.nn.ModuleList(
            Block(width, hidden, CostPerCall(self.clock, overhead, per_square) if overhead or per_square else None)
            for _ in range(blocks))
        self.head = torch.nn.Linear(width, 3)
        self.to(DTYPE)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
