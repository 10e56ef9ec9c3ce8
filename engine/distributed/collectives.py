"""Collectives shared by the strategies, the engine and the checkpoints.

* bucketed flat reductions and broadcasts of many tensors (DDP-style buckets);
* small statistics (a few numbers summed or maxed over ranks);
* failure votes: every rank learns which ranks failed in a window before anyone enters the
  next collective, so no rank is left waiting for one that has given up;
* ``agree``: the same for errors found while checkpointing, raised on every rank;
* ``peer_lost_as_error``: an agreement whose peer never came becomes a ``PeerLostError``;
* ``positions_of_ranks`` / ``post_positions``: where each rank is (its window and micro-step),
  for the engine's per-window check that no collective pairs different windows;
* ``all_to_all``: the differentiable all-to-all (even or uneven) of context parallelism and of the
  tokens dispatched to the rank holding their layer's slice.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.adapters.torch_internals import eager_where_compiled_collectives_fail, flatten, foreach_norm, unflatten
from engine.distributed.process_group import agreement_timeout_seconds, control_group, is_peer_lost
from engine.errors import CheckpointError, EngineUsageError, MicrostepError, PeerError, PeerLostError

BUCKET_BYTES = 25 * 1024 * 1024
# what a rank reports in a failure vote (MEMORY_LIMIT: a measured peak over auto_memory_limit)
OUT_OF_MEMORY, OTHER_ERROR, MEMORY_LIMIT = 1, 2, 3


# -- many tensors ------------------------------------------------------------------------------
def buckets(tensors: list[torch.Tensor], limit: int = BUCKET_BYTES):
    """Consecutive runs of same-dtype, same-device tensors of at most ``limit`` bytes."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > limit or t.dtype != bucket[0].dtype or t.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def all_reduce_mean_(tensors: list[torch.Tensor], world_size: int, group=None, bucket_bytes: int | None = None) -> None:
    """Replace each tensor by its mean over the ``world_size`` ranks of ``group`` (None: all),
    one flat all-reduce per bucket (of at most ``bucket_bytes``; None: ``BUCKET_BYTES``)."""
    for bucket in buckets(tensors, bucket_bytes or BUCKET_BYTES):
        flat = flatten(bucket)
        dist.all_reduce(flat, group=group)
        flat.div_(world_size)
        for tensor, reduced in zip(bucket, unflatten(flat, bucket)):
            tensor.copy_(reduced)


def average_used_gradients_(params, world_size: int, device: torch.device, group=None,
                            bucket_bytes: int | None = None) -> list[int]:
    """Average the gradients of ``params`` (those that require grad) over the ``world_size``
    ranks of ``group``, as one process on the whole batch would have them: a parameter no rank
    used keeps no gradient (the optimizer leaves it alone, weight decay included), one that
    only some ranks used counts zero on the others (a DTensor's local piece is what is reduced:
    the group holds copies of the same piece). Returns how many ranks used each parameter."""
    params = [p for p in params if p.requires_grad]
    users = torch.tensor([float(p.grad is not None) for p in params], device=device)
    dist.all_reduce(users, group=group)  # one small all-reduce per reduced window
    counts = [int(count) for count in users.tolist()]
    grads = []
    for p, count in zip(params, counts):
        if count == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    all_reduce_mean_(grads, world_size, group=group, bucket_bytes=bucket_bytes)
    return counts


@torch.no_grad()
def broadcast_(tensors: list[torch.Tensor], src: int, group=None, bucket_bytes: int | None = None) -> None:
    """Overwrite ``tensors`` with (global) rank ``src``'s values, one flat broadcast per bucket
    (of at most ``bucket_bytes``; None: ``BUCKET_BYTES``) over ``group`` (default: all ranks)."""
    for bucket in buckets(tensors, bucket_bytes or BUCKET_BYTES):
        flat = flatten(bucket)
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:
            for tensor, value in zip(bucket, unflatten(flat, bucket)):
                tensor.copy_(value)


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ of the squared elements of ``tensors``, a float64 scalar on ``device``."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = foreach_norm(tensors, 2.0)
    return torch.stack([n.to(torch.float64) for n in norms]).square().sum().to(device)


