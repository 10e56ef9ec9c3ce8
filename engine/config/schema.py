"""The config schema and ``load_config``.

A config comes from YAML, DeepSpeed-style JSON, a Colossal-AI style Python file, a dict or
an existing ``Config``, optionally with ``--set key.path=value`` overrides. Loading goes:
read → aliases to canonical names → Colossal-AI sections translated
(``engine.config.colossalai``) → other engines' unused keys into ``deepspeed_extras`` /
``colossalai_extras`` → overrides → unknown keys → pydantic types. Every problem found on
the way is collected and raised together as one ``ConfigError``. Batch numbers are checked
later, against a world size, by ``engine.batching.plan``; what needs no model but more than
the schema, by ``engine.config.checks``.

New sections (checkpointing, monitoring, ...) are added as a ``Section`` subclass and a
field on ``Config``; unknown-key checks and error locations follow automatically.
"""
from __future__ import annotations

import copy
import difflib
import os
import signal
import warnings
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Optional, Union, get_args

from pydantic import (BaseModel, ConfigDict, Field, PlainValidator, PrivateAttr,
                      ValidationError, field_validator, model_validator)

from engine.config.colossalai import COLOSSALAI_TOP_LEVEL_KEYS, translate, unused_settings_warning
from engine.config.deepspeed_monitor import monitor_from_deepspeed
from engine.config.deepspeed import (DEEPSPEED_CHECKPOINT_KEYS, DEEPSPEED_EXPERT_PARALLEL_KEYS, DEEPSPEED_PIPELINE_KEYS, DEEPSPEED_TENSOR_PARALLEL_KEYS,
                                     DEEPSPEED_TOP_LEVEL_KEYS, DEEPSPEED_ZERO_KEYS, deepspeed_only_settings,
                                     read_autotp_size)
from engine.config.loaders import ConfigError, parse_scalar, read_file
from engine.config.raw import KeyPath, RawConfig, name_as_written
from engine.config.offload import KEYS as OFFLOAD_KEYS, TorchOffload, torch_offload
from engine.config.sharding import DEEPSPEED_SHARD_SIZE_KEYS
from engine.config.torch_features import (OVERLAP_KEYS, SECTIONS as TORCH_FEATURE_SECTIONS, TorchFeatures, TorchOverlap,
                                          torch_features, torch_overlap)

__all__ = ["Config", "ConfigError", "load_config", "ALIASES"]

ALIASES = {
    "gradient_accumulation": "gradient_accumulation_steps",  # Colossal-AI
    "clip_grad_norm": "gradient_clipping",  # Colossal-AI
    "batch_size": "train_batch_size",  # Cerebras (global)
    "micro_batch_size": "train_micro_batch_size_per_gpu",  # Cerebras
    "per_device_train_batch_size": "train_micro_batch_size_per_gpu",  # Hugging Face
    "bfloat16": "bf16",  # DeepSpeed's other spelling
}

# Other engines' top-level keys Microstep keeps, unused, in a pass-through section.
PASS_THROUGH = {"deepspeed_extras": DEEPSPEED_TOP_LEVEL_KEYS,
                "colossalai_extras": frozenset(COLOSSALAI_TOP_LEVEL_KEYS)}

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


