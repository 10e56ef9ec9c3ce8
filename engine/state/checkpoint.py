"""Checkpoints: save at a window boundary, resume on the same or another world size.

A checkpoint is a directory (see docs/checkpoints.md)::

    manifest.json        written last: format version, counters, world size, every file's size
    engine_state.pt      rank 0: each stateful part's state by name (the engine's counters and
                         plan, scheduler, loss scaler, micro-size tuner), config, client_state
    rank00000.pt ...     one per rank: RNG states, the data position
    model_optimizer/     the strategy's model and optimizer state (torch: a DCP checkpoint)

Every rank calls ``save_checkpoint`` / ``load_checkpoint`` with the same path, on a
filesystem all ranks share. A save writes into a hidden sibling ``.<name>.tmp-<token>``,
then rank 0 renames it into place (an existing checkpoint is moved aside first and
deleted after), so ``path`` always holds either the previous checkpoint or the new one.
Leftovers of a crashed save are ignored by ``load_checkpoint`` and removed by the next
successful save in the same parent directory.

The manager is handed what it saves (torchtitan's ``Stateful`` pattern): named parts with
``state_dict()`` / ``load_state_dict()``, the strategy's model and optimizer state (a directory
of its own), and a function giving the training position; it never reaches into an engine.

Any rank's failure is agreed on before the next collective, so every rank raises the same
:class:`CheckpointError` instead of some ranks waiting forever. The manifest records every
file's size and checksum; a load checks both (each rank reading its share of the files) before
it reads anything else. The engine's own files load with ``weights_only=True``; what still
unpickles is said in docs/checkpoints.md.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from engine.distributed.collectives import agree, describe, gathered, peer_lost_as_error
from engine.distributed.process_group import control_group
from engine.errors import CheckpointError, EngineUsageError
from engine.state.async_save import BackgroundWriter, deferred_writes
from engine.state.rng import restore_rng_state, rng_state, seed_everything

__all__ = ["CheckpointManager", "CheckpointError", "CheckpointPosition", "MANIFEST", "Restored", "verify_checkpoint",
           "damaged_files"]

log = logging.getLogger("engine")

FORMAT = "microstep-checkpoint"
VERSION = 2  # 2: engine_state.pt holds each part under its name (1: the engine's flat state_dict)
MANIFEST = "manifest.json"
ENGINE_STATE = "engine_state.pt"
STATE_DIR = "model_optimizer"
CHECKSUM = "crc32"  # of every file, in the manifest: finds damage (not tampering) at a fraction of a save's time
_CHUNK = 8 << 20
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<token>\d+-\d+)$")


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class TrainingState(Protocol):
    """The strategy's model and optimizer state, in a directory of its own."""

    name: str
    checkpoint_format: str

    def save_training_state(self, directory: str) -> None: ...

    def load_training_state(self, directory: str) -> None: ...


@dataclass(frozen=True)
class CheckpointPosition:
    """Where training is when a checkpoint is saved or loaded."""

    global_steps: int
    global_samples: int
    train_batch_size: int | None  # the global batch; None for a data-defined plan
    window_micro_steps: int  # 0 at a boundary, the only place a checkpoint is taken
    accumulation_steps: int


class CheckpointManager:
    """Saves and restores, at window boundaries, the stateful ``states`` (by name; None: a part
    this run does not have; loaded in the order given), the ``training_state`` (model and
    optimizer), the random generators and a data position."""

    def __init__(self, states: dict[str, Stateful | None], *, training_state: TrainingState,
                 position: Callable[[], CheckpointPosition], rank: int, world_size: int,
                 seed: int | None, config_record: dict):
        self.states = dict(states)
        self.training_state = training_state
        self.position = position
        self.rank, self.world_size = rank, world_size
        self.seed = seed  # re-seeds the generators of a rank the checkpoint did not have
        self.config_record = config_record  # the run's config, saved alongside
        self.writer: BackgroundWriter | None = None  # the first background save creates it

    def save(self, path, *, data=None, client_state: dict | None = None, background: bool = False,
             on_published: Callable[[], None] | None = None) -> str:
        return save_checkpoint(self, path, data=data, client_state=client_state, background=background,
                               on_published=on_published)

    def load(self, path, *, data=None) -> dict:
        return load_checkpoint(self, path, data=data)

    def restore(self, path, *, data=None, checked: bool = False) -> Restored:
        return restore_checkpoint(self, path, data=data, checked=checked)

    def wait(self) -> None:
        """Until a background save in flight is published; raises its failure (on every rank,
        which agreed on it). Collective in effect: every rank's write must finish."""
        if self.writer is not None:
            self.writer.wait()

    @property
    def host_bytes(self) -> int:
        """Host memory holding the state for background saves (0 without them)."""
        return self.writer.staging.bytes if self.writer is not None else 0