# -- small statistics -----------------------------------------------------------------------------
# On gloo a few numbers are reduced as one all-gather and a sum (or maximum) in rank order, the
# same on every rank: gloo's all-reduce goes twice around the ring (a reduce-scatter, then an
# all-gather), which for a few numbers waits twice as long (docs/benchmarks.md, "small
# statistics"). Past GATHERED_LIMIT gathered elements the all-reduce moves fewer bytes; NCCL's
# all-reduce of a few numbers is a latency-bound tree already. Use the returned tensor: the
# input may be overwritten.
GATHERED_LIMIT = 1 << 16


def small_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """A small tensor summed over the ranks of ``group`` (None: every rank), identical on every rank."""
    gathered = _gathered_small(tensor, group)
    if gathered is None:
        dist.all_reduce(tensor, group=group)
        return tensor
    return gathered.sum(0)


def small_max(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """A small tensor's element-wise maximum over the ranks of ``group`` (None: every rank)."""
    gathered = _gathered_small(tensor, group)
    if gathered is None:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return tensor
    return gathered.amax(0)


def _gathered_small(tensor: torch.Tensor, group) -> torch.Tensor | None:
    """Every rank's ``tensor`` stacked in rank order; None past GATHERED_LIMIT or off gloo."""
    size = dist.get_world_size(group)
    if size * tensor.numel() > GATHERED_LIMIT or dist.get_backend(group) != "gloo":
        return None
    everyone = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(everyone, tensor.contiguous(), group=group)
    return torch.stack(everyone)


def max_over_ranks(values: list[int]) -> list[int]:
    """Element-wise maximum of a few integers over ranks, on the control group: a peer that
    never joins makes it raise after the agreement timeout instead of waiting forever."""
    group = control_group()
    if group is None:
        return list(values)
    return small_max(torch.tensor(values, dtype=torch.int64), group).tolist()


def peer_closed(error: BaseException) -> bool:
    """The transport saw a peer's connection close (its process ended: killed, crashed, exited),
    rather than wait past the timeout for it (gloo and nccl word both differently)."""
    text = str(error).lower()
    return any(words in text for words in ("connection reset", "connection closed", "pair closure", "broken pipe"))


def lost_peer_words(error: BaseException, started: float) -> dict[str, str]:
    """How a collective begun at ``started`` (``time.monotonic()``) lost its peer, as the fields a
    ``stuck`` text is formatted with: ``{waited}`` ("waited distributed.agreement_timeout_seconds
    (600 s) for its peers" or "lost a peer 0.1 s into waiting for its peers"), ``{cause}`` (a
    connection closed, or a peer stopped or stuck elsewhere), ``{timeout}`` (the timeout in s) and
    ``{rank}`` (this rank, global)."""
    timeout, seconds = agreement_timeout_seconds(), time.monotonic() - started
    rank = str(dist.get_rank()) if dist.is_initialized() else "0"
    if peer_closed(error):
        return {"rank": rank, "timeout": f"{timeout:g}", "waited": f"lost a peer {seconds:.1f} s into waiting for its peers",
                "cause": ("a peer's connection closed, not a timeout: its process ended (killed, crashed or exited; "
                          "its own log says why)")}
    return {"rank": rank, "timeout": f"{timeout:g}",
            "waited": f"waited distributed.agreement_timeout_seconds ({timeout:g} s) for its peers",
            "cause": "a peer stopped, or is stuck elsewhere (e.g. in another collective)"}


def agreed_max(values: list[int], stuck: str) -> list[int]:
    """``max_over_ranks`` for an agreement the engine's callers must all reach: a peer that
    never came (gone, or absent past the agreement timeout) raises an ``EngineUsageError``
    saying ``stuck``, formatted with :func:`lost_peer_words` (``{waited}``, ``{cause}``, ``{timeout}``)."""
    started = time.monotonic()
    try:
        return max_over_ranks(values)
    except RuntimeError as error:
        if isinstance(error, MicrostepError) or not is_peer_lost(error):
            raise
        raise EngineUsageError(stuck.format(**lost_peer_words(error, started))) from error


class PostedPositions:
    """Every rank's position, gathered in flight on the control group (``post_positions``)."""

    def __init__(self, work, everyone: list[torch.Tensor], stuck: str):
        self._work, self._everyone, self._stuck = work, everyone, stuck

    def wait(self) -> list[list[int]]:
        """Every rank's position, in rank order. A peer that never comes (gone, or absent past the
        agreement timeout) raises a PeerLostError saying ``stuck``, formatted with
        :func:`lost_peer_words`: when and how the peer was lost."""
        if self._work is not None:
            started = time.monotonic()
            try:
                self._work.wait()
            except RuntimeError as error:
                if isinstance(error, MicrostepError) or not is_peer_lost(error):
                    raise
                raise PeerLostError(self._stuck.format(**lost_peer_words(error, started))) from error
        return [t.tolist() for t in self._everyone]


def post_positions(position: list[int], stuck: str) -> PostedPositions:
    """Start gathering every rank's ``position`` (a fixed number of integers) on the control group,
    without waiting: ``wait()`` on the result."""
    mine = torch.tensor(position, dtype=torch.int64)
    group = control_group()
    if group is None:
        return PostedPositions(None, [mine], stuck)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    return PostedPositions(dist.all_gather(everyone, mine, group=group, async_op=True), everyone, stuck)


def positions_of_ranks(position: list[int], stuck: str) -> list[list[int]]:
    """Every rank's ``position``, in rank order, on every rank: one all-gather on the control group
    (``PostedPositions.wait`` says how a peer that never comes is reported)."""
    return post_positions(position, stuck).wait()


# -- the all-to-all of context parallelism and token dispatch -------------------------------------
class _AllToAll(torch.autograd.Function):
    """All-to-all over ``group``; its gradient is the reverse all-to-all (the counts swapped)."""

    @staticmethod
    def forward(ctx, tensor, group, send_counts, receive_counts):
        ctx.group, ctx.send_counts, ctx.receive_counts = group, send_counts, receive_counts
        return _all_to_all(tensor, group, send_counts, receive_counts)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.receive_counts, ctx.send_counts), None, None, None