def _micro_batch_size(value):
    if value in ("auto", "explore") or (
            isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    raise ValueError(f"expected a positive integer, 'auto' or 'explore', got {value!r}")


MicroBatchSize = Annotated[Union[int, Literal["auto", "explore"]],
                           PlainValidator(_micro_batch_size)]


class Section(BaseModel):
    """A config section: strict types; keys outside the fields and ``deepspeed_keys`` are
    errors. Sections with ``deepspeed_keys`` keep those keys as pydantic extras."""

    model_config = ConfigDict(strict=True, extra="forbid")
    deepspeed_keys: ClassVar[frozenset[str]] = frozenset()


class _DeepSpeedSection(Section):
    model_config = ConfigDict(extra="allow")


class OptimizerConfig(Section):
    type: str  # resolved to a class by the engine
    params: dict[str, Any] = Field(default_factory=dict)


class SchedulerConfig(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


def _defer_reduction(value):
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"expected true, false or 'auto', got {value!r}")


class ZeroConfig(_DeepSpeedSection):
    stage: Annotated[int, Field(ge=0, le=3)] = 0
    # Stages 2/3: false keeps ZeRO's memory (gradients reduce-scattered into shards after every
    # micro-step); true holds full-size gradients for one reduction per window; "auto" defers
    # while the measured peak with the extra gradient fits the memory limit.
    defer_reduction: Annotated[Union[bool, Literal["auto"]], PlainValidator(_defer_reduction)] = False
    # Stages 2/3 (torch backend): consecutive layers are sharded together until a unit holds at
    # least this many parameters (fewer, larger collectives; DeepSpeed's bucket sizes play the
    # same part). A larger unit costs its size in gathered parameters at stage 3.
    shard_unit_size: PositiveInt = 16_000_000
    # Stages 2/3 (torch backend): shard within groups of this many data ranks, replicas across them
    # (hybrid sharding, engine.config.sharding); None: one group of every data rank.
    shard_size: Optional[PositiveInt] = None
    deepspeed_keys: ClassVar[frozenset[str]] = DEEPSPEED_ZERO_KEYS


class FP16Config(_DeepSpeedSection):
    enabled: bool = False
    loss_scale: Annotated[float, Field(ge=0)] = 0.0  # 0 = dynamic loss scaling
    initial_scale_power: Annotated[int, Field(ge=0)] = 16
    loss_scale_window: PositiveInt = 1000
    hysteresis: PositiveInt = 2
    min_loss_scale: PositiveFloat = 1.0
    deepspeed_keys: ClassVar[frozenset[str]] = frozenset(
        {"auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads"})


class BF16Config(_DeepSpeedSection):
    enabled: bool = False
    deepspeed_keys: ClassVar[frozenset[str]] = frozenset(
        {"immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
         "bf16_optimizer_states"})


class DistributedConfig(Section):
    timeout_seconds: PositiveFloat = 1800.0
    # How long an agreement between ranks (a checkpoint's, a flush's micro-step count) waits
    # for a peer that may have died or run different micro-steps, before a clear error.
    agreement_timeout_seconds: PositiveFloat = 600.0
    backend: Literal["auto", "gloo", "nccl"] = "auto"


def _stop_signal(value):
    """A catchable signal's name, as ``SIGTERM`` (``TERM`` is accepted)."""
    name = value.upper() if isinstance(value, str) else value
    if isinstance(name, str) and not name.startswith("SIG"):
        name = "SIG" + name
    if not isinstance(name, str) or not isinstance(getattr(signal, name, None), signal.Signals):
        raise ValueError(f"expected a signal name such as SIGTERM or SIGUSR1, got {value!r}")
    if name in ("SIGKILL", "SIGSTOP"):
        raise ValueError(f"{name} cannot be caught: no process can save before it stops")
    return name


def _path(value):
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.strip():
        return value
    raise ValueError(f"expected a path, got {value!r}")


RESUME_WORDS = ("auto", "never")


def _resume(value):
    """auto, never, or a checkpoint's path. A bare word (no directory part) that is neither word nor
    an existing path is a typo, refused here, by ``validate`` and ``initialize`` alike: a path is
    only read while checkpoint.dir holds no checkpoint, so ``autoo`` would otherwise resume from the
    newest one in some runs and fail in others."""
    try:
        value = _path(value)
    except ValueError:
        raise ValueError(f"expected auto, never or the path of a checkpoint, got {value!r}") from None
    if value in RESUME_WORDS or os.path.exists(value):
        return value
    head, _ = os.path.split(value.rstrip("/" + os.sep))
    if not head:  # a word, not a path to a checkpoint still to come
        match = difflib.get_close_matches(value.lower(), RESUME_WORDS, n=1, cutoff=0.5)
        raise ValueError(f"{value!r} is neither auto, never nor an existing path"
                         f"{f'; did you mean {match[0]}?' if match else ''} (auto: the newest complete checkpoint "
                         "in checkpoint.dir; never: start at step 0; or the path of a checkpoint directory)")
    return value


class CheckpointConfig(_DeepSpeedSection):
    """Automatic checkpoints (``engine.autosave``); DeepSpeed's own checkpoint keys are kept
    for the DeepSpeed backend."""

    dir: Optional[Annotated[str, PlainValidator(_path)]] = None  # for step_<N>; None: nothing automatic
    every_steps: Optional[PositiveInt] = None  # optimizer steps between saves
    keep_last: Optional[PositiveInt] = None  # None: keep every one
    # auto: the newest complete checkpoint in dir; never; or a path, used while dir holds none
    resume: Annotated[str, PlainValidator(_resume)] = "auto"
    # Signals that make every rank save at the next boundary and exit with stop_exit_code:
    # a scheduler's (SIGTERM, Slurm's SIGUSR1 warning) and a person's Ctrl-C (SIGINT).
    stop_signals: list[Annotated[str, PlainValidator(_stop_signal)]] = Field(
        default_factory=lambda: ["SIGTERM", "SIGUSR1", "SIGINT"])
    stop_exit_code: Annotated[int, Field(ge=1, le=255)] = 75  # EX_TEMPFAIL: "try again"
    # `async` (a Python keyword, hence the field's name): automatic saves wait for the host copy
    # only; writing, checksums and publishing run in the background (engine.state.async_save).
    async_: bool = Field(True, alias="async")
    deepspeed_keys: ClassVar[frozenset[str]] = DEEPSPEED_CHECKPOINT_KEYS

    @model_validator(mode="after")
    def _needs_dir(self):
        given = [key for key in ("every_steps", "keep_last") if getattr(self, key) is not None]
        # Set to something else than the default (to_dict() writes the defaults out: it must load back).
        given += [type(self).model_fields[key].alias or key for key in ("stop_signals", "stop_exit_code", "async_")
                  if key in self.model_fields_set and getattr(self, key) != type(self).model_fields[key].get_default(
                      call_default_factory=True)]
        if given and self.dir is None:
            names = given[0] if len(given) == 1 else f"{', '.join(given[:-1])} and {given[-1]}"
            raise ValueError(f"{names} {'needs' if len(given) == 1 else 'need'} dir, the directory automatic "
                             "checkpoints are written into (stop signals save there too)")
        return self


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
# DeepSpeed's partition methods that mean one of our splits.
_DEEPSPEED_PARTITIONS = {"parameters": "auto", "best": "auto", "uniform": "uniform"}


def _split(value):
    if value in ("auto", "uniform"):
        return value
    if isinstance(value, list) and value and all(isinstance(name, str) and name for name in value):
        if len(set(value)) != len(value):
            raise ValueError(f"a module name is given twice in {value!r}")
        return value
    raise ValueError(f"expected auto, uniform or a list of module names where a stage starts, got {value!r}")


def _stages(value):
    if value == "auto":  # DeepSpeed's default: the model's own count; without one, no pipeline
        return 1
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"expected a number of stages (an integer >= 1), got {value!r}")


