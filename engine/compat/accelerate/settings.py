"""What an ``Accelerator`` is asked to do, read once at its construction: its arguments, accelerate's
plugin and configuration objects (read by their attributes, so the script's own
``accelerate.utils`` imports stay), the ``ACCELERATE_*`` variables ``accelerate launch`` sets, and
the Microstep config (``microstep_config=`` a dict or a path, else the file ``MICROSTEP_CONFIG``
names).

Every ``ACCELERATE_*`` variable is honoured or refused by name (:data:`ENV_READINGS`,
:data:`ENV_REFUSED`, :data:`ENV_WITHOUT_EFFECT`); one the door does not know is named in a warning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from engine.config.schema import Config, load_config
from engine.errors import ConfigError, EngineUsageError

log = logging.getLogger("engine")

CONFIG_ENV = "MICROSTEP_CONFIG"  # a Microstep config file, when microstep_config= is not given
PRECISIONS = {"no": None, "bf16": "bf16", "fp16": "fp16"}


def _true(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _precision(value: str) -> dict:
    name = value.strip().lower()
    if name not in PRECISIONS:
        raise ConfigError([f"ACCELERATE_MIXED_PRECISION={value}: Microstep trains in no, bf16 or fp16 precision; "
                           "fp8 has no equivalent (set mixed_precision='bf16')"])
    return {} if PRECISIONS[name] is None else {f"{PRECISIONS[name]}.enabled": True}


def _dynamo(value: str) -> dict:
    name = value.strip().lower()
    if name == "no":
        return {}
    if name != "inductor":
        raise ConfigError([f"ACCELERATE_DYNAMO_BACKEND={value}: the engine compiles with torch.compile's inductor "
                           "backend (compile: {enabled: true}); choose inductor or no"])
    return {"compile.enabled": True}


def _dynamo_mode(value: str) -> dict:
    return {} if value.strip().lower() in ("", "default") else {"compile.mode": value.strip()}


def _offload(key: str) -> Callable[[str], dict]:
    def read(value: str) -> dict:
        return {} if value.strip().lower() == "none" else {f"zero_optimization.{key}.device": value.strip()}
    return read


def _deepspeed_only(reading: Callable[[str], dict]) -> Callable[[str, Mapping[str, str]], dict]:
    """A DeepSpeed plugin's variable: read only when ``ACCELERATE_USE_DEEPSPEED`` is true, as accelerate does."""
    def read(value: str, environ: Mapping[str, str]) -> dict:
        return reading(value) if _true(environ.get("ACCELERATE_USE_DEEPSPEED", "false")) else {}
    return read


def _anywhere(reading: Callable[[str], dict]) -> Callable[[str, Mapping[str, str]], dict]:
    return lambda value, environ: reading(value)


# name -> reading(value, environ) -> engine config overrides (dotted keys)
ENV_READINGS: dict[str, Callable[[str, Mapping[str, str]], dict]] = {
    "ACCELERATE_DYNAMO_BACKEND": _anywhere(_dynamo),
    "ACCELERATE_DYNAMO_MODE": lambda value, environ: (
        _dynamo_mode(value) if environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() != "no" else {}),
    "ACCELERATE_USE_DEEPSPEED": _anywhere(lambda value: {}),  # its plugin's variables below say what it means
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": _deepspeed_only(lambda value: {"zero_optimization.stage": int(value)}),
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": _deepspeed_only(_offload("offload_optimizer")),
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": _deepspeed_only(_offload("offload_param")),
    "ACCELERATE_GRADIENT_CLIPPING": _deepspeed_only(
        lambda value: {} if value == "auto" else {"gradient_clipping": float(value)}),
    # read by read_settings itself: precision (the argument wins), accumulation, device, the DeepSpeed config file
    "ACCELERATE_MIXED_PRECISION": _anywhere(lambda value: {}),
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": _anywhere(lambda value: {}),
    "ACCELERATE_USE_CPU": _anywhere(lambda value: {}),
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": _anywhere(lambda value: {}),
}

