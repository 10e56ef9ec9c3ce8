"""The strategy interface: how the model is held and how gradients move between ranks.

The engine counts micro-steps, weights losses and decides boundaries; a strategy does the
backend-specific parts. The engine never asks which strategy it runs on. Every strategy is
built as ``Strategy(setup, dist)``: the frozen ``engine.config.setup.Setup`` that ``engine.initialize``
resolved from the config, and the one ``DistInfo`` it got from joining the process group.

Gradient convention: every strategy leaves the *mean over ranks* of the per-rank
accumulated gradients (what DDP, FSDP and DeepSpeed all produce), so the engine weights
each rank's micro-batch loss by ``samples · world_size / global_samples``.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import DTensor

from engine.adapters import torch_internals
from engine.distributed.collectives import (average_used_gradients_, broadcast_, check_peers, failure_vote, small_max,
                                           small_sum, sum_of_squares)
from engine.distributed.group_held import NO_GROUP_HELD
from engine.distributed.mesh import GRADIENT_REDUCTION, STAGE_HOLDERS, WINDOW_STATISTICS, MeshGroups
from engine.distributed.process_group import DistInfo
from engine.errors import EngineUsageError
from engine.precision.loss_scaler import scale_
from engine.precision.policy import precision_policy
from engine.config.setup import Setup
from engine.strategies.capabilities import WindowCapabilities, fixed
from engine.strategies.gradients import local, squares_share, whole_on_every_rank
from engine.strategies.parallelize import parallelize
from engine.distributed.batch_fingerprint import check_replicas_equal
from engine.strategies.same_batch import SameBatchCheck
from engine.strategies.torch_checkpoint import load_training_state, save_training_state


@dataclass(frozen=True)
class StepResult:
    """What happened at a boundary: whether parameters changed, the gradient norm before
    clipping (a 0-dim tensor, read lazily; None when not computed), and whether a window that
    was not applied held a non-finite gradient that loss scaling cannot explain (fp32 / bf16,
    or fp16 already at its minimum loss scale) rather than an fp16 overflow."""

    applied: bool
    grad_norm: torch.Tensor | None = None
    non_finite: bool = False


def cpu_state_dict(state: dict) -> dict[str, torch.Tensor]:
    """A detached CPU copy of a state dict (what ``full_state_dict`` hands out)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def repoint_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], module: torch.nn.Module) -> None:
    """Swap, in place, the optimizer's parameters for the sharded ones of the same name."""
    if optimizer.state:
        raise ValueError(
            "the optimizer already holds state, which cannot follow its parameters into shards; "
            "pass a fresh optimizer (restore training state with eng.load_checkpoint)"
        )
    sharded = dict(module.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]