class PipelineConfig(_DeepSpeedSection):
    """Pipeline parallelism (``engine.strategies.pipeline``): the model split into ``stages``
    consecutive parts on as many ranks, the accumulation steps run as the schedule's micro-batches."""

    stages: Annotated[int, PlainValidator(_stages)] = 1
    schedule: Literal[PIPELINE_SCHEDULES] = "1f1b"
    # auto: balanced by parameter count; uniform: by number of modules (a Hugging Face model with
    # a pipeline plan: its decoder layers, engine.pipeline.hf_plan); or the names of the
    # modules where stages 2, 3, ... start (as many names as stages - 1, or stages x 2 - 1
    # for the schedules with two stages per rank).
    split: Annotated[Union[str, list[str]], PlainValidator(_split)] = "auto"
    deepspeed_keys: ClassVar[frozenset[str]] = DEEPSPEED_PIPELINE_KEYS | {"partition"}

    @model_validator(mode="after")
    def _deepspeed_partition(self):
        extra = self.model_extra or {}
        if "partition" in extra:
            partition = extra.pop("partition")
            mapped = _DEEPSPEED_PARTITIONS.get(str(partition).lower())
            if mapped is None:
                raise ValueError(f"partition {partition!r} (DeepSpeed's partition method): Microstep splits by "
                                 "'parameters' or 'uniform'; or give split: [module names]")
            if "split" in self.model_fields_set and self.split != mapped:
                raise ValueError(f"partition {partition!r} (DeepSpeed's name for split: {mapped}) conflicts with "
                                 f"split: {self.split!r}; keep one")
            self.split = mapped
        return self