ENV_REFUSED: dict[str, str] = {
    "ACCELERATE_USE_FSDP": "FSDP is how Microstep holds ZeRO 2 / 3: set zero_optimization.stage: 3 (FULL_SHARD) or 2 "
                           "(SHARD_GRAD_OP) in the Microstep config instead of accelerate's FSDP plugin",
    "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM's engine is not Microstep's: give tensor_parallel / pipeline sizes in "
                                  "the Microstep config",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "accelerate's ParallelismConfig is not read: give tensor_parallel, "
                                         "context_parallel and expert_parallel sizes in the Microstep config",
    "ACCELERATE_USE_SAGEMAKER": "SageMaker's distributed launch is not supported: launch with accelerate launch, "
                                "torchrun or python -m launch",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": "NVMe offload has no equivalent: offload to cpu",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": "NVMe offload has no equivalent: offload to cpu",
    "ACCELERATE_FP8_BACKEND": "fp8 has no equivalent: use bf16",
}

# Set by accelerate launch, changing nothing of what is trained (device pinning, debugging, logging).
ENV_WITHOUT_EFFECT = frozenset({
    "ACCELERATE_DEBUG_MODE", "ACCELERATE_CPU_AFFINITY", "ACCELERATE_LOG_LEVEL", "ACCELERATE_DEBUG_RDV_FILE",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH", "ACCELERATE_DYNAMO_USE_DYNAMIC", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "ACCELERATE_CONFIG_DS_FIELDS",
    "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", "ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE", "ACCELERATE_TORCH_DEVICE",
    "ACCELERATE_DOWNCAST_BF16", "ACCELERATE_BYPASS_DEVICE_MAP",
})

# Accelerator arguments whose objects carry another engine's model holding
PLUGINS_REFUSED = {
    "deepspeed_plugin": "give zero_optimization (stage, offload) in the Microstep config, or the DeepSpeed JSON itself "
                        "as microstep_config=",
    "deepspeed_plugins": "give zero_optimization (stage, offload) in the Microstep config",
    "fsdp_plugin": "set zero_optimization.stage: 3 (FULL_SHARD) or 2 (SHARD_GRAD_OP) in the Microstep config",
    "megatron_lm_plugin": "give tensor_parallel / pipeline sizes in the Microstep config",
    "torch_tp_plugin": "give tensor_parallel.size in the Microstep config",
    "parallelism_config": "give tensor_parallel, context_parallel and expert_parallel sizes in the Microstep config",
    "kwargs_handlers": "their settings (DDP, process group, GradScaler, autocast) are the engine's: set them in the "
                       "Microstep config (distributed.timeout_seconds, fp16: {...}) and leave kwargs_handlers out",
    "dynamo_plugin": "set compile: {enabled: true, mode: ...} in the Microstep config",
}


@dataclass(frozen=True)
class Settings:
    """An Accelerator's resolved settings: the engine's config and what the door itself does."""

    config: Config
    accumulation: int
    mixed_precision: str  # "no" | "bf16" | "fp16"
    split_batches: bool = False
    even_batches: bool = True
    data_seed: int | None = None
    step_scheduler_with_optimizer: bool = True
    sync_with_dataloader: bool = True
    cpu: bool = False
    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    log_with: list = field(default_factory=list)


def read_settings(arguments: dict[str, Any], environ: Mapping[str, str] | None = None) -> Settings:
    """``arguments``: the Accelerator's keyword arguments (those its signature names)."""
    environ = os.environ if environ is None else environ
    for name, fix in PLUGINS_REFUSED.items():
        if arguments.get(name):
            raise EngineUsageError(f"Accelerator({name}=...) is not read by Microstep's Accelerator: {fix}")
    if arguments.get("dynamo_backend") not in (None, "no", "NO"):
        raise EngineUsageError(f"Accelerator(dynamo_backend={arguments['dynamo_backend']!r}): set compile: "
                               "{enabled: true} in the Microstep config")
    overrides = _environment_overrides(environ)
    source = _config_source(arguments.get("microstep_config"), environ)
    config = load_config(source) if source is not None else load_config({})
    accumulation, plugin = _accumulation(arguments, environ, config)
    precision = _mixed_precision(arguments.get("mixed_precision"), environ)
    overrides.update(_precision(precision))
    if precision == "no":  # a Microstep config may enable it alone
        precision = "bf16" if config.bf16.enabled else "fp16" if config.fp16.enabled else "no"
    overrides["gradient_accumulation_steps"] = accumulation
    config = load_config(config, overrides)
    loader = arguments.get("dataloader_config")
    split_batches = bool(getattr(loader, "split_batches", False) or arguments.get("split_batches", False))
    project = arguments.get("project_config")
    project_dir = getattr(project, "project_dir", None) or arguments.get("project_dir")
    log_with = arguments.get("log_with")
    return Settings(
        config=config, accumulation=accumulation, mixed_precision=precision, split_batches=split_batches,
        even_batches=bool(getattr(loader, "even_batches", True)), data_seed=getattr(loader, "data_seed", None),
        step_scheduler_with_optimizer=bool(arguments.get("step_scheduler_with_optimizer", True)),
        sync_with_dataloader=bool(getattr(plugin, "sync_with_dataloader", True)),
        cpu=bool(arguments.get("cpu")) or _true(environ.get("ACCELERATE_USE_CPU", "false")),
        project_dir=None if project_dir is None else str(project_dir),
        logging_dir=getattr(project, "logging_dir", None) or (None if project_dir is None else str(project_dir)),
        automatic_checkpoint_naming=bool(getattr(project, "automatic_checkpoint_naming", False)),
        total_limit=getattr(project, "total_limit", None),
        log_with=[] if log_with is None else list(log_with) if isinstance(log_with, (list, tuple)) else [log_with])


