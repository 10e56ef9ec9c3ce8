"""Automatic checkpoints, from the config's ``checkpoint`` section::

    checkpoint:
      dir: runs/exp1/checkpoints
      every_steps: 100
      keep_last: 3
      resume: auto

* When the engine is built: ``resume: auto`` loads the newest complete ``dir/step_<N>``; a
  newer one that is incomplete or damaged (no manifest, a file missing or truncated) is
  skipped with a warning, never loaded. A path loads that checkpoint while ``dir`` holds none
  of its own (so a restarted job continues from its own newest, not from the path again);
  ``never`` loads nothing and refuses a ``dir`` that already holds checkpoints. The data
  position goes to the ``DistributedBatches`` of ``eng.batches()``, the random generators are
  set when training starts (``eng.batches()`` or the first training forward).
* At every boundary: every ``every_steps`` optimizer steps, ``dir/step_<N>`` is saved with the
  data position of ``eng.batches()``; then all but the newest ``keep_last`` are deleted. With
  ``async`` (the default) training goes on once the state is in host memory, and the write,
  its publish and the deletions run in the background (``engine.state.async_save``); a stop
  signal's save and ``close()`` wait for it.
* A stop signal (``stop_signals``, default SIGTERM and SIGUSR1) on any rank: every rank saves
  at the next boundary (the one they agree on, see ``engine.state.preemption``) and raises
  ``Preempted``, which exits the process with ``stop_exit_code`` (75) unless caught.

An explicit ``eng.load_checkpoint`` replaces the automatic resume: what of it was still to be
applied (the data position, the random generators) is dropped.

``AutoCheckpoint`` is one of the engine's hooks (``engine.window.hooks``): the engine calls
``on_batches`` / ``on_window_start`` / ``on_window_closed`` / ``on_state_loaded`` / ``on_close``
and knows nothing else of this module; saves and loads go through the engine's public
``checkpoints`` (the ``CheckpointManager``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from engine.state.checkpoint import MANIFEST, damaged_files, verify_checkpoint
from engine.distributed.collectives import from_rank0, gathered
from engine.errors import CheckpointError
from engine.window.hooks import EngineHook
from engine.state.preemption import Preempted, StopSignals, report_stop

log = logging.getLogger("engine")

_NAME = re.compile(r"step_(\d+)")


def checkpoint_name(global_steps: int) -> str:
    return f"step_{global_steps:08d}"


def automatic_checkpoints(section, rank: int) -> "AutoCheckpoint | None":
    """The automatic checkpoints ``section`` (the config's ``checkpoint``) asks for, or None when
    it asks for nothing automatic. Hand it to the engine, then call its ``start``."""
    if section.dir is None and section.resume in ("auto", "never"):
        return None
    return AutoCheckpoint(section, rank)


class _DataPosition:
    """Takes the data position out of a checkpoint before there is data to give it to."""

    state = None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state) -> None:
        self.state = state


class AutoCheckpoint(EngineHook):
    """Resumes, saves every ``every_steps`` and on a stop signal, keeps the last ``keep_last``."""

    def __init__(self, section, rank: int):
        self.rank = rank
        self.section = section
        self.dir = Path(section.dir).absolute() if section.dir is not None else None
        self.stop = StopSignals(section.stop_signals, says=rank == 0) \
            if self.dir is not None and section.stop_signals else None
        self.data = None  # the DistributedBatches of eng.batches(), whose position is saved
        self.resumed_from: str | None = None
        self._position = None  # the resumed data position, until eng.batches() creates the data
        self._pending_restore = None  # the resumed checkpoint, until training starts and its RNG states are set

    # -- resuming -----------------------------------------------------------------------------
    def start(self, engine) -> None:
        """Resume ``engine`` as ``resume`` says and start watching for stop signals. Collective."""
        self._resume(engine)
        if self.stop is not None:
            self.stop.install()

    def _resume(self, engine) -> None:
        """Load what ``resume`` chooses (every rank loads rank 0's choice, once the ranks together
        have checked every file's checksum). Collective."""
        damaged: list[str] = []
        while True:
            decision = from_rank0((self._unwritable_dir() or self._choose(damaged)) if self.rank == 0 else None)
            if "error" in decision:
                raise CheckpointError(decision["error"])
            path = decision["path"]
            if path is None:
                return
            found = self._damage(path, engine.world_size)
            if not found:
                break
            if decision["explicit"]:
                raise CheckpointError(f"checkpoint.resume: {path}: {found}")
            if self.rank == 0:
                log.warning("checkpoint.resume: skipping %s, it is damaged: %s", path, found)
            damaged.append(path)
        if self.rank == 0:  # only now: the ranks' checksums may still have rejected it
            log.info("%s", decision["says"])
        position = _DataPosition() if decision["data_position"] else None
        self._pending_restore = engine.checkpoints.restore(path, data=position, checked=True)
        self._position = position.state if position is not None else None
        self.resumed_from = path
        if position is None and self.rank == 0 and engine.global_steps:
            log.warning("%s holds no data position (it was saved before eng.batches() made the data): "
                        "data of your own starts where you put it, not at global step %d",
                        path, engine.global_steps)

    def _unwritable_dir(self) -> dict | None:
        """Rank 0: create ``dir`` and write into it now, so that a bad ``dir`` fails here rather
        than at the first save, which may be the one a stop signal asked for. {"error": ...} or None."""
        if self.dir is None:
            return None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".write_test_{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as error:
            return {"error": f"checkpoint.dir {self.dir} cannot be written: {error}; "
                             "set checkpoint.dir to a directory this job can create and write"}
        return None

    def _damage(self, path: str, world_size: int) -> str | None:
        """What is damaged in checkpoint ``path`` (files whose checksum differs), every rank reading
        its share of the files; the same on every rank. Collective."""
        try:
            names = damaged_files(path, verify_checkpoint(path), self.rank, world_size)
            problem = (f"{', '.join(names)} {'differs' if len(names) == 1 else 'differ'} from what was saved "
                       "(checksum mismatch)") if names else None
        except CheckpointError as error:
            problem = str(error)
        found = [text for text in gathered(problem, f"checking the checksums of {path}") if text]
        return "; ".join(found) or None

    def _choose(self, damaged: list[str] = ()) -> dict:
        """Rank 0: which checkpoint to load ({"path": ..., "data_position": ..., "explicit": ...}),
        or {"error": ...}; not one of the ``damaged`` found by ``_damage``."""
        try:
            found = self._checkpoints()
        except OSError as error:
            return {"error": f"checkpoint.dir {self.dir} cannot be read: {error}"}
        mode = self.section.resume
        if mode == "never":
            if found:
                return {"error": (
                    f"checkpoint.resume: never, but checkpoint.dir {self.dir} already holds checkpoints "
                    f"({', '.join(path.name for _, path in found[-3:])}{', ...' if len(found) > 3 else ''}) "
                    "that this run's would mix with: use another dir, remove them, or set resume: auto "
                    "to continue from the newest")}
            return {"path": None}
        for step, path in reversed(found):
            if str(path) in damaged:
                continue
            try:
                manifest = verify_checkpoint(path)
            except CheckpointError as error:
                log.warning("checkpoint.resume: skipping %s, it is incomplete or damaged: %s", path, error)
                continue
            return {"path": str(path), "data_position": manifest.get("data_position", True), "explicit": False,
                    "says": f"checkpoint.resume: {mode}: resuming from {path.name}, the newest complete checkpoint "
                            f"in {self.dir}"}
        if mode == "auto":
            log.info("checkpoint.resume: auto: %s holds no complete checkpoint; starting at step 0",
                     self.dir if self.dir is not None else "(no checkpoint.dir)")
            return {"path": None}
        try:
            manifest = verify_checkpoint(mode)
        except CheckpointError as error:
            return {"error": f"checkpoint.resume: {mode}: {error}"}
        return {"path": mode, "data_position": manifest.get("data_position", True), "explicit": True,
                "says": f"checkpoint.resume: resuming from {mode} (checkpoint.dir holds no checkpoint of its own yet)"}

    def _checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of the ``step_<N>`` directories in dir, oldest first."""
        if self.dir is None or not self.dir.is_dir():
            return []
        found = [(int(match[1]), entry) for entry in self.dir.iterdir()
                 if (match := _NAME.fullmatch(entry.name)) and entry.is_dir()]
        return sorted(found)

    def _start_training(self) -> None:
        if self._pending_restore is not None:
            self._pending_restore.restore_rng()
            self._pending_restore = None

    # -- the engine's hooks ---------------------------------------------------------------------
    def on_batches(self, engine, data) -> None:
        """``eng.batches()`` created ``data``: its position is the one saved from now on, and
        the resumed position, if any, is given to it."""
        self.data = data
        self._start_training()
        if self._position is None:
            return
        position, self._position = self._position, None
        if position.get("seed") != data.seed:
            log.warning("eng.batches(seed=%s): the resumed run shuffled with seed %s; it keeps that seed so "
                        "the data order goes on unchanged", data.seed, position.get("seed"))
        data.load_state_dict(position)
        if self.rank == 0:
            log.info("data position restored: epoch %d, batch %d of %d", data.epoch, data.step, len(data))

    def on_window_start(self, engine) -> None:
        """A training window's first forward."""
        if self._pending_restore is not None:
            self._start_training()

    def on_state_loaded(self, engine) -> None:
        """``eng.load_checkpoint`` restored the engine: what the automatic resume had not applied
        yet (data position, random generators) must not override it later. (The automatic resume's
        own load finds nothing pending yet.)"""
        if self._pending_restore is None and self._position is None:
            return
        self._pending_restore, self._position = None, None
        if self.rank == 0:
            log.info("load_checkpoint (global step %d) replaces the automatic resume from %s: its data position "
                     "and random generators are not applied", engine.global_steps, self.resumed_from)

    def on_window_closed(self, engine, report) -> None:
        """A window closed: save when due; stop when any rank received a stop signal."""
        saved = None
        every = self.section.every_steps
        if every is not None and engine.global_steps % every == 0:
            saved = self.save(engine)
        received = self.stop.agreed() if self.stop is not None else None
        if received is None:
            return
        saved = saved or self.save(engine)
        engine.checkpoints.wait()  # a background write finishes before the process exits
        self.stop.stopping()  # saved: a repeated signal must not change the exit code
        code = self.section.stop_exit_code
        report_stop(self.rank, code)
        if self.rank == 0:
            log.warning("%s received: saved %s at global step %d; stopping with exit code %d (the same "
                        "command again resumes from it)", received.name, saved, engine.global_steps, code)
        raise Preempted(code, received.name, saved)

    # -- saving -------------------------------------------------------------------------------------
    def save(self, engine) -> str:
        """Save ``dir/step_<N>`` of ``engine`` now (at a boundary), then keep the newest ``keep_last``.
        Collective. With ``async`` (the default) it returns once the state is in host memory; the
        write, its publish and the removal of older checkpoints follow in the background."""
        steps = engine.global_steps
        target = self.dir / checkpoint_name(steps)
        engine.checkpoints.wait()  # the previous save may still be writing: its removals come first
        if self.rank == 0 and target.is_dir() and not (target / MANIFEST).exists():
            # A save or a removal of ours cut short (no manifest: never loadable); the save
            # would refuse to replace a directory that is not a checkpoint.
            log.info("removing %s, an incomplete checkpoint, before saving there", target)
            shutil.rmtree(target, ignore_errors=True)
        removal = None
        if self.section.keep_last is not None and self.rank == 0:
            removal = lambda: self._remove_older(steps)  # noqa: E731 - once the save is published
        return engine.checkpoints.save(target, data=self.data, background=self.section.async_, on_published=removal)

    def _remove_older(self, newest: int) -> None:
        """Rank 0, once checkpoint ``newest`` is complete: delete all but the newest
        ``keep_last`` up to it (newer ones, damaged leftovers of an earlier run, are left)."""
        keep = self.section.keep_last
        older = [path for step, path in self._checkpoints() if step <= newest][:-keep]
        for path in older:
            if path.is_symlink():  # a link placed in dir: remove the link, never what it points to
                try:
                    target = os.readlink(path)
                    path.unlink()
                except OSError as error:
                    log.warning("could not remove the link %s (keep_last: %d): %s", path, keep, error)
                    continue
                log.info("removed %s, a link to %s (keep_last: %d); its target is left alone", path.name, target, keep)
                continue
            try:
                # The manifest first: a deletion cut short leaves an incomplete checkpoint, which a
                # resume skips, never one that looks complete.
                (path / MANIFEST).unlink(missing_ok=True)
                shutil.rmtree(path)
            except OSError as error:
                log.warning("could not remove the old checkpoint %s (keep_last: %d): %s", path, keep, error)
                continue
            log.info("removed the old checkpoint %s (keep_last: %d)", path.name, keep)

    def on_close(self, engine) -> None:
        if self.stop is not None:
            self.stop.uninstall()
        engine.checkpoints.wait()  # the last background save is published (or its failure raised)