class FaultsConfig(Section):
    """What the engine does when a run goes wrong in a way it can detect (docs/config.md)."""

    # A window whose gradient holds an inf or nan: discard it (counted in skipped_steps), or raise
    # NonFiniteGradientError on every rank. (fp16: an overflow is loss scaling's normal signal and
    # is always discarded; raise applies once the loss scale is at min_loss_scale.)
    non_finite_gradient: Literal["skip", "raise"] = "skip"


class MonitorConfig(Section):
    """Training metrics and progress (``engine.monitor``); rank 0 writes, others stay quiet."""

    enabled: bool = False
    progress: bool = True  # rank 0 progress display
    log_every: PositiveInt = 1  # optimizer steps between records / progress lines
    jsonl: Optional[str] = None  # path of a JSON-lines metrics file
    csv: Optional[str] = None  # path of a CSV metrics file
    tensorboard: Optional[str] = None  # a log dir; needs the tensorboard package
    wandb: Optional[dict[str, str]] = None  # wandb.init keywords (project, group, entity, ...); needs wandb
    peak_flops: Optional[PositiveFloat] = None  # a device's peak FLOP/s for MFU (default: known GPUs', engine.monitor.throughput)
    grad_norm: bool = True  # compute the global gradient norm even without clipping
    total_steps: Optional[PositiveInt] = None  # for the progress bar and ETA


def _tensor_plan(value):
    if value == "auto":
        return value
    if isinstance(value, dict) and value and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return value
    raise ValueError("expected 'auto' or a mapping {module pattern: style}, e.g. "
                     f"{{'layers.*.mlp.up': colwise, 'layers.*.mlp.down': rowwise}}, got {value!r}")


class TensorParallelConfig(_DeepSpeedSection):
    """Tensor parallelism (``engine.strategies.parallelize``): ``size`` ranks split each layer
    the plan names; the data-parallel ranks are world / (tensor × pipeline)."""

    size: PositiveInt = 1
    # auto: the model's own plan (a Hugging Face base_model_tp_plan), else Linear pairs of an MLP;
    # or {module name pattern ('*' matches one name): colwise | rowwise | colwise_rep}
    plan: Annotated[Union[Literal["auto"], dict[str, str]], PlainValidator(_tensor_plan)] = "auto"
    # The first N optimizer steps check that every rank of a tensor group got the same inputs
    # (a fingerprint, one small all-reduce per forward); 0 turns the check off.
    check_batches: Annotated[int, Field(ge=0)] = 2
    deepspeed_keys: ClassVar[frozenset[str]] = DEEPSPEED_TENSOR_PARALLEL_KEYS


# -- context parallelism (issue 31): one section, read by engine.context ---------------------
class ContextParallelConfig(Section):
    """Context parallelism (``engine.context``): every sequence split over ``size`` ranks.
    ``method``: ulysses (all-to-all between sequence and heads around attention; any attention
    implementation, any device; the heads must divide by ``size``), ring (keys and values passed
    round the group, blockwise attention merged by log-sum-exp: any head count, any device; dropout,
    sliding windows, soft caps and sinks inside attention refused) or auto (ulysses where the query
    and key/value heads divide, else ring). ``labels``: auto (a Hugging Face causal LM shifts its
    labels itself: they are shifted before the split; other models' labels are taken as already
    aligned with their positions), shift, or aligned. DeepSpeed's top-level
    ``sequence_parallel_size`` is read as ``size`` (Ulysses)."""

    size: PositiveInt = 1
    method: Literal["ulysses", "ring", "auto"] = "auto"
    labels: Literal["auto", "shift", "aligned"] = "auto"
    # The first N micro-batches check that every rank of a context group got the same rows (a
    # fingerprint, one small all-gather per micro-batch) and that a (sum, count) loss counted the
    # real targets of its part's labels (one all-reduce of a flag); 0 turns the checks off.
    check_micro_batches: Annotated[int, Field(ge=0)] = 4


class MoeConfig(Section):
    """Mixture-of-experts routers (``engine.experts``): whose batch the load-balancing term balances."""

    # global: the term over the whole global batch (every micro-batch and data rank), exact;
    # micro_batch: each forward's own term, as the model computes it alone.
    load_balance: Literal["global", "micro_batch"] = "global"
    # How global learns the window's router counts before its backwards: a counting forward first
    # (no memory, one more forward), every forward held before the backwards (no extra FLOPs, holds
    # the window's activations; one process or ZeRO 0 / 1, reduced at the boundary), or auto (held
    # under activation checkpointing where the holder allows it, counted otherwise).
    global_counts: Literal["auto", "count_forward", "hold_forwards"] = "auto"
    # Aux-loss-free balancing (DeepSeek-V3): each boundary moves every router's
    # e_score_correction_bias by this much towards even load (0 = off).
    bias_update_speed: Annotated[float, Field(ge=0)] = 0.0


