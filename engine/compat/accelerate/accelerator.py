"""``Accelerator``: accelerate's names over one :class:`engine.Engine` (see the package docstring)."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

import engine
from engine.compat import refuse_engine_formed_micro_batches
from engine.compat.accelerate.operations import gather, gather_object, map_tensors, reduce, split_for_process
from engine.compat.accelerate.tracking import finish, log_values, start_trackers
from engine.compat.accelerate.boundary import Window
from engine.compat.accelerate.data import LoaderPosition, PreparedDataLoader
from engine.compat.accelerate.prepared import PreparedModel, PreparedOptimizer, PreparedScheduler
from engine.compat.accelerate.settings import read_settings
from engine.config.setup import process_group_request
from engine.distributed.collectives import from_rank0
from engine.distributed.process_group import barrier, init_distributed
from engine.errors import EngineUsageError

log = logging.getLogger("engine")

STATE_KEY = "accelerate"  # the door's part of a checkpoint's client_state


@dataclass(frozen=True)
class ProcessState:
    """What ``accelerator.state`` tells a script (accelerate's ``AcceleratorState`` fields it reads)."""

    distributed_type: Any
    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device
    mixed_precision: str
    deepspeed_plugin: None = None
    fsdp_plugin: None = None

    def __repr__(self) -> str:
        return (f"Distributed environment: {self.distributed_type} (Microstep's engine)\nNum processes: "
                f"{self.num_processes}\nProcess index: {self.process_index}\nLocal process index: "
                f"{self.local_process_index}\nDevice: {self.device}\nMixed precision type: {self.mixed_precision}\n")


class Accelerator:
    """accelerate's ``Accelerator`` with accelerate's signature, plus ``microstep_config`` (a dict or a
    path; else the file the ``MICROSTEP_CONFIG`` variable names). ``prepare`` builds the engine from the
    model and its optimizer; the script's loop then trains the whole global batch's objective."""

    def __init__(self, device_placement: bool = True, split_batches: bool = False, mixed_precision=None,
                 gradient_accumulation_steps: int = 1, cpu: bool = False, dataloader_config=None,
                 deepspeed_plugin=None, fsdp_plugin=None, torch_tp_plugin=None, megatron_lm_plugin=None,
                 rng_types=None, log_with=None, project_dir=None, project_config=None,
                 gradient_accumulation_plugin=None, step_scheduler_with_optimizer: bool = True,
                 kwargs_handlers=None, dynamo_backend=None, dynamo_plugin=None, deepspeed_plugins=None,
                 parallelism_config=None, *, microstep_config=None):
        arguments = {name: value for name, value in locals().items() if name not in ("self", "__class__")}
        self.settings = read_settings(arguments)
        if self.settings.even_batches is False:
            raise EngineUsageError("DataLoaderConfiguration(even_batches=False): every process must run the same "
                                   "micro-steps in a window; leave even_batches True (accelerate's default)")
        refuse_engine_formed_micro_batches(self.settings.config, "Accelerate")
        self.device_placement = device_placement
        group = process_group_request(self.settings.config)
        self._dist = init_distributed(group.timeout_seconds, group.backend,
                                      group_for_one_process=group.group_for_one_process,
                                      agreement_timeout_seconds=group.agreement_timeout_seconds)
        if self.settings.cpu and self._dist.device.type != "cpu":
            raise EngineUsageError("Accelerator(cpu=True) with a GPU visible: hide it (CUDA_VISIBLE_DEVICES=) to "
                                   "train on the CPU")
        _start_accelerate_state(cpu=self._dist.device.type == "cpu")
        self.position = LoaderPosition()
        self.window = Window(self.settings.accumulation, self.settings.sync_with_dataloader, self.position)
        self._model: PreparedModel | None = None
        self._optimizer: PreparedOptimizer | None = None
        self._schedulers: list[PreparedScheduler] = []
        self._loaders: list[PreparedDataLoader] = []
        self._custom_objects: list = []
        self._data_seed: int | None = None
        self.trackers: list = []
        self.save_iteration = 0

    # -- where this process is -------------------------------------------------------------
    @property
    def engine(self) -> engine.Engine | None:
        """The engine the prepared model trains with (None before ``prepare`` had a model and optimizer)."""
        return self.window.engine

    @property
    def device(self) -> torch.device:
        return self.engine.device if self.engine is not None else self._dist.device

    @property
    def process_index(self) -> int:
        return self._dist.rank

    @property
    def local_process_index(self) -> int:
        return self._dist.local_rank

    @property
    def num_processes(self) -> int:
        return self._dist.world_size

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def distributed_type(self):
        try:
            from accelerate.utils import DistributedType
        except ImportError:
            DistributedType = None
        name = "NO" if self.num_processes == 1 else "MULTI_GPU" if self.device.type == "cuda" else "MULTI_CPU"
        return getattr(DistributedType, name) if DistributedType is not None else name

    @property
    def mixed_precision(self) -> str:
        return self.settings.mixed_precision

    @property
    def state(self) -> ProcessState:
        return ProcessState(self.distributed_type, self.num_processes, self.process_index, self.local_process_index,
                            self.device, self.mixed_precision)

    @property
    def split_batches(self) -> bool:
        return self.settings.split_batches

    @property
    def even_batches(self) -> bool:
        return True

    @property
    def project_dir(self) -> str | None:
        return self.settings.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.settings.logging_dir

    # -- accumulation ------------------------------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> int:
        return self.window.steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if steps != self.window.steps:
            raise EngineUsageError(f"gradient_accumulation_steps cannot change from {self.window.steps} to {steps} "
                                   "after the Accelerator was made: pass it to Accelerator(...)")

    @property
    def sync_gradients(self) -> bool:
        """True in the micro-step that closes a window (its last, or the data's last batch)."""
        return self.window.sync_gradients

    @property
    def step(self) -> int:
        return self.window.step

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return self.window.closed is False

    @contextlib.contextmanager
    def accumulate(self, *models):
        """One micro-step: counts it, and says whether gradients sync at its end (``sync_gradients``)."""
        self.window.enter_micro_step()
        self.window.inside_accumulate += 1
        try:
            yield
        finally:
            self.window.inside_accumulate -= 1

    def no_sync(self, model):
        raise EngineUsageError("accelerator.no_sync(): the engine synchronises gradients once per window itself; "
                               "wrap each micro-step in `with accelerator.accumulate(model):` instead")

    def backward(self, loss, **kwargs) -> None:
        """The micro-step's loss, weighted by its share of the window (the model's own ``.loss`` by the items
        its labels hold, another scalar as a mean over the micro-batch's samples); no division by the
        accumulation steps."""
        if kwargs:
            raise EngineUsageError(f"accelerator.backward({', '.join(kwargs)}=...): the engine runs one plain "
                                   "backward per micro-batch loss; call accelerator.backward(loss)")
        self.window.backward(loss)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        """Clip the whole window's gradient at ``max_norm``. At a syncing micro-step the engine's window closes
        here (reduced, weighted, clipped, stepped; ``optimizer.step()`` then finds it done) and the norm
        before clipping is returned; inside a window it only sets the limit (returns None)."""
        if float(norm_type) != 2.0:
            raise EngineUsageError(f"clip_grad_norm_(norm_type={norm_type}): the engine clips by the 2-norm")
        eng = self.window.require_engine("clip_grad_norm_()")
        wanted = {id(p) for p in parameters}
        held = {id(p) for p in eng.module.parameters() if p.requires_grad}
        if wanted != held:
            raise EngineUsageError("clip_grad_norm_(parameters, ...): the engine clips the whole model's gradient; "
                                   "pass model.parameters() of the prepared model")
        eng.gradient_clipping = float(max_norm)
        if not self.window.sync_gradients:
            return None
        self.window.close()
        return self.window.grad_norm()

    def clip_grad_value_(self, parameters, clip_value: float):
        raise EngineUsageError("clip_grad_value_(): the engine clips the window's gradient by its 2-norm; use "
                               "accelerator.clip_grad_norm_(model.parameters(), max_norm)")

    # -- prepare -------------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """Models, optimizers, data loaders and schedulers, each returned in its place prepared; the engine is
        built once the model and its optimizer are both known."""
        kinds = [_kind(arg) for arg in args]
        for arg, kind in zip(args, kinds):
            if kind == "model":
                self._prepare_model(arg)
            elif kind == "optimizer":
                self._prepare_optimizer(arg)
        self._start_engine()
        prepared = []
        for arg, kind in zip(args, kinds):
            if kind == "model":
                prepared.append(self._model)
            elif kind == "optimizer":
                prepared.append(self._optimizer)
            elif kind == "loader":
                prepared.append(self.prepare_data_loader(arg, device_placement=device_placement))
            elif kind == "scheduler":
                prepared.append(self.prepare_scheduler(arg))
            else:
                prepared.append(arg)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def prepare_model(self, model: torch.nn.Module, device_placement=None, evaluation_mode: bool = False):
        return self.prepare(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        return self.prepare(optimizer)

    def prepare_data_loader(self, data_loader: DataLoader, device_placement=None, slice_fn_for_dispatch=None):
        if isinstance(data_loader, PreparedDataLoader):
            return data_loader
        if self._data_seed is None:  # one order for every rank
            self._data_seed = int(from_rank0(self.settings.data_seed if self.settings.data_seed is not None
                                             else torch.initial_seed()))
        place = self.device_placement if device_placement is None else device_placement
        loader = PreparedDataLoader(data_loader, rank=self.process_index, world_size=self.num_processes,
                                    split_batches=self.split_batches, seed=self._data_seed,
                                    device=self.device if place else None, position=self.position)
        self._loaders.append(loader)
        return loader

    def prepare_scheduler(self, scheduler):
        if isinstance(scheduler, PreparedScheduler):
            return scheduler
        optimizer = self._optimizer
        if optimizer is not None and getattr(scheduler, "optimizer", None) not in (optimizer, optimizer.optimizer):
            raise EngineUsageError("prepare(): the scheduler was built on another optimizer than the prepared one")
        prepared = PreparedScheduler(scheduler, self.window, processes=self.num_processes,
                                     split_batches=self.split_batches,
                                     step_with_optimizer=self.settings.step_scheduler_with_optimizer)
        self._schedulers.append(prepared)
        return prepared

    def _prepare_model(self, model: torch.nn.Module) -> None:
        if isinstance(model, PreparedModel):
            return
        if self._model is not None:
            raise EngineUsageError("prepare(): Microstep's Accelerator trains one model; a second one (e.g. a frozen "
                                   "teacher) is not prepared: move it with model.to(accelerator.device)")
        self._model = PreparedModel(model.to(self.device) if self.device_placement else model, self.window)

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, PreparedOptimizer):
            return
        if self._optimizer is not None:
            raise EngineUsageError("prepare(): Microstep's Accelerator steps one optimizer; put every parameter "
                                   "group into one")
        self._optimizer = PreparedOptimizer(optimizer, self.window)

    def _start_engine(self) -> None:
        if self.engine is not None or self._model is None or self._optimizer is None:
            return
        raw = self._optimizer.optimizer
        eng = engine.initialize(self._model.module, self.settings.config, optimizer=raw, manual_sizes="inputs",
                                grad_norm_every_step=True)
        if eng.optimizer is not raw:
            raise EngineUsageError("the engine holds another optimizer than the script's (a config optimizer "
                                   "section?): remove the optimizer section from the Microstep config")
        self._model.module = eng.module
        self.window.engine = eng
        if _adds_window_router_term(self._model.module, self.settings.config):
            self.window.held = []  # its windows run whole at their close (engine.compat.accelerate.boundary)

    # -- the model's state -------------------------------------------------------------------
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        return model.module if isinstance(model, PreparedModel) else model

    def get_state_dict(self, model, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The whole model state as CPU tensors, on every process (collective under ZeRO 3)."""
        if isinstance(model, PreparedModel) and self.engine is not None:
            state = self.engine.full_state_dict()
        else:
            state = self.unwrap_model(model).state_dict()
        return state if unwrap else {f"module.{name}": value for name, value in state.items()}

    def save(self, obj, f, safe_serialization: bool = False) -> None:
        """Save ``obj`` on the main process only."""
        if not self.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(obj, f, metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True) -> None:
        """The whole model into ``save_directory`` (``save_pretrained`` for a Hugging Face model). Collective."""
        state = self.get_state_dict(model)
        unwrapped = self.unwrap_model(model)
        if self.is_main_process:
            os.makedirs(save_directory, exist_ok=True)
            if hasattr(unwrapped, "save_pretrained"):
                unwrapped.save_pretrained(save_directory, state_dict=state, max_shard_size=max_shard_size,
                                          safe_serialization=safe_serialization)
            else:
                name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
                self.save(state, os.path.join(save_directory, name), safe_serialization=safe_serialization)
        self.wait_for_everyone()

    # -- the training state --------------------------------------------------------------------
    def register_for_checkpointing(self, *objects) -> None:
        for obj in objects:
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise EngineUsageError(f"register_for_checkpointing: {type(obj).__name__} has no state_dict / "
                                       "load_state_dict")
        self._custom_objects.extend(objects)

    def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs) -> str:
        """Everything needed to continue as if uninterrupted, at a window's end: the engine's checkpoint
        (model, optimizer, counters, random generators) with the schedulers, the accumulation count, the
        loaders' passes and registered objects. Collective."""
        output_dir = self._checkpoint_dir(output_dir)
        door = {"step": self.window.step, "schedulers": [s.state_dict() for s in self._schedulers],
                "loader_epochs": [loader.epoch.value for loader in self._loaders],
                "custom": [obj.state_dict() for obj in self._custom_objects], "save_iteration": self.save_iteration + 1}
        self.window.require_engine("save_state()").save_checkpoint(output_dir, client_state={STATE_KEY: door})
        self.save_iteration += 1
        return output_dir

    def load_state(self, input_dir=None, **load_model_func_kwargs) -> None:
        """Restore what :meth:`save_state` saved (``input_dir`` None: the newest automatic checkpoint). Collective."""
        if input_dir is None:
            input_dir = self._newest_checkpoint()
        client_state = self.window.require_engine("load_state()").load_checkpoint(input_dir)
        door = (client_state or {}).get(STATE_KEY)
        if door is None:
            raise EngineUsageError(f"load_state({input_dir}): not a checkpoint of Microstep's Accelerator (no "
                                   f"'{STATE_KEY}' client state)")
        if len(door["schedulers"]) != len(self._schedulers) or len(door["custom"]) != len(self._custom_objects):
            raise EngineUsageError(f"load_state({input_dir}): it holds {len(door['schedulers'])} scheduler(s) and "
                                   f"{len(door['custom'])} registered object(s); {len(self._schedulers)} and "
                                   f"{len(self._custom_objects)} are prepared / registered now")
        self.window.step = door["step"]
        for scheduler, saved in zip(self._schedulers, door["schedulers"]):
            scheduler.load_state_dict(saved)
        for loader, epoch in zip(self._loaders, door["loader_epochs"]):
            loader.set_epoch(epoch)
        for obj, saved in zip(self._custom_objects, door["custom"]):
            obj.load_state_dict(saved)
        self.save_iteration = door["save_iteration"]

    def _checkpoint_dir(self, output_dir) -> str:
        """``output_dir``, or the next automatically named one (the oldest dropped past ``total_limit``)."""
        if output_dir is not None:
            return str(output_dir)
        if not (self.settings.automatic_checkpoint_naming and self.project_dir):
            raise EngineUsageError("save_state(): give output_dir, or ProjectConfiguration(project_dir=..., "
                                   "automatic_checkpoint_naming=True)")
        limit = self.settings.total_limit
        if limit and self.is_main_process:
            saved = self._automatic_checkpoints()
            for old in saved[:max(len(saved) + 1 - limit, 0)]:
                shutil.rmtree(old)
        self.wait_for_everyone()
        return os.path.join(self.project_dir, "checkpoints", f"checkpoint_{self.save_iteration}")

    def _newest_checkpoint(self) -> str:
        if not (self.settings.automatic_checkpoint_naming and self.project_dir):
            raise EngineUsageError("load_state(): give input_dir, or use automatic_checkpoint_naming")
        saved = self._automatic_checkpoints()
        if not saved:
            raise EngineUsageError(f"load_state(): no checkpoint under {self.project_dir}/checkpoints")
        return saved[-1]

    def _automatic_checkpoints(self) -> list[str]:
        """The automatically named checkpoints, oldest first."""
        folder = os.path.join(self.project_dir, "checkpoints")
        names = os.listdir(folder) if os.path.isdir(folder) else []
        names = sorted((n for n in names if n.startswith("checkpoint_")), key=lambda n: int(n.rsplit("_", 1)[-1]))
        return [os.path.join(folder, name) for name in names]

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """The prepared ``dataloader`` starting this pass after its first ``num_batches`` batches (resuming)."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise EngineUsageError("skip_first_batches(): pass a data loader returned by accelerator.prepare")
        return dataloader.skipping(num_batches)

    # -- collectives and processes -------------------------------------------------------------
    def gather(self, tensor):
        return gather(tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """``gather``, less the samples an evaluation loader repeated to complete its last global batch."""
        try:
            data = gather_object(input_data) if use_gather_object else gather(input_data)
        except EngineUsageError:  # not tensors: objects
            data = gather_object(input_data)
        remainder = self.position.remainder
        if not self.position.end_of_dataloader or remainder < 0:
            return data
        if isinstance(data, list) and not all(isinstance(item, torch.Tensor) for item in data):
            return data[:remainder]
        return map_tensors(data, lambda tensor: tensor[:remainder])

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        return reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        raise EngineUsageError("pad_across_processes() is not provided by Microstep's Accelerator: pad to a common "
                               "length in the collate function, or use gather_for_metrics(..., use_gather_object=True)")

    def wait_for_everyone(self) -> None:
        barrier()

    @contextlib.contextmanager
    def main_process_first(self):
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self):
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, leads: bool):
        if not leads:
            barrier()
        yield
        if leads:
            barrier()

    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        yield split_for_process(inputs, self.process_index, self.num_processes, apply_padding)

    def on_main_process(self, function):
        """A decorator: ``function`` runs on the main process only (elsewhere it returns None)."""
        return _only_where(lambda: self.is_main_process, function)

    def on_local_main_process(self, function):
        return _only_where(lambda: self.is_local_main_process, function)

    def on_last_process(self, function):
        return _only_where(lambda: self.is_last_process, function)

    def on_process(self, function=None, process_index: int | None = None):
        """A decorator (``@accelerator.on_process(process_index=1)``): ``function`` runs on that process only."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return _only_where(lambda: self.process_index == process_index, function)

    def print(self, *args, **kwargs) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def autocast(self, autocast_handler=None):
        """Autocast in the training precision (the engine's forwards compute in it already)."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.mixed_precision)
        if dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=dtype):
            yield

    # -- trackers -------------------------------------------------------------------------------
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        if self.is_main_process:
            self.trackers = start_trackers(self.settings.log_with, project_name, self.logging_dir, config,
                                           init_kwargs or {})

    def get_tracker(self, name: str, unwrap: bool = False):
        for tracker in self.trackers:
            if getattr(tracker, "name", None) == name:
                return tracker.tracker if unwrap else tracker
        raise ValueError(f"no tracker named {name!r} was started (log_with={self.settings.log_with})")

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        if self.is_main_process:
            log_values(self.trackers, values, step, log_kwargs or {})

    def end_training(self) -> None:
        if self.is_main_process:
            finish(self.trackers)
        self.wait_for_everyone()

    # -- releasing ------------------------------------------------------------------------------
    def free_memory(self, *objects):
        """Release the engine and every prepared object (a later ``prepare`` starts anew). Collective."""
        if self.engine is not None:
            self.engine.close()
        self.window.engine, self.window.held = None, None
        self._model, self._optimizer = None, None
        self._schedulers, self._loaders, self._custom_objects = [], [], []
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None for _ in objects]

    clear = free_memory


def _only_where(here, function):
    @functools.wraps(function)
    def run(*args, **kwargs):
        return function(*args, **kwargs) if here() else None
    return run


def _kind(obj) -> str:
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (DataLoader, PreparedDataLoader)):
        return "loader"
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, PreparedScheduler)) or \
            (hasattr(obj, "step") and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer)):
        return "scheduler"
    return "other"


def _adds_window_router_term(model: torch.nn.Module, config) -> bool:
    """Whether ``model``'s ``.loss`` adds its routers' load-balancing term, which the engine makes the global
    batch's (``moe.load_balance: global``): then the door holds each window (see engine.compat.accelerate.boundary)."""
    routed = getattr(getattr(model, "config", None), "output_router_logits", False)
    return bool(routed) and config.moe.load_balance == "global"


def _start_accelerate_state(cpu: bool) -> None:
    """accelerate's process state, where accelerate is installed: its ``get_logger`` and utilities the script
    imports from accelerate read it (it joins the process group the engine made; on CPUs accelerate sees the
    processes only when told ``cpu``)."""
    try:
        from accelerate.state import PartialState
    except ImportError:
        return
    PartialState(cpu=cpu)
