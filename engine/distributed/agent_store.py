"""A key space of their own for the workers of one start, in torchrun's agent store.

torchrun's agent hosts the store its workers build their process group on
(``TORCHELASTIC_USE_AGENT_STORE=True``: static rendezvous always, c10d rendezvous unless
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), and the store outlives the workers: after a restart
the new workers would find the failed ones' keys (addresses, barrier counters) there and wait on
them (pytorch/pytorch#135712). A per-attempt prefix needs a count every rank agrees on, and
``TORCHELASTIC_RESTART_COUNT`` is not one: each agent counts its own failures, and a node whose
workers were restarted because another node failed (a membership change) does not count it.

So the store itself names the attempt. Rank 0 of this start draws a new generation number; every
other rank asks for it with a ticket no earlier worker can have held, and rank 0 answers every
ticket it finds, including ones of workers that died before rank 0 came (nobody reads those
answers). A rank confirms under the generation; once all have, the generation is complete and
its prefix is new to every rank of this start, whatever happened to earlier ones.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from engine.errors import DistributedEnvError

ROOT = "microstep"
POLL_SECONDS = 0.02


def fresh_namespace(store: dist.Store, rank: int, world_size: int,
                    timeout: datetime.timedelta) -> dist.PrefixStore:
    """``store`` under a prefix no earlier start of the workers used, the same on every rank.
    Collective over the ``world_size`` ranks that share ``store``."""
    if rank == 0:
        generation = _lead(store, world_size, timeout)
    else:
        generation = _follow(store, rank, timeout)
    return dist.PrefixStore(f"{ROOT}/generation{generation}", store)


def _lead(store: dist.Store, world_size: int, timeout: datetime.timedelta) -> int:
    generation = store.add(f"{ROOT}/generations", 1)
    answered = int(store.get(f"{ROOT}/answered")) if store.check([f"{ROOT}/answered"]) else 0
    confirmed = [_confirmation(generation, rank) for rank in range(1, world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        tickets = store.add(f"{ROOT}/tickets", 0)
        for ticket in range(answered + 1, tickets + 1):
            store.set(_answer(ticket), str(generation))
        answered = tickets
        if store.add(f"{ROOT}/generation{generation}/confirmed", 0) >= world_size - 1 and store.check(confirmed):
            break
        if time.monotonic() > deadline:
            missing = [rank for rank, key in enumerate(confirmed, start=1) if not store.check([key])]
            raise DistributedEnvError(
                f"rank 0 waited {timeout.total_seconds():g} s in torchrun's store for ranks {missing} to join "
                "the process group: they never started or cannot reach it (distributed.timeout_seconds)")
        time.sleep(POLL_SECONDS)
    store.set(f"{ROOT}/answered", str(answered))
    store.set(f"{ROOT}/generation{generation}/complete", "1")
    return generation


def _follow(store: dist.Store, rank: int, timeout: datetime.timedelta) -> int:
    ticket = store.add(f"{ROOT}/tickets", 1)
    try:
        store.wait([_answer(ticket)], timeout)
        generation = int(store.get(_answer(ticket)))
        store.set(_confirmation(generation, rank), "1")
        store.add(f"{ROOT}/generation{generation}/confirmed", 1)
        store.wait([f"{ROOT}/generation{generation}/complete"], timeout)
    except dist.DistStoreError as error:
        raise DistributedEnvError(
            f"rank {rank} waited {timeout.total_seconds():g} s in torchrun's store for rank 0 to admit it to "
            f"the process group: rank 0 never started, cannot reach the store, or waits for another rank "
            f"(distributed.timeout_seconds): {error}") from None
    return generation


def _answer(ticket: int) -> str:
    return f"{ROOT}/ticket{ticket}"


def _confirmation(generation: int, rank: int) -> str:
    return f"{ROOT}/generation{generation}/rank{rank}"