def _environment_overrides(environ: Mapping[str, str]) -> dict:
    overrides: dict = {}
    unknown = []
    for name in sorted(k for k in environ if k.startswith("ACCELERATE_")):
        value = environ[name]
        if name in ENV_REFUSED and _set(name, value):
            raise ConfigError([f"{name}={value}: {ENV_REFUSED[name]}"])
        if name in ENV_READINGS:
            overrides.update(ENV_READINGS[name](value, environ))
        elif name not in ENV_WITHOUT_EFFECT and name not in ENV_REFUSED:
            unknown.append(name)
    if unknown:
        log.warning("Microstep's Accelerator does not read %s (set by accelerate launch or the environment); "
                    "engine/compat/accelerate/settings.py lists the variables it honours", ", ".join(unknown))
    return overrides


def _set(name: str, value: str) -> bool:
    """Whether a refused variable asks for its feature (accelerate launch writes false / none / NO when off)."""
    return value.strip().lower() not in ("", "false", "0", "no", "none")


def _config_source(given, environ: Mapping[str, str]):
    """The Microstep config: ``microstep_config=``, else ``MICROSTEP_CONFIG``, else the DeepSpeed JSON
    ``accelerate launch`` names (``ACCELERATE_DEEPSPEED_CONFIG_FILE``), else none."""
    if given is not None:
        return given
    if environ.get(CONFIG_ENV):
        return environ[CONFIG_ENV]
    deepspeed_file = environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if _true(environ.get("ACCELERATE_USE_DEEPSPEED", "false")) and deepspeed_file.lower() != "none":
        return deepspeed_file
    return None


def _accumulation(arguments: dict, environ: Mapping[str, str], config: Config) -> tuple[int, Any]:
    """The accumulation steps, as accelerate resolves them (the plugin, else the argument, else
    ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``), agreeing with the Microstep config's when both say."""
    plugin = arguments.get("gradient_accumulation_plugin")
    given = arguments.get("gradient_accumulation_steps", 1)
    if plugin is not None:
        if given != 1:
            raise EngineUsageError("Accelerator: pass one of gradient_accumulation_steps and "
                                   "gradient_accumulation_plugin")
        steps = int(plugin.num_steps)
    else:
        steps = int(environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", given))
    from_config = config.gradient_accumulation_steps
    if from_config is not None and steps != 1 and from_config != steps:
        raise ConfigError([f"gradient_accumulation_steps: the Accelerator asks for {steps} and the Microstep config "
                           f"({config.source}) for {from_config}: give it in one place"])
    if from_config is not None and steps == 1:
        steps = from_config  # the config's, for an Accelerator left at its default
    if config.train_batch_size is not None or config.train_micro_batch_size_per_gpu is not None:
        raise ConfigError([f"train_batch_size / train_micro_batch_size_per_gpu ({config.source}): an accelerate "
                           "script forms its micro-batches with its data loader's batch_size; the global batch is "
                           "batch_size x processes x gradient_accumulation_steps. Remove them from the Microstep "
                           "config"])
    return steps, plugin


def _mixed_precision(given, environ: Mapping[str, str]) -> str:
    value = str(given if given is not None else environ.get("ACCELERATE_MIXED_PRECISION", "no")).lower()
    value = value.split(".")[-1]  # accelerate's PrecisionType enum prints as its value
    if value not in PRECISIONS:
        raise EngineUsageError(f"Accelerator(mixed_precision={given!r}): Microstep trains in no, bf16 or fp16 "
                               "precision; fp8 has no equivalent")
    return value
