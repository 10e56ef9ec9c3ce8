"""``Trainer``: transformers' Trainer whose optimizer steps are Microstep windows.

The path the door takes. ``train()`` is transformers' own (model init, activation checkpointing,
``resume_from_checkpoint`` loading the weights and the trainer state); its inner loop is replaced:
each optimizer step gathers up to ``gradient_accumulation_steps`` micro-batches from
``get_train_dataloader()`` as collated (accelerate hands every process its own), and runs them as one
window, ``eng.train_batch(engine.MicroBatches(...), loss_fn)``, whose ``loss_fn`` is the trainer's
``compute_loss(model, inputs)``. The engine reads the model's own ``.loss`` as (sum, count) and, with
routers, their load-balancing term over the whole window on every rank (``moe.load_balance: global``):
the step is the whole global batch's. A short last window of an epoch holds what is left and is
weighted by it. No ``num_items_in_batch`` is handed to ``compute_loss`` (the engine counts the items).

Overrides honoured: ``compute_loss`` (called once per micro-batch with ``model`` = the engine, whose
attributes are the model's; a loss that is not the model's own ``.loss`` is taken as a mean over the
micro-batch's rows), ``get_train_dataloader`` / ``_get_train_sampler`` / the collator,
``create_optimizer`` / ``create_scheduler`` (or ``optimizers=``), ``log``, ``evaluate``,
``prediction_step`` and callbacks. ``training_step`` is not called (the engine runs backward and step):
a subclass overriding it is refused.

Callbacks fire as in transformers: ``on_step_begin`` before a window, ``on_substep_end`` once per micro-batch
but the last, ``on_pre_optimizer_step`` / ``on_optimizer_step`` around the engine's optimizer step
(optimizer step hooks), ``on_step_end`` after it, ``on_log`` / ``on_save`` /
``on_evaluate`` from transformers' own logging, saving and evaluation. The loss logged is the windows'
global-batch loss; ``grad_norm`` is the window's gradient norm before clipping.

Saving: ``save_model`` writes a Hugging Face folder of whole weights (``eng.full_state_dict()``) at any
ZeRO stage; a checkpoint adds the engine's own state (``microstep/``: sharded model, optimizer,
scheduler, loss scale, counters) beside transformers' trainer state and RNG files, and
``resume_from_checkpoint`` restores it and skips the data already seen as transformers does.
"""

from __future__ import annotations

import itertools
import os
import time

import torch
import transformers
from accelerate import skip_first_batches

import engine
from engine.compat.transformers.arguments import engine_config
from engine.compat.transformers.refusals import check_config, check_supported

ENGINE_STATE_DIR = "microstep"  # inside a checkpoint folder


class EngineModel:
    """What ``compute_loss`` gets as ``model`` while training: calls go through the engine (its loss read,
    its routers counted), every other attribute is the model's own (``model.config``, ``model.training``)."""

    def __init__(self, eng: engine.Engine, model: torch.nn.Module):
        self.engine, self.model = eng, model

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