def _all_to_all(tensor: torch.Tensor, group, send_counts, receive_counts) -> torch.Tensor:
    tensor = tensor.contiguous()
    if send_counts is None:
        received = torch.empty_like(tensor)
    else:
        received = tensor.new_empty((sum(receive_counts), *tensor.shape[1:]))
    dist.all_to_all_single(received, tensor, output_split_sizes=receive_counts, input_split_sizes=send_counts,
                           group=group)
    return received


@eager_where_compiled_collectives_fail  # torch 2.11's compiler back-propagates zeros through it
def all_to_all(tensor: torch.Tensor, group, send_counts: list[int] | None = None,
               receive_counts: list[int] | None = None) -> torch.Tensor:
    """Exchange rows of ``tensor`` (dim 0) between the ranks of ``group``, differentiably, on any
    backend (gloo included). Without counts dim 0 splits evenly: entry j goes to rank j, entry j of
    the result came from rank j. With counts (uneven): the first ``send_counts[0]`` rows go to rank 0,
    the next ``send_counts[1]`` to rank 1, ...; ``receive_counts[j]`` rows come from rank j
    (:func:`exchange_counts` learns them)."""
    return _AllToAll.apply(tensor, group, send_counts, receive_counts)


def pass_along(tensors: list[torch.Tensor], send_to: int, receive_from: int, group) -> list[torch.Tensor]:
    """Send ``tensors`` to global rank ``send_to`` and receive as many of the same shapes from
    ``receive_from`` (one step round a ring: everyone sends and receives at once, any backend)."""
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    operations = [dist.P2POp(dist.isend, t.contiguous(), send_to, group) for t in tensors]
    operations += [dist.P2POp(dist.irecv, r, receive_from, group) for r in received]
    for request in dist.batch_isend_irecv(operations):
        request.wait()
    return received


