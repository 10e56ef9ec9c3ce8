"""Asynchronous checkpoints (``checkpoint.async``): the step waits for a host copy of the state
only; writing it, the checksums and the atomic publish run on a background thread.

At the boundary, on the training thread, the model and optimizer state the strategy hands to
``torch.distributed.checkpoint`` is copied into host memory (:class:`HostStaging`: pinned
buffers where the tensors are on a GPU, allocated at the first save and reused by every later
one, so a run holds one copy of its rank's state, never more), and the DCP write is queued
instead of run (:func:`deferred_writes`, :func:`defer`). The strategies do not know: their
``save_training_state`` runs as always, and its ``dcp.save`` is what is deferred.

The background thread (:class:`BackgroundWriter`) then does what a blocking save does after
that point, in the same order and with the same agreements between ranks: the files, the
checksums, the manifest, the rename into place. Its collectives go over a gloo group of their
own (``process_group.background_control_group``): on the training thread's groups they would
pair up with training's collectives on the peers. A kill -9 during the write leaves the
temporary directory without a manifest, which is never loaded; the previous checkpoint stands.

At most one save is in flight: the next save, a load, a stop signal's save and ``close()``
wait for it first, and a failure of the write is raised there, on every rank alike (the
ranks agree on it in the background as a blocking save's ranks do).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from engine.distributed.process_group import background_control_group, control_group_of_this_thread

log = logging.getLogger("engine")

_deferring = threading.local()  # .queue: (staging, writes) while deferred_writes() is open on this thread


class HostStaging:
    """Host-memory copies of a state's tensors, one buffer per tensor (by its place in the
    state), kept between saves and refilled: the host memory is one copy of the state."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()
        self._pending_device_copies = False

    @property
    def bytes(self) -> int:
        """Host memory the buffers hold."""
        return sum(buffer.numel() * buffer.element_size() for buffer in self._buffers.values())

    def stage(self, state: Any, where: tuple = ()) -> Any:
        """``state`` (nested dicts, lists, tuples) with every tensor replaced by its host copy
        (a DTensor by a DTensor of the same placement over its local shard's copy) and every
        other value copied."""
        if isinstance(state, DTensor):
            local = self._host_copy(where, state.to_local())
            return DTensor.from_local(local, state.device_mesh, state.placements, run_check=False,
                                      shape=state.shape, stride=state.stride())
        if isinstance(state, torch.Tensor):
            return self._host_copy(where, state)
        if isinstance(state, dict):
            return type(state)((key, self.stage(value, where + (key,))) for key, value in state.items())
        if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
            return type(state)(self.stage(value, where + (index,)) for index, value in enumerate(state))
        return copy.deepcopy(state)

    def _host_copy(self, where: tuple, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        buffer = self._buffers.get(where)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pinned = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            self._buffers[where] = buffer
        device_copy = buffer.is_pinned() and tensor.device.type == "cuda"
        buffer.copy_(tensor, non_blocking=device_copy)
        self._pending_device_copies |= device_copy
        self._used.add(where)
        return buffer

    def finish(self) -> None:
        """Wait until the copies have landed (they were issued without waiting on a GPU); drop
        the buffers this save did not use (a state that changed shape), so they are not held."""
        if self._pending_device_copies:
            torch.cuda.synchronize()
            self._pending_device_copies = False
        for where in set(self._buffers) - self._used:
            del self._buffers[where]
        self._used.clear()


@contextlib.contextmanager
def deferred_writes(staging: HostStaging):
    """Inside, on this thread: :func:`defer` stages what it is given into ``staging`` and queues
    its write; yields the list of queued writes (run them later, in order)."""
    writes: list[Callable[[], None]] = []
    _deferring.queue = (staging, writes)
    try:
        yield writes
        staging.finish()
    finally:
        _deferring.queue = None


def defer(write: Callable[[Any], None], payload: Any) -> bool:
    """Inside :func:`deferred_writes`: queue ``write`` of a host copy of ``payload``, and say so
    (True); elsewhere False, and the caller writes ``payload`` itself now."""
    queue = getattr(_deferring, "queue", None)
    if queue is None:
        return False
    staging, writes = queue
    staged = staging.stage(payload, (len(writes),))
    writes.append(lambda: write(staged))
    return True


class BackgroundWriter:
    """Runs one checkpoint write at a time on a thread of its own, its agreements and DCP's
    collectives on the background control group."""

    def __init__(self):
        self.staging = HostStaging()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported_bytes = 0

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def submit(self, job: Callable[[], None], name: str) -> None:
        """Run ``job`` in the background. Collective the first time (the group is created), so
        every rank submits at the same boundary; the previous job must have been waited for."""
        if self._thread is not None:
            raise RuntimeError("a checkpoint write is still in flight: wait() for it first")
        group = background_control_group()
        self._report_memory()

        def run():
            try:
                with control_group_of_this_thread(group):
                    job()
            except BaseException as error:  # noqa: BLE001 - raised on the training thread by wait()
                self._error = error

        # Not a daemon: a script that ends right after its last save still finishes writing it
        # (the interpreter waits for the thread before its exit handlers take the group down).
        self._thread = threading.Thread(target=run, name=f"microstep-checkpoint-{name}", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        """Until the write in flight (if any) has finished; raises its failure."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _report_memory(self) -> None:
        held = self.staging.bytes
        if held > self._reported_bytes:
            log.info("checkpoint.async: %.2f MB of host memory hold this rank's state for the background write "
                     "(one copy, reused by every save)", held / 1e6)
            self._reported_bytes = held