class Strategy(ABC):
    """One way of holding a model. Subclasses: one file each in ``engine/strategies``."""

    checkpoint_format: str = "none"  # recorded in the manifest; a load needs the same
    loss_scaler = None  # the engine-owned fp16 loss scaler, when the strategy uses one (checkpointed)
    # context_parallel: the context dimension's batch split and attention exchange
    # (engine.context.parallel), which the engine drives; None without a context dimension
    context = None
    # Parameters held apart, split within a subgroup and reduced over their replicas
    # (engine.distributed.group_held); NO_GROUP_HELD answers "none"
    group_held = NO_GROUP_HELD

    def __init__(self, setup: Setup, dist_info: DistInfo):
        self.settings = setup
        self.name = setup.holder  # what holds the model, recorded in checkpoints (a load checks only the format)
        self.mesh = setup.mesh
        self.rank, self.world_size, self.device = dist_info.rank, dist_info.world_size, dist_info.device
        # The mesh's process groups (engine.distributed.mesh.MeshGroups); None where every rank is a
        # data rank, whose groups are all the world's.
        self.groups = None

    def group_of(self, dims: tuple[str, ...]):
        """The process group of this rank's mesh group spanning ``dims`` (None: the world)."""
        return None if self.groups is None else self.groups.group(dims)

    @abstractmethod
    def setup(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Wrap or shard ``module`` and re-point ``optimizer`` (built on its original
        parameters) at the parameters the strategy trains. Sets ``self.module`` (the model
        the user sees), ``self.optimizer`` and ``self.forward_module`` (what ``eng(x)`` calls)."""

    def forward(self, *args, **kwargs):
        return self.forward_module(*args, **kwargs)

    def check_manual_loop(self) -> None:
        """Raise EngineUsageError, naming what to call instead, where the manual loop
        (``eng(x)`` / ``backward`` / ``step``) cannot run (a pipeline)."""

    def capabilities(self) -> WindowCapabilities:
        """What this holder does in a window (``engine.strategies.capabilities``), after ``setup``: here
        what every holder shares — collectives at any point of a window, a forward gathering nothing,
        forwards held only in one process; a holder replaces what it does otherwise."""
        return WindowCapabilities(
            communicates_before_closing_backward=fixed(True), forward_communicates=fixed(False),
            reduces_gradients_over_ranks=self.mesh.size(GRADIENT_REDUCTION) > 1,
            statistics_span_world=self.mesh.size(WINDOW_STATISTICS) == self.world_size,
            can_hold_forwards=self.world_size == 1)

    def prepare_micro_step(self, closes_window: bool) -> None:
        """Called before a micro-step's forward: whether its backward closes the window."""

    def hold_forwards(self) -> None:
        """From now on every forward of a window runs before its backwards: reduce as that allows.
        Only where ``capabilities().can_hold_forwards``."""

    def release_gathered_parameters(self) -> None:
        """After forwards without a backward (evaluation): free parameters a sharded model
        gathered and would otherwise keep until its next backward."""

    @abstractmethod
    def backward(self, loss: torch.Tensor, weight: float) -> None:
        """Backward of ``loss * weight`` (the strategy adds loss scaling)."""

    def reduce_gradients(self) -> None:
        """At the boundary: finish any gradient reduction the backward did not do (a window
        closed early, or communication deliberately deferred)."""

    def grad_squares_share(self) -> torch.Tensor | None:
        """After ``reduce_gradients``: this rank's share of the sum of squares of the whole reduced
        gradient (before the step's multiplier), such that the sum of the shares over every rank
        gives the total — the engine carries it in the window statistics' all-reduce where that one
        spans the world and hands the total to ``step``. None (the default): the step computes the
        norm itself."""
        return None

    @abstractmethod
    def step(self, multiplier: float | torch.Tensor, max_norm: float, want_norm: bool = False,
             grad_squares: float | None = None) -> StepResult:
        """Multiply the reduced gradient by ``multiplier``, clip it to ``max_norm`` (0 = off),
        update the parameters — or skip all of it when the gradient holds an inf or nan (an fp16
        overflow, or a non-finite gradient in any precision), decided alike on every rank. The
        gradient norm is computed when clipping or when ``want_norm`` (identical on every rank).
        ``grad_squares``: the total of ``grad_squares_share`` over ranks, when the engine gathered
        it (then neither the norm nor the non-finite check needs another pass or collective)."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of a small tensor over the window-statistics group (data × context: every row and
        token once; the tensor and pipeline ranks of one data index share its batch)."""
        if self.mesh.size(WINDOW_STATISTICS) > 1:
            return small_sum(tensor, self.group_of(WINDOW_STATISTICS))
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Maximum of a small tensor over every rank (an overflow on any stage or shard counts everywhere)."""
        return small_max(tensor) if self.world_size > 1 else tensor

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole, unsharded model state as CPU tensors, on every rank."""

    def held_tensors(self) -> list[torch.Tensor | None]:
        """Every tensor this rank holds for training: parameters, gradients, optimizer state
        (and a framework's gathered copies). ``engine.memory.held_bytes`` counts their storages."""
        params = list(self.module.parameters())
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return params + [p.grad for p in params] + state

    def close(self) -> None:
        """Release backend resources (called when the engine is closed)."""

    @contextlib.contextmanager
    def gathered(self, modifier_rank: int | None):
        """Whole parameters in ``self.module`` for the block (they are whole here); afterwards
        ``modifier_rank``'s values, when given, are every rank's. Collective."""
        self.check_gatherable()
        yield
        if modifier_rank is not None and self.world_size > 1:
            broadcast_([p.detach() for p in self.module.parameters()], src=modifier_rank)

    def check_gatherable(self) -> None:
        """Raise where whole parameters cannot be gathered on one rank: a mesh that splits the model."""
        if not self.mesh.is_data_parallel_only:
            raise EngineUsageError(
                f"gathered parameters (GatheredParameters, eng.gathered_parameters) are not available under "
                f"{self.mesh.describe()}: each rank holds its own pieces of the model; read the whole model with "
                "eng.full_state_dict(), change it through a checkpoint (eng.load_checkpoint)")

    # -- checkpoints (engine.state.checkpoint) ---------------------------------------------------
    def save_training_state(self, directory: str) -> None:
        """Write the model and optimizer state into ``directory`` (which may not exist yet).
        Collective: every rank calls it with the same path on a filesystem all ranks share.
        Loss scaler, scheduler, counters and RNG are saved by engine.state.checkpoint."""
        raise NotImplementedError(f"{type(self).__name__} cannot save checkpoints")

    def load_training_state(self, directory: str) -> None:
        """Restore what ``save_training_state`` wrote, possibly on another world size.
        Collective. Raises ``engine.CheckpointError`` on every rank, naming what differs
        (model keys or shapes, optimizer), before changing anything."""
        raise NotImplementedError(f"{type(self).__name__} cannot load checkpoints")

    # -- surviving a failed micro-step (automatic micro-batch size) --------------------------
    def enable_failure_guard(self) -> None:
        """From now on a rank that fails mid-window must not leave its peers blocked in a
        collective: every collective a window issues is preceded by a check of the peers'
        failure flags (``collectives.check_peers``, raising PeerError), or waits for the end
        of the window, after ``agree_on_failures``."""

    def agree_on_failures(self, failure: int) -> dict[int, int]:
        """Every rank calls this once per window attempt (a rank that raised PeerError from a
        guard already has) with its failure: 0 none, ``OUT_OF_MEMORY``, ``MEMORY_LIMIT`` or ``OTHER_ERROR``.
        Returns {rank: failure} of the ranks that failed, the same everywhere."""
        if self.world_size == 1:
            return {self.rank: failure} if failure else {}
        # On the whole world, as every guard's check (check_peers_before): a failed rank's one vote
        # answers every peer's check, whatever group the guarded collective uses.
        return failure_vote(failure, self.rank, self.world_size, self.device)

    def check_peers_before(self, group) -> None:
        """The failure guard before a collective (on ``group``): the peers' failure flags, on the world."""
        check_peers(None, rank=self.rank, world_size=self.world_size, device=self.device)

    def discard_window(self) -> None:
        """Forget a window abandoned mid-way: its gradients and any half-done reduction."""
        self.zero_grad()


class TorchStrategy(Strategy):
    """What every way of holding a model on PyTorch's own machinery shares: the mesh's groups,
    the composition of parallelisms (``engine.strategies.parallelize``), the precision policy
    (``engine.precision``) and the boundary — the averaging of used gradients over the
    gradient-reduction group, the placement-aware gradient norm (``engine.strategies.gradients``),
    clipping, the non-finite check and the step. Each holder says only how it holds the model
    and when its gradients move."""

    # A DCP checkpoint keyed by parameter names: loadable by every torch strategy on any world size.
    # ZeRO-1 needs nothing more: its optimizer holds only this rank's parameters.
    checkpoint_format = "torch-dcp"
    _checkpoint_switch = None  # activation_checkpointing: auto: parallelize's switch (capabilities() reads it)

    def __init__(self, setup: Setup, dist_info: DistInfo):
        torch_internals.check()
        super().__init__(setup, dist_info)
        self.precision = precision_policy(setup.precision, self.device.type)
        if self.mesh.needs_groups:  # collective: every rank builds the same groups
            self.groups = MeshGroups(self.mesh, self.device.type, self.rank)
        self.same_batch = SameBatchCheck(self, setup.tensor_parallel.check_batches) if self.mesh.tensor > 1 else None
        # the gradient-reduction group: its ranks' copies of a replicated gradient are equal (engine.strategies.gradients)
        self.norm_split = (self.mesh.index_in(GRADIENT_REDUCTION, self.rank), self.mesh.size(GRADIENT_REDUCTION))

    @property
    def loss_scaler(self):
        return self.precision.scaler

    def enable_failure_guard(self):
        if self.same_batch is not None:
            self.same_batch.guarded = True

    # -- building ------------------------------------------------------------------------------
    def start_equal(self, module: torch.nn.Module) -> None:
        """Every rank starts from rank 0's parameters and buffers (as DDP's constructor does)."""
        if self.world_size > 1:
            broadcast_([t.detach() for t in (*module.parameters(), *module.buffers())], src=0)

    def parallelize(self, module: torch.nn.Module, *, tensor_plan: dict | None = None,
                    whole_model: torch.nn.Module | None = None, stages: str = "", blocks=None,
                    attention_model: torch.nn.Module | None = None) -> None:
        """Apply the model-parallel dimensions and the model transforms to ``module`` in their fixed
        order (``engine.strategies.parallelize``); the holder shards the data dimension after it."""
        done = parallelize(module, self.settings, self.groups, tensor_plan=tensor_plan,
                           whole_model=whole_model, stages=stages, blocks=blocks, attention_model=attention_model)
        self._checkpoint_switch = done.checkpoint_switch
        self.context = done.context
        self.group_held = done.group_held

    def capabilities(self):
        # Parameters held apart may exchange in every forward: the ranks compare positions first.
        return replace(super().capabilities(), forward_communicates=fixed(self.group_held.exchanges_in_forward),
                       checkpoint_switch=self._checkpoint_switch)

    def _split_model_exchanges(self) -> bool:
        """Whether the model's split layers (tensor, parameters held apart) exchange in every forward:
        a window then communicates before its closing backward, whatever the holder does."""
        return self.mesh.tensor > 1 or self.group_held.exchanges_in_forward

    def dense_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters every rank of the gradient-reduction group holds alike (all but those held apart)."""
        return [p for p in self.module.parameters() if not self.group_held.holds(p)]

    # -- a micro-step ----------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.same_batch is not None:
            self.same_batch.check(args, kwargs)
        with self.precision.forward_context():
            output = self.forward_module(*args, **kwargs)
        return self.precision.outputs(output)

    def backward(self, loss, weight):
        self.precision.scale_loss(loss, weight).backward()

    # -- the boundary ------------------------------------------------------------------------------
    def average_gradients(self) -> list[int]:
        """Average the used gradients over the gradient-reduction group (data × context), as one
        process on the whole batch would have them (``collectives.average_used_gradients_``);
        returns how many ranks used each parameter."""
        ranks = self.mesh.size(GRADIENT_REDUCTION)
        if ranks == 1:
            return []
        users = average_used_gradients_(self.dense_parameters(), ranks, self.device,
                                        group=self.group_of(GRADIENT_REDUCTION),
                                        bucket_bytes=self.settings.overlap.reduce_bucket_bytes)
        self.reduce_group_held_gradients()
        return users

    def reduce_group_held_gradients(self) -> None:
        """Parameters held apart: their gradients reduced over their own replicas, divided as the
        dense ones (``engine.distributed.group_held``)."""
        self.group_held.reduce_gradients_(self.settings.overlap.reduce_bucket_bytes)

    def local_gradients(self) -> list[torch.Tensor]:
        """This rank's pieces of the reduced gradient (shards and tensor pieces of DTensors)."""
        return [local(p.grad) for p in self.module.parameters() if p.grad is not None]

    def gradient_squares(self) -> torch.Tensor:
        """This rank's share of the squared norm of the whole reduced gradient (summed over the world:
        the squared norm; ``engine.strategies.gradients``)."""
        return squares_share(self.module.parameters(), self.mesh.size(STAGE_HOLDERS), self.device,
                             self.group_held.slices, self.norm_split)

    def global_grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole gradient, identical on every rank (one small reduction of one
        number, none where every rank holds the whole gradient)."""
        params = list(self.module.parameters())
        holders = self.mesh.size(STAGE_HOLDERS)
        if not self.group_held.holds_any and whole_on_every_rank(params, holders, self.world_size):
            return sum_of_squares(self.local_gradients(), self.device).sqrt()
        return small_sum(squares_share(params, holders, self.device, self.group_held.slices, self.norm_split)).sqrt()

    def grad_squares_share(self):
        # The loss scaler checks overflow on the unscaled gradient, in step.
        return None if self.precision.scaler is not None else self.gradient_squares()

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def step(self, multiplier, max_norm, want_norm=False, grad_squares=None):
        result = self._update(multiplier, max_norm, want_norm, grad_squares)
        if self.same_batch is not None:
            self.same_batch.step_done()
        return result

    def _update(self, multiplier, max_norm, want_norm, grad_squares) -> StepResult:
        grads = self.local_gradients()
        scaler = self.precision.scaler
        discard, non_finite = self.precision.unscale_(grads, multiplier,
                                                      lambda found: self.all_reduce_max(found.to(self.device)))
        if discard:
            return StepResult(applied=False, non_finite=non_finite)
        # The global norm is the non-finite check too (an inf or nan anywhere makes it so, on every
        # rank alike): one fused pass over the gradient and one host sync per optimizer step. Given
        # ``grad_squares`` (only without a scaler), the engine's statistics brought both already.
        if grad_squares is not None:
            norm = torch.as_tensor(grad_squares, dtype=torch.float64, device=self.device).sqrt() * multiplier
            non_finite = not math.isfinite(grad_squares)
        else:
            norm = self.global_grad_norm() if scaler is None or max_norm > 0 or want_norm else None
            non_finite = scaler is None and not bool(torch.isfinite(norm))
        if non_finite:
            return StepResult(applied=False, grad_norm=norm, non_finite=True)
        if max_norm > 0:
            coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's clip_grad_norm_ rule
            if grads:
                scale_(grads, coefficient)
        self.optimizer_step()
        return StepResult(applied=True, grad_norm=norm if max_norm > 0 or want_norm else None)

    def zero_grad(self):
        # The module, not the optimizer: a sharded optimizer holds only this rank's parameters.
        self.module.zero_grad(set_to_none=True)

    # -- state ---------------------------------------------------------------------------------
    def full_state_dict(self):
        self.check_replicas("full_state_dict()")
        return self.group_held.whole(cpu_state_dict({name: value.full_tensor() if isinstance(value, DTensor) else value
                                                     for name, value in self.module.state_dict().items()}))

    def save_training_state(self, directory):
        self.check_replicas("saving a checkpoint")
        save_training_state(self.module, self.optimizer, directory, self.group_held)

    def check_replicas(self, what: str) -> None:
        """The parameters a tensor group replicates are equal on its ranks, before ``what`` keeps one
        rank's copy (issue 33; ``engine.distributed.batch_fingerprint``). Collective over the group."""
        if self.mesh.tensor > 1:
            check_replicas_equal(self.module, self.groups.group(("tensor",)), what)

    def load_training_state(self, directory):
        load_training_state(self.module, self.optimizer, directory, group_held=self.group_held)
