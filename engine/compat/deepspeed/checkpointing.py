"""``deepspeed.checkpointing`` as Megatron-DeepSpeed models call it: ``configure(mpu,
deepspeed_config=...)`` once, ``is_configured()``, and ``checkpoint(function, *args)`` around
each transformer layer.

``checkpoint`` is ``torch.utils.checkpoint`` (non-reentrant): only the function's inputs are
kept from the forward and the rest is recomputed in the backward, with the RNG state restored
(dropout draws the same masks), so gradients equal the run without it, as DeepSpeed's.

The config's ``activation_checkpointing`` section (DeepSpeed's keys; ``configure``'s keyword
arguments win over it, as in DeepSpeed):

| key (keyword) | here |
|---|---|
| ``cpu_checkpointing`` (``checkpoint_in_cpu``) | honoured: the kept inputs wait for the backward in host memory (``torch.autograd.graph.save_on_cpu``, pinned with CUDA) |
| ``partition_activations`` | the same result: with one model-parallel rank there is nothing to partition; with several the inputs stay whole on each (more memory than DeepSpeed), said once |
| ``contiguous_memory_optimization``, ``number_checkpoints`` | a buffer layout of DeepSpeed's, no effect on results; checked as DeepSpeed does (contiguous needs partitioning and a number), said once |
| ``synchronize_checkpoint_boundary``, ``profile`` | DeepSpeed's timing aids, not done here; said once |
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch
import torch.utils.checkpoint

from engine.config.schema import load_config
from engine.errors import ConfigError

__all__ = ["configure", "is_configured", "checkpoint", "CheckpointingSettings"]

SECTION = "activation_checkpointing"


@dataclasses.dataclass(frozen=True)
class CheckpointingSettings:
    """DeepSpeed's activation-checkpointing settings (its config keys, its defaults)."""

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


_configured: CheckpointingSettings | None = None


def _section(deepspeed_config) -> dict:
    """The ``activation_checkpointing`` section of a config (a path, a dict or an ``engine.Config``)."""
    if deepspeed_config is None:
        return {}
    with warnings.catch_warnings():  # its notes are initialize's to give; the section is read here
        warnings.simplefilter("ignore")
        section = load_config(deepspeed_config).deepspeed_extras.get(SECTION) or {}
    if not isinstance(section, dict):
        raise ConfigError([f"{SECTION}: expected a section of DeepSpeed's keys, got {section!r}"])
    names = {field.name for field in dataclasses.fields(CheckpointingSettings)}
    return {key: value for key, value in section.items() if key in names}  # Microstep's own keys: the engine's


def _model_parallel_size(mpu) -> int:
    if mpu is None:
        return 1
    size = getattr(mpu, "get_tensor_model_parallel_world_size", None) or getattr(mpu, "get_model_parallel_world_size")
    return int(size())


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's ``configure``: the settings of ``deepspeed_config``'s ``activation_checkpointing``
    section, each keyword given (not None) winning over it."""
    global _configured
    values = dataclasses.asdict(CheckpointingSettings())
    values.update(_section(deepspeed_config))
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
             "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    values.update({key: value for key, value in given.items() if value is not None})
    settings = CheckpointingSettings(**values)
    if settings.contiguous_memory_optimization and not settings.partition_activations:
        raise ConfigError([f"{SECTION}.contiguous_memory_optimization: needs partition_activations: true (as in "
                           "DeepSpeed); set both, or neither"])
    if settings.contiguous_memory_optimization and settings.number_checkpoints is None:
        raise ConfigError([f"{SECTION}.contiguous_memory_optimization: needs number_checkpoints, the number of "
                           "checkpointed layers (as in DeepSpeed)"])
    _say_what_differs(settings, _model_parallel_size(mpu_))
    _configured = settings


def _say_what_differs(settings: CheckpointingSettings, model_parallel: int) -> None:
    unused = [name for name in ("contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile")
              if getattr(settings, name)]
    if unused:
        warnings.warn(f"deepspeed.checkpointing: {', '.join(unused)} (DeepSpeed's buffer layout and timing aids) are "
                      "not done by Microstep; results are the same", UserWarning, stacklevel=3)
    if settings.partition_activations and model_parallel > 1:
        warnings.warn(f"deepspeed.checkpointing: partition_activations: each of the {model_parallel} model-parallel "
                      f"ranks keeps the checkpointed inputs whole (DeepSpeed keeps 1/{model_parallel} each); gradients "
                      "are the same", UserWarning, stacklevel=3)


def is_configured() -> bool:
    """Whether ``configure`` was called."""
    return _configured is not None


def checkpoint(function, *args, **kwargs):
    """``function(*args, **kwargs)``, its activations recomputed in the backward (RNG restored);
    the inputs kept in host memory with ``cpu_checkpointing``."""
    settings = _configured or CheckpointingSettings()
    keep = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()) if settings.cpu_checkpointing
            else contextlib.nullcontext())
    with keep:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                                 **kwargs)