# =========================================================================== save
def save_checkpoint(manager: CheckpointManager, path, *, data=None, client_state: dict | None = None,
                    background: bool = False, on_published: Callable[[], None] | None = None) -> str:
    """Write everything needed to resume at this boundary into directory ``path`` (replacing a
    checkpoint already there). Collective: every rank calls it. Returns the absolute path.

    ``background``: return once the state is copied to host memory; the files, checksums and
    publish follow on the manager's background writer (``engine.state.async_save``), and
    ``manager.wait()`` raises their failure. A save waits first for one still in flight.
    ``on_published``: called (on the writer's thread when in the background) once ``path`` is
    published."""
    position = manager.position()
    _require_boundary(position, "save_checkpoint")
    manager.wait()  # at most one save in flight, and in order
    started = time.perf_counter()
    rank = manager.rank
    target = Path(os.path.abspath(path))
    tmp = None
    try:
        token = _agreed_token(target)
        tmp = target.parent / f".{target.name}.tmp-{token}"
        problem = None
        if rank == 0:
            problem = _prepare_target(target, tmp)
        agree(problem)
        problem, cause = None, None
        try:
            local_files = _local_files(manager, tmp, data, client_state)
            if not background:
                for name, obj in local_files.items():
                    _save(tmp / name, obj)
        except CheckpointError as error:
            problem, cause = str(error), error
        except Exception as error:  # noqa: BLE001 - reported on every rank below
            problem, cause = f"writing the rank's own files failed: {error!r}", error
        agree(problem, cause)
        if background:
            if manager.writer is None:
                manager.writer = BackgroundWriter()
            problem, cause = None, None
            try:
                with deferred_writes(manager.writer.staging) as training_state_writes:
                    manager.training_state.save_training_state(str(tmp / STATE_DIR))
                # Serialised now: the objects may change once training goes on.
                local_bytes = {name: _serialised(obj) for name, obj in local_files.items()}
            except Exception as error:  # noqa: BLE001 - agreed on: no rank may start a write its peers will not
                problem, cause = f"copying the state to host memory failed: {describe(error)}", error
            agree(problem, cause)
        else:
            _write_everywhere(lambda: manager.training_state.save_training_state(str(tmp / STATE_DIR)))
            _checksum_and_publish(manager, position, target, tmp, token, data is not None)
    except BaseException as error:
        _raise_save_failure(rank, target, tmp, error)
    if background:
        copied = time.perf_counter() - started

        def write_and_publish():
            def write_files():
                for name, content in local_bytes.items():
                    _write_bytes(tmp / name, content)
                for write in training_state_writes:
                    write()

            try:
                _write_everywhere(write_files)
                _checksum_and_publish(manager, position, target, tmp, token, data is not None)
            except BaseException as error:
                _raise_save_failure(rank, target, tmp, error)
            if rank == 0:
                log.info("saved checkpoint %s (global step %d) in the background: training waited %.2f s for the "
                         "host copy, the write took %.2f s more", target, position.global_steps, copied,
                         time.perf_counter() - started - copied)
            if on_published is not None:
                on_published()

        manager.writer.submit(write_and_publish, target.name)
        return str(target)
    if rank == 0:
        log.info("saved checkpoint %s (global step %d) in %.2f s", target, position.global_steps,
                 time.perf_counter() - started)
    if on_published is not None:
        on_published()
    return str(target)