class ExpertParallelConfig(_DeepSpeedSection):
    """Experts split over ``size`` of the data ranks, tokens dispatched by all-to-all
    (``engine.experts.parallel``). ``modules``: glob patterns (``*`` one name part) of the modules of
    experts, for a model without Hugging Face's ``base_model_ep_plan``. DeepSpeed's AutoEP section
    maps: ``{enabled: true, autoep_size: N}`` is ``size: N``."""

    size: PositiveInt = 1
    modules: Optional[Annotated[list[str], Field(min_length=1)]] = None
    deepspeed_keys: ClassVar[frozenset[str]] = DEEPSPEED_EXPERT_PARALLEL_KEYS | {"enabled", "autoep_size"}

    @model_validator(mode="after")
    def _deepspeed_autoep(self):
        extra = self.model_extra or {}
        enabled, autoep = extra.pop("enabled", None), extra.pop("autoep_size", None)
        if enabled and autoep is not None:
            if "size" in self.model_fields_set and self.size != autoep:
                raise ValueError(f"autoep_size {autoep!r} (DeepSpeed's name for size) conflicts with size: "
                                 f"{self.size!r}; keep one")
            if not isinstance(autoep, int) or isinstance(autoep, bool) or autoep < 1:
                raise ValueError(f"autoep_size: expected a positive integer, got {autoep!r}")
            self.size = autoep
        return self


class Config(BaseModel):
    """A validated Microstep config. Build it with ``load_config``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    train_batch_size: Optional[PositiveInt] = None
    train_micro_batch_size_per_gpu: Optional[MicroBatchSize] = None
    gradient_accumulation_steps: Optional[PositiveInt] = None
    batch_split: Literal["strict", "balanced"] = "strict"
    auto_max: Optional[PositiveInt] = None  # largest micro size auto / explore may try
    auto_memory_limit: Optional[PositiveFloat] = None  # bytes if > 1, else device fraction
    # Micro-batches formed by padded tokens (rows x longest row) instead of a fixed size; the
    # rows' lengths come from the batch's attention_mask or initialize(lengths=...).
    micro_batch_tokens: Optional[PositiveInt] = None
    sequence_keys: Optional[Annotated[list[str], Field(min_length=1)]] = None  # the tensors trimmed to a micro-batch's length
    # With micro_batch_tokens: each micro-batch's documents (rows' real tokens) packed end to end
    # into one row, position_ids restarting per document, no padding (engine.batching.packing).
    packing: bool = False
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    gradient_clipping: Annotated[float, Field(ge=0)] = 0.0  # max global norm; 0 = off
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    context_parallel: ContextParallelConfig = Field(default_factory=ContextParallelConfig)
    moe: MoeConfig = Field(default_factory=MoeConfig)  # [moe]
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig)  # [moe]
    backend: Literal["torch", "deepspeed"] = "torch"
    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)  # after fp16: its check reads fp16
    seed: Optional[Annotated[int, Field(ge=0)]] = None
    batch_statistics: Literal["warn", "error", "ignore"] = "warn"
    # A scalar loss the engine cannot read as (sum, count) while the batch carries labels or an
    # attention mask: an error instead of a warning (engine.window.model_loss).
    strict: bool = False
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    constants: dict[str, Any] = Field(default_factory=dict)
    deepspeed_extras: dict[str, Any] = Field(default_factory=dict)
    colossalai_extras: dict[str, Any] = Field(default_factory=dict)

    _source: str = PrivateAttr(default="<Config>")
    _locations: dict = PrivateAttr(default_factory=dict)  # key path -> "file:line"
    _written_as: dict = PrivateAttr(default_factory=dict)  # canonical top-level key -> the alias written
    _torch_sections: Any = PrivateAttr(default=None)  # (what they were read from, TorchSections): torch_sections

    @field_validator("bf16")
    @classmethod
    def _one_half_precision(cls, bf16: BF16Config, info):
        fp16 = info.data.get("fp16")
        if bf16.enabled and fp16 is not None and fp16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled are both true; enable at most one")
        return bf16

    @property
    def source(self) -> str:
        """Where this config came from (a path, ``<dict>``); not part of ``to_dict``."""
        return self._source

    def as_written(self, text: str) -> str:
        """``text`` (a message naming config keys) with each key the config wrote as an alias named as written."""
        return name_as_written(text, self._written_as)

    def to_dict(self) -> dict:
        """The canonical plain dict: every key, defaults included, aliases resolved."""
        return self.model_dump(by_alias=True)


def half_precision(config: Config) -> Optional[str]:
    """"fp16", "bf16" or None: the half precision the config's fp16 / bf16 section enables."""
    return "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else None


