"""The engine's own part of a checkpoint: its counters, plan and micro-batch size (the model and
optimizer are the strategy's; scheduler, loss scaler and tuner are parts of their own), handed to
the ``CheckpointManager`` as a stateful object instead of the manager reaching into the engine."""

from __future__ import annotations

import dataclasses
import logging

from engine.errors import EngineUsageError

log = logging.getLogger("engine")

COUNTERS = ("micro_steps", "global_steps", "global_samples", "skipped_steps")


class EngineState:
    """``state_dict`` / ``load_state_dict`` of an engine (its public counters, ``plan``, ``window_split``,
    ``replan``, ``hooks`` and ``window_micro_steps``), at a boundary."""

    def __init__(self, engine):
        self.engine = engine

    def state_dict(self) -> dict:
        engine, plan = self.engine, self.engine.plan
        return {"counters": {name: int(getattr(engine, name)) for name in COUNTERS},
                "plan": dataclasses.asdict(plan.for_rank(0)),
                "micro_batch": {"size": plan.train_micro_batch_size_per_gpu, "mode": plan.micro_batch_mode,
                                "tokens": plan.micro_batch_tokens}}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``, possibly saved on another world size (same global batch); a micro
        size (or token budget) found by auto / explore is kept when it suits the current plan; then the
        engine's hooks are told."""
        engine = self.engine
        if engine.window_micro_steps:
            raise EngineUsageError("load_state_dict() called in the middle of a window: call it between windows")
        for name in COUNTERS:
            setattr(engine, name, state["counters"][name])
        plan = engine.window_split.restored_plan(engine.plan, state["micro_batch"])
        if plan != engine.plan:
            engine.replan(plan)
        saved, plan = state["plan"], engine.plan
        if saved["world_size"] != plan.world_size:
            log.info("resuming a checkpoint of %d rank(s) on %d: global batch %s unchanged, gradient "
                     "accumulation %d -> %d, micro-batch %s -> %s", saved["world_size"], plan.world_size,
                     plan.train_batch_size, saved["gradient_accumulation_steps"],
                     plan.gradient_accumulation_steps, saved["train_micro_batch_size_per_gpu"],
                     plan.train_micro_batch_size_per_gpu)
        for hook in engine.hooks:
            hook.on_state_loaded(engine)