def _write_everywhere(write: Callable[[], None]) -> None:
    """This rank's writes, then every rank's: no rank reads the files back for their checksums
    while a peer still writes one (DeepSpeed's rank 0 writes its state file after every rank's
    shards). Collective; a failed write is raised on every rank."""
    problem, cause = None, None
    try:
        write()
    except Exception as error:  # noqa: BLE001 - reported on every rank
        problem, cause = f"writing the checkpoint's files failed: {describe(error)}", error
    agree(problem, cause)


def _checksum_and_publish(manager: CheckpointManager, position: CheckpointPosition, target: Path, tmp: Path,
                          token: str, data_position: bool) -> None:
    """Once every file is written: the checksums, the manifest and the rename into place.
    Collective (on the control group of the calling thread)."""
    checksums = _agreed_checksums(tmp, manager.rank, manager.world_size)
    problem, cause = None, None
    if manager.rank == 0:
        try:
            _write_manifest(manager, position, tmp, checksums, data_position=data_position)
            _publish(tmp, target, token)
        except Exception as error:  # noqa: BLE001
            problem, cause = f"publishing failed: {error!r}", error
    agree(problem, cause)


def _raise_save_failure(rank: int, target: Path, tmp: Path | None, error: BaseException):
    """Raise what a failed save raises, once rank 0 has removed its temporary directory."""
    if rank == 0 and tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        raise error
    raise CheckpointError(
        f"saving the checkpoint {target} failed, nothing was published (a checkpoint "
        f"already at that path is untouched): {_full_disk_note(target.parent)}{describe(error)}") from error


def _local_files(manager: CheckpointManager, tmp: Path, data, client_state) -> dict[str, dict]:
    """{file name: what it holds} of this rank's own files (engine_state.pt on rank 0)."""
    if not tmp.is_dir():
        raise CheckpointError(f"{tmp.parent} is not visible from rank {manager.rank}, where rank 0 "
                              "created it: checkpoints need a filesystem shared by all ranks")
    data_state = data.state_dict() if data is not None else None
    files = {}
    if manager.rank == 0:
        files[ENGINE_STATE] = _engine_state(manager, data_state, client_state)
    files[rank_file(manager.rank)] = {"rng": rng_state(), "data": data_state}
    return files


def _engine_state(manager: CheckpointManager, data_state, client_state) -> dict:
    """engine_state.pt: every part's state by name, plus what the run was and what the caller added."""
    parts = {name: part.state_dict() if part is not None else None for name, part in manager.states.items()}
    # The config as JSON values: a Python config's constants may hold any object (read back with weights_only).
    config = json.loads(json.dumps(manager.config_record, default=repr))
    return {"parts": parts, "world_size": manager.world_size, "config": config,
            "data": data_state, "client_state": client_state}