@dataclass(frozen=True)
class TorchSections:
    """The torch backend's readings of DeepSpeed-spelled sections (offload keys, the precision
    policy, activation checkpointing, compile and overlap sections), parsed once per config:
    the notes ``load_config`` prints, the checks and the resolved setup all read these."""

    features: TorchFeatures
    offload: TorchOffload
    overlap: TorchOverlap

    @property
    def problems(self) -> list[str]:
        return [*self.offload.problems, *self.features.problems, *self.overlap.problems]

    @property
    def notes(self) -> list[str]:
        return [*self.offload.notes, *self.features.notes]


def torch_sections(config: Config) -> TorchSections:
    """``config``'s :class:`TorchSections`, parsed at the first call and kept on the config (a
    copy made with other sections, ``model_copy(update=...)``, parses its own)."""
    read_from = (id(config.zero_optimization), id(config.deepspeed_extras), half_precision(config))
    cached = config._torch_sections
    if cached is None or cached[0] != read_from:
        zero = config.zero_optimization
        cached = read_from, TorchSections(torch_features(config.deepspeed_extras, half_precision(config)),
                                          torch_offload(zero), torch_overlap(zero.model_extra or {}))
        config._torch_sections = cached
    return cached[1]


def load_config(source, overrides=None, caller_reads=frozenset()) -> Config:
    """Load and validate a config.

    `source`: a path (.yaml/.yml/.json/.py), a dict, or a ``Config`` (returned as-is
    without overrides). `overrides`: ``["zero_optimization.stage=2", ...]`` (values read
    as YAML scalars) or ``{"zero_optimization.stage": 2}``. `caller_reads`: DeepSpeed keys
    the caller honours itself, left out of the "not used" warning. Raises ``ConfigError``.
    """
    if isinstance(source, Config):
        if not overrides:
            return source
        raw = RawConfig(source.to_dict(), source.source)
    elif isinstance(source, dict):
        raw = RawConfig(copy.deepcopy(source), "<dict>")
    elif isinstance(source, (str, os.PathLike)):
        raw = read_file(source)
    else:
        raise ConfigError(f"config must be a path, a dict or an engine.Config, "
                          f"got {type(source).__name__}")

    problems: list[str] = []
    _resolve_aliases(raw, problems)
    notes = translate(raw, problems)
    _read_autotp_size(raw, problems)
    _read_sequence_parallel_size(raw, problems)
    _collect_pass_through_keys(raw)
    _apply_overrides(raw, overrides, problems)
    _drop_unknown_keys(raw, Config, (), raw.data, problems)
    try:
        config = Config.model_validate(raw.data)
    except ValidationError as error:
        problems += [_describe(raw, detail) for detail in error.errors()]
    if problems:
        raise ConfigError(sorted(map(raw.as_written, problems), key=lambda problem: _line_of(problem, raw.source)))
    config._source, config._locations, config._written_as = raw.source, raw.locations, raw.written_as
    unused = deepspeed_only_settings(config)
    if config.backend == "torch":  # DeepSpeed's monitor sections drive the monitor (engine.config.deepspeed_monitor)
        monitor, read, monitor_problems = monitor_from_deepspeed(config.deepspeed_extras, config.monitor)
        if monitor_problems:
            raise ConfigError(sorted(monitor_problems, key=lambda problem: _line_of(problem, raw.source)))
        config.monitor = config.monitor.model_copy(update=monitor)
        unused = [name for name in unused if name not in read]
    if config.backend == "torch":
        unused = [name for name in unused
                  if name.removeprefix("zero_optimization.") not in OFFLOAD_KEYS | OVERLAP_KEYS | set(DEEPSPEED_SHARD_SIZE_KEYS)
                  and name not in caller_reads
                  and name not in TORCH_FEATURE_SECTIONS]
        notes += [f"{config.source}: {note}" for note in torch_sections(config).notes]
    if config.backend == "torch" and unused:
        notes.append(f"{config.source}: DeepSpeed setting(s) {', '.join(unused)} are not used by "
                     "the torch backend; they are kept for backend: deepspeed")
    notes.append(unused_settings_warning(config.source, config.colossalai_extras))
    if config.pipeline.stages == 1 and config.pipeline.split != "auto":  # auto: the default, harmless
        notes.append(f"{config.source}: pipeline.split {config.pipeline.split!r} has no effect with pipeline.stages 1 "
                     "(the model is not cut); it applies when stages > 1")
    for note in filter(None, notes):
        warnings.warn(note, UserWarning, stacklevel=2)
    return config