def exchange_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """How many rows each rank of ``group`` will send this rank, given how many this rank sends
    each (an int64 vector of the group's size): one small all-to-all."""
    received = torch.empty_like(send_counts)
    dist.all_to_all_single(received, send_counts.contiguous(), group=group)
    return received


# -- failures inside a window ---------------------------------------------------------------
def failure_vote(failure: int, rank: int, world_size: int, device, group=None) -> dict[int, int]:
    """One all-reduce of a per-rank vector: {rank: failure} of the ranks reporting one
    (0 = none, ``OUT_OF_MEMORY``, ``OTHER_ERROR``, ``MEMORY_LIMIT``); the same on every rank."""
    votes = torch.zeros(world_size, dtype=torch.int32, device=device)
    votes[rank] = int(failure)
    dist.all_reduce(votes, group=group)
    return {r: int(votes[r]) for r in torch.nonzero(votes).flatten().tolist()}


def check_peers(group, *, rank: int, world_size: int, device) -> None:
    """Vote "no failure" before a collective; raise PeerError when a peer voted one instead.
    A failed rank's own vote answers whichever check its peers reach next."""
    failures = failure_vote(0, rank, world_size, device, group)
    if failures:
        raise PeerError(failures)


# -- failures while checkpointing ----------------------------------------------------------
@contextlib.contextmanager
def peer_lost_as_error(what: str):
    """Inside: collectives on the control group. One that gave up on a peer (the peer's process
    is gone, or it did not come within the agreement timeout) raises a PeerLostError that
    says so instead of the transport's message."""
    started = time.monotonic()
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, PeerLostError) or not is_peer_lost(error):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        if peer_closed(error):
            raise PeerLostError(
                f"{what}: rank {rank} lost a peer {time.monotonic() - started:.1f} s into the agreement: its "
                f"connection closed, not a timeout: the peer's process ended (killed, crashed or exited; its own "
                f"log says why) [{error}]") from error
        raise PeerLostError(
            f"{what}: rank {rank} waited distributed.agreement_timeout_seconds ({agreement_timeout_seconds():g} s) "
            f"and a peer did not answer: it has stopped (its own log says why), or is stuck elsewhere, e.g. in "
            f"another collective [{error}]") from error


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` (a small picklable object) on every rank, over the control group."""
    group = control_group()
    if group is None:
        return value
    box = [value]
    with peer_lost_as_error("waiting for rank 0's decision"):
        dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gathered(value: Any, what: str) -> list[Any]:
    """Every rank's ``value`` (small, picklable) in rank order, on every rank, over the control
    group; a peer that never comes raises a PeerLostError naming ``what``."""
    group = control_group()
    if group is None:
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size()
    with peer_lost_as_error(what):
        dist.all_gather_object(everyone, value, group=group)
    return everyone


def agree(problem: str | None, cause: BaseException | None = None) -> None:
    """Every rank learns whether any rank failed, and all raise the same CheckpointError."""
    everyone = gathered(problem, "checkpoint agreement")
    failed = [(rank, text) for rank, text in enumerate(everyone) if text]
    if not failed:
        return
    texts = sorted({text for _, text in failed})
    if len(texts) == 1:
        ranks = "every rank" if len(failed) == len(everyone) > 1 else \
            f"rank {', '.join(str(r) for r, _ in failed)}" if len(everyone) > 1 else ""
        message = texts[0] + (f" [{ranks}]" if ranks else "")
    else:
        message = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
    raise CheckpointError(message) from cause


def describe(error: BaseException) -> str:
    """One line for an exception, unwrapping DCP's per-rank CheckpointException."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures and not isinstance(error, PeerError):
        rank, (inner, _trace) = next(iter(sorted(failures.items(), key=lambda item: item[0])))
        return f"{type(inner).__name__}: {inner} (rank {rank})"
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{type(error).__name__}: {error}"