def _files(directory: Path) -> list[str]:
    """Every file under ``directory``, relative, sorted: the same list on every rank."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def file_checksum(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _agreed_checksums(tmp: Path, rank: int, world_size: int) -> dict[str, str]:
    """The checksum of every file written, each rank reading back every world_size-th file (from
    its rank on: the work and the reads are shared); {name: checksum} on every rank."""
    mine, problem = {}, None
    try:
        mine = {name: file_checksum(tmp / name) for name in _files(tmp)[rank::world_size]}
    except OSError as error:
        problem = f"reading back the written files for their checksums failed: {error}"
    shares = gathered((mine, problem), "checkpoint checksums")
    problems = [f"rank {r}: {text}" for r, (_, text) in enumerate(shares) if text]
    if problems:
        raise CheckpointError("; ".join(problems))
    return {name: checksum for share, _ in shares for name, checksum in share.items()}


def _write_manifest(manager: CheckpointManager, position: CheckpointPosition, tmp: Path,
                    checksums: dict[str, str], *, data_position: bool) -> None:
    names = _files(tmp)
    files = {name: (tmp / name).stat().st_size for name in names}
    # A file one rank did not list (a lagging shared filesystem) is read here.
    checksums = {name: checksums.get(name) or file_checksum(tmp / name) for name in names}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "global_steps": position.global_steps,
        "global_samples": position.global_samples,
        "world_size": manager.world_size,
        "train_batch_size": position.train_batch_size,
        "strategy": manager.training_state.name,
        "state_format": manager.training_state.checkpoint_format,
        "data_position": data_position,
        "torch_version": torch.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
        "checksum": CHECKSUM,
        "checksums": checksums,
    }
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _prepare_target(target: Path, tmp: Path) -> str | None:
    """Rank 0, before anything is written: refuse to replace what is not a checkpoint."""
    if target.exists() and not (target.is_dir() and ((target / MANIFEST).is_file() or not any(target.iterdir()))):
        return (f"{target} exists and is not a checkpoint directory (no {MANIFEST}); "
                "choose another path — it would be replaced")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as error:
        return f"cannot create {tmp}: {error}"
    return None


def _publish(tmp: Path, target: Path, token: str) -> None:
    """Rank 0: move the complete checkpoint into place, then sweep leftovers of crashed saves."""
    aside = target.parent / f".{target.name}.old-{token}"
    if target.exists():
        os.replace(target, aside)
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    shutil.rmtree(aside, ignore_errors=True)
    try:
        for entry in target.parent.iterdir():
            match = _LEFTOVER.match(entry.name)
            if match is None or match["token"] == token:
                continue
            if not _restore_aside(entry, target.parent / match["name"], match["kind"]):
                log.info("removing %s, left by an interrupted checkpoint save", entry)
                shutil.rmtree(entry, ignore_errors=True)
    except OSError as error:  # the new checkpoint is in place: a failed sweep is not fatal
        log.warning("could not sweep leftovers of interrupted saves in %s: %s", target.parent, error)


def _restore_aside(entry: Path, its_target: Path, kind: str) -> bool:
    """A save that crashed between its two renames leaves the previous checkpoint aside and
    nothing at its path: move it back. True when ``entry`` was restored."""
    if kind != "old" or its_target.exists() or not (entry / MANIFEST).is_file():
        return False
    os.replace(entry, its_target)
    log.warning("restored checkpoint %s, which an interrupted save had moved aside", its_target)
    return True


def _recover(target: Path) -> None:
    """Rank 0, before a load: undo an interrupted save's half-done rename, if any."""
    if target.exists() or not target.parent.is_dir():
        return
    for entry in sorted(target.parent.iterdir()):
        match = _LEFTOVER.match(entry.name)
        if match and match["name"] == target.name and _restore_aside(entry, target, match["kind"]):
            return


# =========================================================================== load
@dataclass
class Restored:
    """A checkpoint restored, all but its random generators: ``restore_rng()``
    sets them (``load_checkpoint`` at once; an automatic resume when training starts, so that
    what the script draws between ``initialize`` and its loop does not shift them)."""

    path: str
    client_state: dict
    _manager: CheckpointManager
    _rng: dict | None  # this rank's saved states; None: the rank did not exist then
    _saved_world_size: int
    _global_steps: int

    def restore_rng(self) -> None:
        _restore_rng(self._manager, self._rng, self._saved_world_size, self._global_steps)