def locate(config: Config, problems: list[str]) -> list[str]:
    """``key.path: problem`` lines prefixed with where the key was written, in reading order
    (as ``load_config`` reports), for checks made after loading."""
    raw = RawConfig({}, config.source, config._locations, config._written_as)
    located = [f"{raw.where(_canonical_path(tuple(problem.split(':', 1)[0].split('.'))))}: {raw.as_written(problem)}"
               for problem in problems]
    return sorted(located, key=lambda problem: _line_of(problem, raw.source))


# -- normalising ------------------------------------------------------------------------
def _resolve_aliases(raw: RawConfig, problems: list[str]) -> None:
    data = raw.data
    for alias, canonical in ALIASES.items():
        if alias not in data:
            continue
        value = data.pop(alias)
        if canonical in data and data[canonical] != value:
            problems.append(f"{raw.where((alias,))}: {alias}: {value!r} conflicts with "
                            f"{canonical}: {data[canonical]!r} ({alias} is another name for "
                            f"{canonical}; keep one)")
            continue
        data[canonical] = value
        raw.move((alias,), (canonical,))
        raw.written_as[canonical] = alias


def _read_autotp_size(raw: RawConfig, problems: list[str]) -> None:
    section = raw.data.get("tensor_parallel")
    if isinstance(section, dict):  # else reported as a type error by the schema
        problem = read_autotp_size(section, raw.where(("tensor_parallel", "autotp_size")))
        if problem:
            problems.append(problem)
        else:
            raw.move(("tensor_parallel", "autotp_size"), ("tensor_parallel", "size"))


def _read_sequence_parallel_size(raw: RawConfig, problems: list[str]) -> None:
    """DeepSpeed's top-level ``sequence_parallel_size`` (Ulysses) as ``context_parallel.size``."""
    if "sequence_parallel_size" not in raw.data:
        return
    size = raw.data.pop("sequence_parallel_size")
    section = raw.data.setdefault("context_parallel", {})
    if not isinstance(section, dict):  # reported as a type error by the schema
        return
    if "size" in section and section["size"] != size:
        problems.append(f"{raw.where(('sequence_parallel_size',))}: sequence_parallel_size: {size!r} conflicts with "
                        f"context_parallel.size: {section['size']!r} (sequence_parallel_size is DeepSpeed's name "
                        "for it; keep one)")
        return
    section["size"] = size
    section.setdefault("method", "ulysses")
    raw.move(("sequence_parallel_size",), ("context_parallel", "size"))


def _pass_through_section(key: str) -> Optional[str]:
    return next((section for section, keys in PASS_THROUGH.items() if key in keys), None)


def _collect_pass_through_keys(raw: RawConfig) -> None:
    for key in list(raw.data):
        section = _pass_through_section(key)
        if section is None:
            continue
        extras = raw.data.setdefault(section, {})
        if isinstance(extras, dict):  # else reported as a type error by the schema
            extras[key] = raw.data.pop(key)
            raw.move((key,), (section, key))


def _canonical_path(path: KeyPath) -> KeyPath:
    head = ALIASES.get(path[0], path[0])
    section = _pass_through_section(head)
    return ((section, head) if section else (head,)) + path[1:]


def _parse_overrides(overrides, problems: list[str]) -> list[tuple[KeyPath, Any]]:
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = []
        for text in [overrides] if isinstance(overrides, str) else overrides:
            key, equals, value = str(text).partition("=")
            if not equals:
                problems.append(f"--set: {text!r}: expected key.path=value")
                continue
            items.append((key, parse_scalar(value.strip())))
    parsed = []
    for key, value in items:
        path = tuple(part.strip() for part in str(key).split("."))
        if not all(path):
            problems.append(f"--set: {key!r}: malformed key path")
            continue
        parsed.append((_canonical_path(path), value))
    return parsed


