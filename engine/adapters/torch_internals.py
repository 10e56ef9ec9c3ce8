"""The torch internals Microstep uses, checked once when a strategy is built.

Supported: torch 2.11 (what the GPU machines ship) and newer; tested 2.11 through 2.14 (CI:
2.13). Each entry below is either a private name (leading underscore) or a semi-public
attribute whose meaning is not documented as stable; docs/compatibility.md records what was
checked in each version for each. What ``check`` decides at ``engine.initialize``:

* older than 2.11: refused (names used here did not exist yet);
* newer than the newest tested: a warning, once per process, then training goes on: a user
  who installed a newer torch keeps it;
* any torch lacking a name this module uses: refused, naming it, instead of failing
  mid-training (``drop_unreduced_gradients`` runs only after an out-of-memory).
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, NamedTuple

import torch
import torch._utils
import torch.distributed as dist
from torch.distributed import ReduceOp

from engine.errors import UnsupportedFrameworkError, UntestedFrameworkWarning

OLDEST_SUPPORTED = (2, 11)
NEWEST_TESTED = (2, 14)  # the whole suite passed on it (docs/compatibility.md)

# -- tensors (stable private helpers, used by torch.nn.utils and the optimizers) -----------
flatten = torch._utils._flatten_dense_tensors
unflatten = torch._utils._unflatten_dense_tensors
foreach_norm = torch._foreach_norm
foreach_mul_ = torch._foreach_mul_
# GradScaler's fused kernel: multiply by inv_scale and flag non-finite values in one pass.
non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_


def version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# torch 2.11's compiler traces an autograd.Function whose backward runs an in-place c10d
# collective (``dist.all_to_all_single`` into a new tensor) with a zero incoming gradient: a
# compiled block then back-propagates zeros through it, silently (found on 2.11.0 by
# tests/distributed/test_context_parallel.py's compiled scenario; 2.13 traces it right). Used on
# ``engine.distributed.collectives.all_to_all`` (context parallelism, token dispatch).
COMPILED_COLLECTIVE_BACKWARD_FROM = (2, 13)


def eager_where_compiled_collectives_fail(fn):
    """``fn`` kept out of compiled graphs (run eagerly, a graph break around it) on a torch whose
    compiler gets the backward of a collective inside an autograd.Function wrong; ``fn`` itself on
    one that traces it right."""
    if version() >= COMPILED_COLLECTIVE_BACKWARD_FROM:
        return fn
    return torch.compiler.disable(fn)


_warned_untested = False  # the newer-than-tested warning is given once per process


def _tested_range() -> str:
    (low_major, low_minor), (high_major, high_minor) = OLDEST_SUPPORTED, NEWEST_TESTED
    return f"{low_major}.{low_minor} to {high_major}.{high_minor}"


def check() -> None:
    """Refuse a torch older than supported or lacking a name this adapter uses; warn once for
    one newer than tested."""
    global _warned_untested
    found = version()
    if found < OLDEST_SUPPORTED:
        raise UnsupportedFrameworkError(
            f"torch {torch.__version__} is older than Microstep supports (tested with torch {_tested_range()}); "
            f"the torch internals it relies on appeared in {OLDEST_SUPPORTED[0]}.{OLDEST_SUPPORTED[1]}: "
            f"upgrade torch (e.g. pip install torch=={NEWEST_TESTED[0]}.{NEWEST_TESTED[1]}.*)")
    missing = [name for name, present in _required() if not present]
    if missing:
        raise UnsupportedFrameworkError(
            f"torch {torch.__version__} lacks {', '.join(missing)}, which Microstep relies on "
            f"(tested with torch {_tested_range()}); install a tested version")
    if found > NEWEST_TESTED and not _warned_untested:
        _warned_untested = True
        warnings.warn(
            f"torch {torch.__version__} is newer than Microstep was tested with (torch {_tested_range()}); "
            "every torch internal it uses is present, so training goes on. If results look wrong, "
            "python -m engine verify compares your config against one process (docs/exactness.md)",
            UntestedFrameworkWarning, stacklevel=3)


def _required():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param_group
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.distributed.pipelining import PipelineStage
    from torch.nn.parallel import DistributedDataParallel

    for name in ("_get_fsdp_state", "set_custom_all_gather", "set_custom_reduce_scatter", "set_is_last_backward",
                 "set_reshard_after_forward"):
        yield f"FSDPModule.{name}", hasattr(FSDPModule, name)
    yield "FSDPState._root_post_backward_final_callback", hasattr(FSDPState, "_root_post_backward_final_callback")
    for name in ("DefaultAllGather", "DefaultReduceScatter"):
        yield f"fsdp._fully_shard._fsdp_collectives.{name}", hasattr(_fsdp_collectives, name)
    if not hasattr(FSDPModule, "reset_iter_state"):  # torch 2.11: _reset_iter_state_before_2_13 does it
        group = _fsdp_param_group.FSDPParamGroup
        for name in ("_wait_for_post_backward", "_to_sharded"):
            yield f"FSDPParamGroup.{name}", hasattr(group, name)
    yield "FSDPParamGroup._register_state_dict_hooks", hasattr(_fsdp_param_group.FSDPParamGroup,
                                                                 "_register_state_dict_hooks")
    from torch.distributed.device_mesh import DeviceMesh

    yield "DeviceMesh._flatten", hasattr(DeviceMesh, "_flatten")
    yield "DistributedDataParallel.no_sync", hasattr(DistributedDataParallel, "no_sync")
    yield "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model", \
        hasattr(DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model")
    # overridden by engine.adapters.pipelining (a pipeline's failure guard)
    yield "PipelineStage.backward_maybe_with_nosync", hasattr(PipelineStage, "backward_maybe_with_nosync")
    yield "autograd.graph.Node._sequence_nr", hasattr(torch.autograd.graph.Node, "_sequence_nr")


# -- attention ---------------------------------------------------------------------------------
class FusedCpuAttention(NamedTuple):
    """PyTorch's fused CPU attention kernel, which gives the log-sum-exp of every query's scores and
    takes it back in its backward (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
    ``_backward``: private ops, signatures checked in torch 2.11–2.14, docs/compatibility.md)."""

    forward: Callable
    backward: Callable
    grouped_query: bool  # takes fewer key/value heads than query heads (and gives their gradients)


# The signatures ring attention calls them with: (positional names, keyword-only names, results).
FUSED_CPU_ATTENTION_SCHEMAS = {
    "_scaled_dot_product_flash_attention_for_cpu": (
        ("query", "key", "value", "dropout_p", "is_causal"), ("attn_mask", "scale"), 2),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (
        ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal"),
        ("attn_mask", "scale"), 3),
}


def _signature(op) -> tuple | None:
    """An op's (positional names, keyword-only names, number of results), None where it has no
    single default overload to read them from."""
    schema = getattr(getattr(op, "default", None), "_schema", None)
    if schema is None:
        return None
    return (tuple(a.name for a in schema.arguments if not a.kwarg_only),
            tuple(a.name for a in schema.arguments if a.kwarg_only), len(schema.returns))


def fused_cpu_attention() -> FusedCpuAttention | None:
    """The fused CPU kernel's two ops, or None where this torch lacks either or gives either another
    signature than the one ring attention calls (its blocks then run in matmuls: the same equations,
    slower). The schemas are read, not the version: the ops are private and may change in any one."""
    ops = torch.ops.aten
    found = {name: getattr(ops, name, None) for name in FUSED_CPU_ATTENTION_SCHEMAS}
    if any(op is None or _signature(op) != FUSED_CPU_ATTENTION_SCHEMAS[name] for name, op in found.items()):
        return None
    forward, backward = found.values()
    return FusedCpuAttention(forward, backward, _takes_grouped_query(forward, backward))


@functools.cache
def _takes_grouped_query(forward, backward) -> bool:
    """Whether the kernel attends 2 query heads to 1 key/value head and gives that head's gradients,
    tried once on a few numbers (what the schema cannot say; the kernel itself checks the shapes):
    where it does, grouped-query keys and values reach it with their own heads, not repeated."""
    query, key = torch.ones(1, 2, 2, 4), torch.ones(1, 1, 2, 4)
    try:
        output, logsumexp = forward(query, key, key, 0.0, True)
        gradients = backward(output, query, key, key, output, logsumexp, 0.0, True)
    except RuntimeError:
        return False
    return output.shape == query.shape and all(g.shape == t.shape for g, t in zip(gradients, (query, key, key)))


# -- autograd ----------------------------------------------------------------------------------
def autograd_sequence_nr(node) -> int:
    """When autograd created ``node``: a per-thread counter that increases with every node,
    so a node's inputs (its ``next_functions``) carry smaller numbers than the node itself
    (``AccumulateGrad`` of a leaf: the largest integer)."""
    return node._sequence_nr()


# -- DeviceMesh ------------------------------------------------------------------------------
def flatten_device_mesh(mesh, name: str):
    """``mesh`` (a submesh of several dimensions) as one dimension named ``name``: torch's
    ``DeviceMesh._flatten``, how torchtitan builds its data × context group (no public
    spelling in 2.11 – 2.13). Collective: every rank flattens the same dimensions."""
    return mesh._flatten(mesh_dim_name=name)


# -- DDP -------------------------------------------------------------------------------------
def set_ddp_gradient_sync(ddp, enabled: bool) -> None:
    """Whether DDP's next backward all-reduces: the flag ``no_sync()`` toggles (DDP reads it in
    the forward); set directly because a micro-step's forward and backward are separate calls."""
    ddp.require_backward_grad_sync = enabled