def load_checkpoint(manager: CheckpointManager, path, *, data=None) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint` (possibly on another number
    of ranks, with the same ``train_batch_size``); returns its ``client_state``.
    Collective: every rank calls it."""
    restored = restore_checkpoint(manager, path, data=data)
    restored.restore_rng()
    return restored.client_state


def restore_checkpoint(manager: CheckpointManager, path, *, data=None, checked: bool = False) -> Restored:
    """:func:`load_checkpoint` without the random generators (see :class:`Restored`). ``checked``:
    every file's checksum was verified just before (an automatic resume's choice)."""
    position = manager.position()
    _require_boundary(position, "load_checkpoint")
    manager.wait()  # a background save in flight is published first (it may be the one asked for)
    started = time.perf_counter()
    target = Path(os.path.abspath(path))
    rank = manager.rank
    if rank == 0:
        try:
            _recover(target)
        except OSError as error:
            log.warning("could not restore an interrupted save's checkpoint: %s", error)
    _agreed_token(target)  # every rank names the same path; the others wait for rank 0 here
    saved, mine, problem, cause = None, None, None, None
    try:
        manifest = verify_checkpoint(target)
        if not checked:
            _raise_if_damaged(target, damaged_files(target, manifest, rank, manager.world_size))
        _check_compatible(manager, position, target, manifest)
        saved = _load(target / ENGINE_STATE)
        if rank < manifest["world_size"]:
            mine = _load(target / rank_file(rank))
        if data is not None and saved.get("data") is None:
            raise CheckpointError(f"{target} holds no data position (it was saved without data=); "
                                  "load it without data= and position the data yourself")
        if data is None and saved.get("data") is not None and rank == 0:
            log.warning("%s holds a data position (epoch %s, batch %s), which is not restored without data=: "
                        "pass data=eng.batches(...) (the data the run trains from) to continue where it stopped, "
                        "or position the data yourself", target, saved["data"].get("epoch"), saved["data"].get("step"))
    except CheckpointError as error:
        problem, cause = str(error), error
    except Exception as error:  # noqa: BLE001 - e.g. a manifest with missing fields
        problem, cause = f"cannot read the checkpoint {target}: {error!r}", error
    agree(problem, cause)

    data_before = data.state_dict() if data is not None else None
    try:
        if data is not None:
            same_world = manifest["world_size"] == manager.world_size and mine is not None
            data.load_state_dict(mine["data"] if same_world and mine.get("data") is not None else saved["data"])
    except Exception as error:  # noqa: BLE001
        problem, cause = f"restoring the data position failed: {error}", error
    try:
        agree(problem, cause)
        manager.training_state.load_training_state(str(target / STATE_DIR))
    except BaseException:
        if data is not None:
            data.load_state_dict(data_before)
        raise
    _load_parts(manager.states, _parts_of(saved, manifest))
    if rank == 0:
        log.info("loaded checkpoint %s (global step %d, saved on %d rank(s)) in %.2f s", target,
                 manifest["global_steps"], manifest["world_size"], time.perf_counter() - started)
    client_state = saved.get("client_state")
    return Restored(str(target), client_state if client_state is not None else {}, manager,
                    mine["rng"] if mine is not None else None, manifest["world_size"], manifest["global_steps"])


def _parts_of(saved: dict, manifest: dict) -> dict:
    """Each part's saved state by name (a version-1 checkpoint kept the engine's state flat)."""
    if manifest.get("version", 1) >= 2:
        return saved["parts"]
    engine_keys = ("counters", "plan", "micro_batch")
    return {"engine": {key: saved[key] for key in engine_keys},
            **{name: saved.get(name) for name in ("lr_scheduler", "loss_scaler", "micro_batch_tuner")}}


def _load_parts(parts: dict[str, Stateful | None], saved: dict) -> None:
    for name, part in parts.items():
        state = saved.get(name)
        if part is not None and state is not None:
            part.load_state_dict(state)
        elif part is not None:
            log.warning("the checkpoint holds no %s state; this run's %s starts fresh", name, name)
        elif state is not None:
            log.warning("the checkpoint holds %s state but this run has none; it is ignored", name)
    for name in saved.keys() - parts.keys():
        if saved[name] is not None:
            log.warning("the checkpoint holds %s state but this run has none; it is ignored", name)


def verify_checkpoint(path) -> dict:
    """The manifest of the complete checkpoint at ``path``. Raises CheckpointError when there is
    none, or it is damaged: no or an unreadable manifest (an interrupted save), a file missing
    or of another size than was written (truncated). Local: reads, no collective."""
    target = Path(os.path.abspath(path))
    manifest = _read_manifest(target)
    try:
        _check_files(target, manifest)
    except (KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{target}/{MANIFEST} is malformed: {error!r}") from None
    return manifest


def damaged_files(path, manifest: dict, rank: int = 0, world_size: int = 1) -> list[str]:
    """The files of checkpoint ``path`` whose contents differ from what was saved (their checksum),
    among this rank's share: every ``world_size``-th file of the manifest from ``rank`` on, so that
    the ranks together read each file once. Local: reads, no collective. A checkpoint saved
    without checksums (an older Microstep) has none to compare."""
    target = Path(os.path.abspath(path))
    recorded = manifest.get("checksums")
    if not recorded:
        return []
    if manifest.get("checksum") != CHECKSUM:
        raise CheckpointError(f"{target}/{MANIFEST} records {manifest.get('checksum')!r} checksums; this "
                              f"Microstep computes {CHECKSUM!r}")
    damaged = []
    for name in sorted(recorded)[rank::world_size]:
        try:
            if file_checksum(target / name) != recorded[name]:
                damaged.append(name)
        except OSError as error:
            raise CheckpointError(f"cannot read {target / name}: {error}") from None
    return damaged


def _raise_if_damaged(target: Path, damaged: list[str]) -> None:
    if damaged:
        raise CheckpointError(
            f"checkpoint {target} is damaged: {', '.join(damaged[:10])}"
            + (f" and {len(damaged) - 10} more" if len(damaged) > 10 else "")
            + (" differs" if len(damaged) == 1 else " differ")
            + " from what was saved (checksum mismatch): changed or corrupted after the save")


def _read_manifest(target: Path) -> dict:
    if not target.exists():
        raise CheckpointError(f"no checkpoint at {target}: the path does not exist")
    if not target.is_dir():
        raise CheckpointError(f"{target} is a file; a checkpoint is a directory")
    try:
        with open(target / MANIFEST) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{target} is not a complete checkpoint: it has no {MANIFEST}, which is written "
            "last (an interrupted or foreign save)") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{target}/{MANIFEST} is unreadable or corrupt: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{target}/{MANIFEST} is not a Microstep checkpoint manifest")
    if manifest.get("version", 0) > VERSION:
        raise CheckpointError(f"{target} has checkpoint format version {manifest.get('version')}; "
                              f"this Microstep reads up to version {VERSION}: upgrade it")
    return manifest


def _check_files(target: Path, manifest: dict) -> None:
    problems = []
    for name, size in manifest["files"].items():
        try:
            actual = (target / name).stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} is missing")
            continue
        if actual != size:
            problems.append(f"{name} has {actual} bytes, {size} were written"
                            + (" (truncated)" if actual < size else ""))
    if problems:
        raise CheckpointError(f"checkpoint {target} is damaged: " + "; ".join(problems[:10])
                              + (f"; and {len(problems) - 10} more" if len(problems) > 10 else ""))


def _check_compatible(manager: CheckpointManager, position: CheckpointPosition, target: Path,
                      manifest: dict) -> None:
    saved_batch, batch = manifest["train_batch_size"], position.train_batch_size
    if saved_batch != batch:
        data_defined = "a data-defined batch (the config gave only gradient_accumulation_steps)"
        if saved_batch is None:
            fix = ("give only gradient_accumulation_steps, as when it was saved: remove train_batch_size and "
                   "train_micro_batch_size_per_gpu from the config")
        else:
            fix = f"set train_batch_size: {saved_batch} (world size and micro-batch size may differ)"
        raise CheckpointError(
            f"{target} was trained with "
            f"{data_defined if saved_batch is None else f'train_batch_size {saved_batch} (the global batch)'}; "
            f"this engine has {data_defined if batch is None else batch}. Resuming with "
            f"another global batch would change the training: {fix}")
    fmt = manager.training_state.checkpoint_format
    if manifest["state_format"] != fmt:
        raise CheckpointError(
            f"{target} holds model/optimizer state in the {manifest['state_format']!r} layout "
            f"(strategy {manifest['strategy']}); this engine's strategy "
            f"{manager.training_state.name} reads {fmt!r}")


# =========================================================================== RNG
def _restore_rng(manager: CheckpointManager, states: dict | None, saved_world_size: int, global_steps: int) -> None:
    if states is None:
        seed = random.Random(f"{manager.seed}-{manager.rank}-{global_steps}").getrandbits(32)
        log.info("rank %d did not exist in the checkpoint (%d ranks): its random generators are "
                 "re-seeded with %d", manager.rank, saved_world_size, seed)
        seed_everything(seed)
        return
    restore_rng_state(states)
    if manager.rank == 0 and saved_world_size > manager.world_size:
        log.info("the random generator states of checkpoint ranks %d..%d are not used",
                 manager.world_size, saved_world_size - 1)


# =========================================================================== shared helpers
def _require_boundary(position: CheckpointPosition, what: str) -> None:
    done = position.window_micro_steps
    if done:
        raise EngineUsageError(
            f"{what}() called in the middle of an accumulation window ({done} of "
            f"{position.accumulation_steps} micro-steps done): a checkpoint holds a "
            f"window boundary only; call it after the step() that closes the window "
            f"(eng.is_gradient_accumulation_boundary() tells which one)")


def _agreed_token(target: Path) -> str:
    """A name for this save's temporary directory, the same on every rank (rank 0's); also
    checks that every rank passed the same path."""
    mine = (str(target), f"{os.getpid()}-{time.time_ns()}")
    group = control_group()
    if group is None:
        return mine[1]
    everyone: list[Any] = [None] * dist.get_world_size()
    with peer_lost_as_error(f"checkpoint {target}: agreeing on the path"):
        dist.all_gather_object(everyone, mine, group=group)
    paths = sorted({path for path, _ in everyone})
    if len(paths) > 1:
        raise CheckpointError(f"ranks passed different checkpoint paths: {paths}; every rank must pass the same one")
    return everyone[0][1]


class _WriteErrors:
    """A file for ``torch.save`` that remembers the first error of a write: torch swallows it and
    reports only the position it then finds wrong (``unexpected pos 704 vs 598``)."""

    def __init__(self, file):
        self.file = file
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.file.flush()


def _serialised(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write_bytes(path: Path, content: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        raise CheckpointError(_write_failure(path, error)) from error


def _save(path: Path, obj) -> None:
    sink = None
    try:
        with open(path, "wb") as f:
            sink = _WriteErrors(f)
            torch.save(obj, sink)
            f.flush()
            os.fsync(f.fileno())
    except Exception as error:  # noqa: BLE001 - said with its cause below
        cause = sink.error if sink is not None and sink.error is not None else error
        raise CheckpointError(_write_failure(path, cause)) from error


FULL_DISK_BYTES = 1 << 20  # less free space than this after a failed save: the disk is full


def _full_disk_note(directory: Path) -> str:
    """"no space left on device" when the failed save's filesystem is full: torch.distributed.
    checkpoint's writers (like torch.save) report a full disk as ``unexpected pos ...``."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return ""
    if free >= FULL_DISK_BYTES:
        return ""
    return (f"no space left on device ({free} bytes free on the filesystem of {directory}: free space, "
            "lower checkpoint.keep_last, or choose another checkpoint directory); ")


def _write_failure(path: Path, error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"no space left on device writing {path} ({error.strerror}): free space on that "
                "filesystem, lower checkpoint.keep_last, or choose another checkpoint directory")
    return f"writing {path} failed: {type(error).__name__}: {error}"


def _load(path: Path):
    """One of the engine's own files, with torch's restricted unpickler (``weights_only``): tensors,
    containers and plain values; nothing in the file can run code."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"{path} holds an object that torch.load(weights_only=True), which the engine reads its files "
            f"with, refuses: {str(error).splitlines()[0]}. If it is an object of your client_state, save plain "
            "values (numbers, strings, lists, dicts, tensors) instead, or allow its class with "
            "torch.serialization.add_safe_globals([...]) before loading") from None
    except Exception as error:  # noqa: BLE001
        raise CheckpointError(f"{path} is corrupt or unreadable: {type(error).__name__}: {error}") from None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