class Trainer(transformers.Trainer):
    """transformers' ``Trainer`` (same signature) training exactly the global batch's objective with
    Microstep; see this module's docstring for what it runs and honours."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.microstep_engine: engine.Engine | None = None
        self._whole_state: dict | None = None  # gathered on every rank for the writer's save
        self._substeps_to_report = 0

    # -- training --------------------------------------------------------------------------------
    def _inner_training_loop(self, batch_size=None, args=None, resume_from_checkpoint=None, trial=None,
                             ignore_keys_for_eval=None):
        args = args or self.args
        check_supported(self)
        train_dataloader = self.get_train_dataloader()
        (num_train_epochs, updates_per_epoch, _examples, num_train_samples, _total_batch, _steps_in_epoch,
         max_steps) = self.set_initial_training_values(args, train_dataloader)
        epochs_trained, micro_batches_done = self._init_training_state(
            max_steps, updates_per_epoch, num_train_epochs, resume_from_checkpoint, trial)
        eng = self._engine(max_steps)
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for name in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, name, getattr(self, name))
        self.callback_handler.train_dataloader = train_dataloader

        start_time = time.time()
        self._initial_num_input_tokens_seen = self.state.num_input_tokens_seen
        self._initial_global_step = self.state.global_step
        self._tr_loss = torch.tensor(0.0, device=args.device)
        self._total_loss_scalar = 0.0
        self._globalstep_last_logged = self.state.global_step
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        if args.eval_on_start:
            self._evaluate(trial, ignore_keys_for_eval, skip_scheduler=True)
        for epoch in range(epochs_trained, num_train_epochs):
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            resumed = resume_from_checkpoint if epoch == epochs_trained else None
            self._train_epoch(eng, train_dataloader, epoch, updates_per_epoch, resumed,
                              micro_batches_done if resumed else 0, trial, ignore_keys_for_eval, start_time)
            if self.control.should_training_stop:
                break
        return self._finalize_training(trial, num_train_samples, start_time)

    def _train_epoch(self, eng, dataloader, epoch, updates_per_epoch, resumed, micro_batches_done, trial,
                     ignore_keys_for_eval, start_time) -> None:
        """One pass over ``dataloader``, one engine window per optimizer step."""
        args = self.args
        accumulation = args.gradient_accumulation_steps
        if resumed is not None and micro_batches_done and not args.ignore_data_skip:
            dataloader = skip_first_batches(dataloader, micro_batches_done)
        elif resumed is not None:
            self._load_rng_state(resumed)
            micro_batches_done = 0
        if hasattr(dataloader, "set_epoch"):
            dataloader.set_epoch(epoch)
        micro_batches = iter(dataloader)
        if micro_batches_done:
            self._load_rng_state(resumed)  # after the skip, as transformers restores it
        grad_norm = learning_rate = None
        for update in range(micro_batches_done // accumulation, updates_per_epoch):
            window = list(itertools.islice(micro_batches, accumulation))
            if not window:
                break
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            learning_rate = self._get_learning_rate()  # the rate this window's update uses
            eng.module.train()
            self._substeps_to_report = len(window) - 1  # said before the optimizer step, as transformers does
            loss = eng.train_batch(engine.MicroBatches(self._prepare_inputs(b) for b in window), self._window_loss)
            self._report_substeps()  # a window discarded for a non-finite gradient took no optimizer step
            for micro_batch in window:
                self.current_flos += float(self.floating_point_ops(micro_batch))
                self._track_num_input_tokens(micro_batch)
            self._tr_loss += loss
            grad_norm = eng.last_window.step.grad_norm
            self.state.global_step += 1
            self.state.epoch = epoch + (update + 1) / updates_per_epoch
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            self._maybe_log_save_evaluate(self._tr_loss, grad_norm, self.model, trial, epoch, ignore_keys_for_eval,
                                          start_time, learning_rate=learning_rate)
            if self.control.should_epoch_stop or self.control.should_training_stop:
                break
        self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
        self._maybe_log_save_evaluate(self._tr_loss, grad_norm, self.model, trial, epoch, ignore_keys_for_eval,
                                      start_time, learning_rate=learning_rate)

    def _window_loss(self, eng, micro_batch):
        """The engine's ``loss_fn``: the trainer's own ``compute_loss`` on one micro-batch."""
        with self.compute_loss_context_manager():
            return self.compute_loss(EngineModel(eng, self.model), micro_batch)

    def _engine(self, max_steps: int) -> engine.Engine:
        """The engine (built once, at the first ``train()``), its optimizer and scheduler the trainer's."""
        if self.microstep_engine is not None:
            return self.microstep_engine
        config = engine_config(self.args, world_size=self.args.world_size, max_steps=max_steps,
                               hidden_size=getattr(getattr(self.model, "config", None), "hidden_size", None))
        check_config(config)
        optimizer = None if "optimizer" in config and self.optimizer is None else self.create_optimizer()
        scheduler = None if "scheduler" in config and self.lr_scheduler is None else \
            (lambda built: self.create_scheduler(num_training_steps=max_steps, optimizer=built))
        eng = engine.initialize(self.model, config, optimizer=optimizer, lr_scheduler=scheduler,
                                manual_sizes="inputs", grad_norm_every_step=True)
        self.microstep_engine, self.optimizer, self.lr_scheduler = eng, eng.optimizer, eng.lr_scheduler
        # transformers' optimizer-step events, at the engine's own step
        eng.optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step())
        eng.optimizer.register_step_post_hook(lambda *_: self._callback("on_optimizer_step"))
        return eng

    def _before_optimizer_step(self) -> None:
        self._report_substeps()
        self._callback("on_pre_optimizer_step")

    def _report_substeps(self) -> None:
        """``on_substep_end`` for each micro-batch of the window but its last."""
        for _ in range(self._substeps_to_report):
            self._callback("on_substep_end")
        self._substeps_to_report = 0

    def _callback(self, event: str) -> None:
        self.control = getattr(self.callback_handler, event)(self.args, self.state, self.control)

    # -- saving and resuming -----------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Hugging Face folder of whole weights (collective: every rank calls it, the writer writes)."""
        if self.microstep_engine is None:
            return super().save_model(output_dir, _internal_call)
        self._whole_state = self.microstep_engine.full_state_dict()
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._whole_state = None

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict if state_dict is not None else self._whole_state)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.microstep_engine.save_checkpoint(os.path.join(output_dir, ENGINE_STATE_DIR))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The weights of a checkpoint the door wrote come back with the engine's state; others as transformers
        loads them."""
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ENGINE_STATE_DIR)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self.microstep_engine is not None:
            self.microstep_engine.load_checkpoint(os.path.join(checkpoint, ENGINE_STATE_DIR))

    def _save_scaler(self, output_dir: str) -> None:
        """The loss scale is in the engine's state (``microstep/``)."""

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Restored with the engine's state."""