def ddp_ignore(module: torch.nn.Module, names: list[str]) -> None:
    """DDP, built on ``module`` after this, neither broadcasts nor reduces the parameters ``names``
    (the workaround torch documents until an API exists, pytorch/pytorch#43690)."""
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


# -- FSDP2 -------------------------------------------------------------------------------------
def _fsdp_param_groups(unit) -> list:
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch versions with one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


def fsdp_params(unit):
    """The FSDPParam objects of one ``fully_shard`` unit (its parameter groups' members)."""
    for group in _fsdp_param_groups(unit):
        yield from group.fsdp_params


def state_dict_as_held(units) -> None:
    """Make ``state_dict()`` of FSDP2 modules return the parameters as they are held: the
    gathered (whole, plain) tensors while gathered, the DTensor shards while sharded. FSDP2
    reshards in a pre-hook of every ``state_dict()`` call; that hook is removed (its handle stays
    recorded, so FSDP2's lazy initialisation does not register it again). Call after the
    units' lazy initialisation (``unit.unshard()`` does it)."""
    for unit in units:
        for group in _fsdp_param_groups(unit):
            for handle in group._module_to_pre_save_state_dict_hook_handle.values():
                handle.remove()


def fsdp_offload_policies(units):
    """The ``OffloadPolicy`` each unit's parameters were sharded with, one per parameter group
    (what ``fully_shard(offload_policy=...)`` recorded; FSDP2 has no public getter)."""
    for unit in units:
        for group in _fsdp_param_groups(unit):
            yield group.offload_policy