def _apply_overrides(raw: RawConfig, overrides, problems: list[str]) -> None:
    for path, value in _parse_overrides(overrides or [], problems):
        node = raw.data
        for depth, key in enumerate(path[:-1]):
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict):
                problems.append(f"--set: {'.'.join(path)}: {'.'.join(path[:depth + 1])} is "
                                f"{type(node).__name__}, not a section with keys")
                break
        else:
            node[path[-1]] = value
            raw.forget(path)
            raw.locations[path] = "--set"


# -- checking ---------------------------------------------------------------------------
def _section_model(annotation) -> Optional[type[BaseModel]]:
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


# Keys of earlier Microstep versions: {path: what to write instead}.
REPLACED_KEYS = {
    ("zero_optimization", "reduce_every_micro_step"): (
        "replaced by defer_reduction: reducing after every micro-step is now the default "
        "(defer_reduction: false); reduce_every_micro_step: false is defer_reduction: true"),
}


def _drop_unknown_keys(raw: RawConfig, model: type[BaseModel], path: KeyPath, data,
                       problems: list[str]) -> None:
    """Report and remove unknown keys, so the schema reports only type problems."""
    if not isinstance(data, dict):
        return
    extras = getattr(model, "deepspeed_keys", frozenset())
    fields = {field.alias or name: field for name, field in model.model_fields.items()}  # by the key written
    known = set(fields) | extras
    suggestions = known | (set(ALIASES).union(*PASS_THROUGH.values()) if model is Config else set())
    for key in list(data):
        name = str(key)
        if name in fields:
            section = _section_model(fields[name].annotation)
            if section is not None:
                _drop_unknown_keys(raw, section, path + (name,), data[key], problems)
        elif path + (name,) in REPLACED_KEYS:
            problems.append(f"{raw.where(path + (name,))}: {'.'.join(path + (name,))}: "
                            f"{REPLACED_KEYS[path + (name,)]}")
            del data[key]
        elif name not in extras:
            match = difflib.get_close_matches(name, sorted(suggestions), n=1)
            hint = f"; did you mean {match[0]}?" if match else ""
            if not match and not extras and model is not Config:
                hint = f"; expected one of: {', '.join(fields)}"
            if not path and raw.source.endswith(".py") and raw.where((name,)) != "--set":
                hint += " (a value of your own? name it in UPPER_CASE: it is kept in constants)"
            dotted = ".".join(path + (name,))
            problems.append(f"{raw.where(path + (name,))}: {dotted}: unknown key{hint}")
            del data[key]


def _line_of(problem: str, source: str) -> float:
    """The line a problem points at in `source` (reading order); inf for other sources."""
    head = problem[len(source) + 1:].split(":", 1)[0] if problem.startswith(source + ":") else ""
    return int(head) if head.isdigit() else float("inf")


_EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "dict_type": "a mapping of keys",
             "model_type": "a section (a mapping of keys)"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<",
           "less_than_equal": "<="}


def _describe(raw: RawConfig, detail: dict) -> str:
    """One pydantic error as ``<where>: <key.path>: <problem>``."""
    path = tuple(str(part) for part in detail["loc"])
    kind, value, context = detail["type"], detail.get("input"), detail.get("ctx", {})
    if kind == "missing":
        problem = "required key is missing"
    elif kind in _EXPECTED:
        problem = f"expected {_EXPECTED[kind]}, got {value!r} ({type(value).__name__})"
    elif kind in _BOUNDS:
        bound = next(iter(context.values()))
        problem = f"must be {_BOUNDS[kind]} {bound:g}, got {value!r}"
    elif kind == "value_error":
        problem = str(context["error"])
    else:
        problem = f"{detail['msg'][:1].lower()}{detail['msg'][1:]}, got {value!r}"
    if isinstance(value, str) and value == "auto":
        problem += ("; 'auto' (a Hugging Face Trainer placeholder) is only understood for "
                    "train_micro_batch_size_per_gpu: give a value")
    return f"{raw.where(path)}: {'.'.join(path)}: {problem}"