def drop_unreduced_gradients(root, units) -> None:
    """Forget a window abandoned mid-way. ``reset_iter_state`` (on the root) drops FSDP's
    half-finished forward/backward bookkeeping but keeps the unsharded gradients accumulated
    without reduction (in 2.11 and 2.13 alike): those are cleared by hand. Before the
    model's first forward FSDP is not initialised (lazily, in that forward) and holds nothing
    to drop; resetting it then would fail."""
    if root._get_fsdp_state()._is_root is None:
        return
    if hasattr(root, "reset_iter_state"):
        root.reset_iter_state()
    else:
        _reset_iter_state_before_2_13(root)
    own_buffer = _accumulated_grad_is_own_buffer()
    for unit in units:
        for param in fsdp_params(unit):
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None
            if own_buffer:
                param.unsharded_accumulated_grad = None


def _accumulated_grad_is_own_buffer() -> bool:
    """Whether ``FSDPParam.unsharded_accumulated_grad`` is a buffer of its own (torch 2.11 – 2.14:
    an attribute FSDP accumulates unreduced gradients into, in the reduce dtype) or, from 2.15, a
    read-only property returning the unsharded parameter's ``.grad`` (accumulation moved into the
    autograd leaf): then there is nothing to clear or count apart from that ``.grad``."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return not isinstance(getattr(FSDPParam, "unsharded_accumulated_grad", None), property)


def _reset_iter_state_before_2_13(root) -> None:
    """What torch 2.13's ``FSDPModule.reset_iter_state`` does, for torch 2.11 (one parameter
    group per state there): wait for and drop in-flight collectives, reshard every group, and
    clear the per-iteration trackers, so that the iteration after an abandoned forward or
    backward starts clean (without it, 2.11 skips the next forward's root pre-forward work)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    state = root._get_fsdp_state()
    cuda = torch.cuda.current_stream() if torch.cuda.is_available() else None
    comm = state._comm_ctx
    for name in ("all_gather_state", "reduce_scatter_state"):
        pending = getattr(comm, name, None)
        if pending is not None and cuda is not None and getattr(pending, "event", None) is not None:
            cuda.wait_event(pending.event)
        setattr(comm, name, None)
    comm.post_forward_order.clear()
    for each in state._state_ctx.all_states:  # 2.11 may list a grouped state twice: idempotent
        each._modules_to_run_forward.clear()
        each._training_state = TrainingState.IDLE
        group = each._fsdp_param_group
        if group is None:
            continue
        result = group._all_gather_result
        if result is not None:
            if isinstance(result.all_gather_work, dist.distributed_c10d.Work):
                result.all_gather_work.wait()
            if cuda is not None and getattr(result, "all_gather_event", None) is not None:
                cuda.wait_event(result.all_gather_event)
        group._all_gather_result = None
        group._wait_for_post_backward()
        group._reshard_after_forward_event = None
        group._partial_reduce_output = None
        group._post_forward_indices.clear()
        group._training_state = TrainingState.IDLE
        group._to_sharded()
    state._state_ctx.iter_forward_root = None
    state._state_ctx.post_backward_final_callback_queued = False


def reduce_accumulated_gradients(root) -> None:
    """Reduce-scatter the gradients accumulated without sync, and reshard, as the end of a
    syncing backward would have. FSDP2 has no public call for this; the root's end-of-backward
    callback does exactly it once the gradient sync is switched on and the backward is marked
    last (tested: short windows with ``defer_reduction: true``)."""
    root.set_requires_gradient_sync(True)
    root.set_reshard_after_backward(True)
    root.set_is_last_backward(True)
    state = root._get_fsdp_state()
    context = state._state_ctx
    # torch 2.15: the callback reads the backward's finalization mode, which a backward fixes when
    # it queues the callback and the end of its iteration clears; this call comes after that end,
    # so fix it the same way (automatic unless the application chose manual finalization).
    if getattr(context, "manual_backward_finalization_active", False) is None:
        context.manual_backward_finalization_active = context.manual_backward_finalization
    state._root_post_backward_final_callback()


def fsdp_comms(guard=None, *, all_to_all_reduce_scatter: bool = False):
    """(all-gather, reduce-scatter) for FSDP2's custom-comm interface
    (``set_custom_all_gather`` / ``set_custom_reduce_scatter``), FSDP's own defaults with:

    * ``guard(group)`` called before each collective (the failure guard). The buffers are
      allocated by FSDP before the call, so a rank that runs out of memory allocating them
      fails before its guard, and its failure vote answers its peers' guards;
    * ``all_to_all_reduce_scatter``: a sum or mean reduce-scatter done as one all-to-all and
      a local sum. On gloo this is about 2.5x faster than its native reduce-scatter, which is
      slower than a whole all-reduce (docs/benchmarks.md); same bytes on the wire.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    def check(group):
        if guard is not None:
            guard(group)

    class AllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            check(group)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class ReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            check(group)
            if not all_to_all_reduce_scatter or async_op or op not in (ReduceOp.SUM, ReduceOp.AVG):
                return super().__call__(output_tensor, input_tensor, group, op, async_op)
            world = group.size()
            received = torch.empty_like(input_tensor)  # rank r's slice of every rank's input
            dist.all_to_all_single(received, input_tensor, group=group)
            torch.sum(received.view(world, -1), dim=0, out=output_tensor)
            if op == ReduceOp.AVG:
                output_tensor.div_(world)
            return None

    return AllGather(), ReduceScatter()


def fsdp_held_tensors(units):
    """What FSDP2 holds beside the module's (sharded) parameters: each parameter's sharded
    copy and gradient, and, while gathered, its unsharded copy, that copy's gradient and a
    gradient accumulated without reduction (torch 2.11 – 2.14; from 2.15 that is the unsharded
    copy's gradient). Storages freed by resharding count 0 bytes."""
    own_buffer = _accumulated_grad_is_own_buffer()
    for unit in units:
        for param in fsdp_params(unit):
            yield param.sharded_param
            yield param.sharded_param.grad
            unsharded = getattr(param, "_unsharded_param", None)
            if unsharded is not None:
                yield unsharded
                yield unsharded.grad
            if own_buffer:
                yield param.unsharded_accumulated_grad
