"""Optimizers and learning-rate schedules from the config's ``optimizer`` / ``scheduler``.

Optimizer types are the ``torch.optim`` classes by name (case-insensitive). Schedule types
are the ``torch.optim.lr_scheduler`` classes by name plus DeepSpeed's schedules
(``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``) with
DeepSpeed's formulas and defaults and
torch's step indexing: the learning rate used by optimizer step ``t`` (0-based) is the
schedule's value at ``t``. The scheduler steps once per optimizer step.
``build_deepspeed_scheduler`` builds DeepSpeed's schedules stepped as DeepSpeed itself steps
them (for ``engine.compat.deepspeed``): one step late, starting from their "not started" value.

A section is refused with every problem at once: an unknown type or parameter name (with a
"did you mean"), an ``'auto'`` placeholder, a value torch rejects. ``check_sections`` finds
them without a model.
"""

from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Callable, Iterable

import torch
from torch.optim.lr_scheduler import LRScheduler

from engine.errors import ConfigError


def _public_classes(module, base) -> dict[str, type]:
    return {
        name.lower(): cls
        for name, cls in vars(module).items()
        if inspect.isclass(cls) and issubclass(cls, base) and cls is not base and not name.startswith("_")
    }


def _did_you_mean(name: str, choices) -> str:
    match = difflib.get_close_matches(name, choices, n=1)
    return f"did you mean {match[0]}? " if match else ""


def _keyword_names(cls: type) -> list[str] | None:
    """The keyword parameters of ``cls`` after its first (the params / the optimizer);
    None when it takes ``**kwargs`` (any name may be right)."""
    parameters = list(inspect.signature(cls).parameters.values())[1:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _resolve(kind: str, registry: dict[str, type], type_name: str, params: dict):
    """The class for ``type_name``, the ``params`` it can be built with, and the problems
    that show without building (a placeholder, an unknown type or parameter name)."""
    problems = [f"{kind}.params.{key}: 'auto' is a Hugging Face Trainer placeholder; give a value"
                for key, value in params.items() if value == "auto"]
    cls = registry.get(type_name.lower())
    if cls is None:
        names = sorted(c.__name__ for c in registry.values())
        guess = _did_you_mean(type_name, names) or _did_you_mean(type_name.lower(), list(registry))
        problems.append(f"{kind}.type: unknown {kind} type {type_name!r}; {guess}known types: {', '.join(names)}")
        return None, {}, problems
    accepted = _keyword_names(cls)
    for key in [] if accepted is None else [k for k in params if k not in accepted]:
        problems.append(f"{kind}.params: {cls.__name__} has no parameter {key!r}; "
                        f"{_did_you_mean(key, accepted)}its parameters: {', '.join(accepted)}")
    usable = {key: value for key, value in params.items()
              if value != "auto" and (accepted is None or key in accepted)}
    return cls, usable, problems


def _build(kind: str, registry: dict[str, type], type_name: str, params: dict, target: Any):
    """``type_name(target, **params)``, or one ConfigError with every problem: the usable
    params are still built, so bad values show next to bad names."""
    cls, usable, problems = _resolve(kind, registry, type_name, params)
    built = None
    if cls is not None:
        problems += _not_numbers(kind, cls, usable)
        try:
            built = cls(target, **usable)
        except (TypeError, ValueError, RuntimeError) as err:  # torch refuses bad values with any of these
            problems.append(f"{kind}.params: {cls.__name__}: {err}")
    if problems:
        raise ConfigError(problems)
    return built


def _not_numbers(kind: str, cls: type, usable: dict) -> list[str]:
    """Text given where ``cls`` takes a number (its default is one, e.g. ``lr: "3e-4x"``),
    removed from ``usable``: torch would fail comparing it ("'<=' not supported between ...")."""
    problems = []
    defaults = {name: p.default for name, p in inspect.signature(cls).parameters.items()}
    for name, value in list(usable.items()):
        default = defaults.get(name)
        if isinstance(value, str) and isinstance(default, (int, float)) and not isinstance(default, bool):
            problems.append(f"{kind}.params.{name}: expected a number, got the text {value!r} "
                            f"(e.g. {name}: {default})")
            del usable[name]
    return problems


DEEPSPEED_ADAM_WEIGHT_DECAY = 0.0  # DeepSpeed's FusedAdam / DeepSpeedCPUAdam default (torch's AdamW: 0.01)


def _deepspeed_adam_params(type_name: str, params: dict) -> tuple[str, dict]:
    """DeepSpeed's ``Adam`` / ``AdamW`` types as DeepSpeed builds them: ``Adam`` means AdamW
    unless ``adam_w_mode`` is false (``AdamW`` always is), and the weight decay defaults to
    DeepSpeed's 0.0 unless ``torch_adam: true`` asks for torch's class with torch's defaults.
    lr, betas and eps default alike in both (1e-3, (0.9, 0.999), 1e-8)."""
    params = dict(params)
    if type_name.lower() not in ("adam", "adamw"):
        return type_name, params
    torch_adam = params.pop("torch_adam", False)
    adam_w_mode = params.pop("adam_w_mode", True)  # DeepSpeed's default
    if type_name.lower() == "adamw" or adam_w_mode:
        type_name = "AdamW"
    if not torch_adam:
        params.setdefault("weight_decay", DEEPSPEED_ADAM_WEIGHT_DECAY)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return type_name, params


OPTIMIZERS = _public_classes(torch.optim, torch.optim.Optimizer)


def build_optimizer(section, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer described by a config ``optimizer`` section."""
    type_name, kwargs = _deepspeed_adam_params(section.type, section.params)
    return _build("optimizer", OPTIMIZERS, type_name, kwargs, list(params))


class _WarmupSchedule(LRScheduler):
    """Base for DeepSpeed-style schedules given as a closed form of the step."""

    def _lr(self, step: int, base_lr: float, group_index: int) -> float:
        raise NotImplementedError

    def _before_start(self, base_lr: float, group_index: int) -> float:
        raise NotImplementedError

    def _schedule_step(self) -> int:
        """The schedule's step whose value the next optimizer step uses (torch's indexing)."""
        return self.last_epoch

    def get_lr(self) -> list[float]:
        step = self._schedule_step()
        return [self._lr(step, base, i) if step >= 0 else self._before_start(base, i)
                for i, base in enumerate(self.base_lrs)]


def _warmup_gamma(step: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warm-up done at ``step``: log or linear, 1.0 once warm."""
    if step >= warmup_num_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(step + 1) / math.log(warmup_num_steps)
    return step / warmup_num_steps


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> int:
    if not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    return max(2, warmup_num_steps)  # log warm-up divides by log(steps)


class WarmupLR(_WarmupSchedule):
    """From ``warmup_min_lr`` up to ``warmup_max_lr`` (default: the optimizer's lr), then flat."""

    def __init__(self, optimizer, warmup_min_lr: float = 0.0, warmup_max_lr: float | None = None,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_epoch: int = -1):
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.warmup_min_lr = warmup_min_lr
        self.warmup_max_lr = warmup_max_lr
        super().__init__(optimizer, last_epoch)

    def _gamma(self, step: int) -> float:
        return _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)

    def _lr(self, step, base_lr, group_index):
        top = base_lr if self.warmup_max_lr is None else self.warmup_max_lr
        return self.warmup_min_lr + (top - self.warmup_min_lr) * self._gamma(step)

    def _before_start(self, base_lr: float, group_index: int) -> float:
        return self.warmup_min_lr


class WarmupDecayLR(WarmupLR):
    """``WarmupLR`` followed by a linear decay reaching ``warmup_min_lr`` at ``total_num_steps``.
    ``warmup_max_lr`` defaults to 0.001 (DeepSpeed's), not to the optimizer's lr as in ``WarmupLR``."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_epoch: int = -1):
        if not isinstance(total_num_steps, int) or total_num_steps <= 0:
            raise ValueError(f"total_num_steps must be a positive integer, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def _gamma(self, step: int) -> float:
        if step < self.warmup_num_steps:
            return _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - step) / decay_steps)


class WarmupCosineLR(_WarmupSchedule):
    """Ratio of the optimizer's lr: warm up from ``warmup_min_ratio`` to 1, then a cosine down
    to ``cos_min_ratio`` at ``total_num_steps``, flat after."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_epoch: int = -1):
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        super().__init__(optimizer, last_epoch)

    def _ratio(self, step: int) -> float:
        if step < self.warmup_num_steps:
            gamma = _warmup_gamma(step, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        done = step - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lr(self, step, base_lr, group_index):
        return base_lr * self._ratio(step)

    def _before_start(self, base_lr: float, group_index: int) -> float:
        return 0.0  # DeepSpeed's ratio before its first step


class _DeepSpeedStepping:
    """DeepSpeed's own stepping of its schedules: built, they stand at their "not started"
    value; each ``step()`` then moves to the next value. So optimizer step ``t`` uses the
    schedule's value at ``t - 1`` (the first two steps both use the start)."""

    def _schedule_step(self) -> int:
        return self.last_epoch - 1


class DeepSpeedWarmupLR(_DeepSpeedStepping, WarmupLR):
    """``WarmupLR`` stepped as DeepSpeed steps it."""


class DeepSpeedWarmupDecayLR(_DeepSpeedStepping, WarmupDecayLR):
    """``WarmupDecayLR`` stepped as DeepSpeed steps it."""


class DeepSpeedWarmupCosineLR(_DeepSpeedStepping, WarmupCosineLR):
    """``WarmupCosineLR`` stepped as DeepSpeed steps it."""


def _per_group(optimizer, value, name: str) -> list:
    """A scalar for every parameter group, or a list with one value per group (DeepSpeed's rule)."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"{name}: expected {len(optimizer.param_groups)} values (one per parameter group), "
                             f"got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


class LRRangeTest(_WarmupSchedule):
    """DeepSpeed's learning-rate range test: from ``lr_range_test_min_lr`` up by
    ``lr_range_test_step_rate`` every ``lr_range_test_step_size`` steps (continuously, or in
    stairs)."""

    def __init__(self, optimizer, lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False, last_epoch: int = -1):
        if not isinstance(lr_range_test_step_size, int) or lr_range_test_step_size <= 0:
            raise ValueError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate, self.staircase = lr_range_test_step_size, lr_range_test_step_rate, \
            lr_range_test_staircase
        super().__init__(optimizer, last_epoch)

    def _lr(self, step, base_lr, group_index):
        interval = (step + 1) / self.step_size
        return self.min_lrs[group_index] * (1 + self.step_rate * (math.floor(interval) if self.staircase else interval))

    def _before_start(self, base_lr, group_index):
        return self.min_lrs[group_index]


class OneCycle(_WarmupSchedule):
    """DeepSpeed's 1Cycle: the learning rate from ``cycle_min_lr`` up to ``cycle_max_lr`` over
    ``cycle_first_step_size`` steps and back down over ``cycle_second_step_size`` (default: the
    same), optionally in stairs, then decaying by ``decay_lr_rate`` every ``decay_step_size``
    steps. With ``cycle_momentum`` and an optimizer with betas (Adam's), beta1 cycles the
    other way between ``cycle_max_mom`` and ``cycle_min_mom`` (beta2 set to 0.99, as DeepSpeed does)."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_epoch: int = -1):
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0 or second < 0:
            raise ValueError(f"cycle_first_step_size must be positive and cycle_second_step_size non-negative, got "
                             f"{cycle_first_step_size!r} and {cycle_second_step_size!r}")
        self.first_step_size, self.second_step_size, self.total_size = first, second, first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate, self.decay_mom_rate = decay_lr_rate, decay_mom_rate
        no_decay = math.isclose(decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(decay_mom_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults  # DeepSpeed: betas only
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        super().__init__(optimizer, last_epoch)

    def _scale(self, step: int) -> float:
        iteration = step + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # flat across each stair, counted from the integer position in the cycle
            position = iteration % self.total_size
            if position <= self.first_step_size:
                scale = math.floor(position * stairs / self.first_step_size) / stairs
            else:
                scale = math.floor((self.total_size - position) * stairs / self.second_step_size) / stairs
        return scale

    def _lr(self, step, base_lr, group_index):
        low, high = self.min_lrs[group_index], self.max_lrs[group_index]
        if step < self.total_size:
            return low + (high - low) * self._scale(step)
        if self.skip_lr_decay:
            return low
        return low / (1 + self.decay_lr_rate * (step - self.total_size + 1) / self.decay_step_size)

    def _before_start(self, base_lr, group_index):
        return self.min_lrs[group_index]

    def _momentum(self, step: int, group_index: int) -> float:
        low, high = self.min_moms[group_index], self.max_moms[group_index]
        if step < 0:
            return low
        if step < self.total_size:
            return high - (high - low) * self._scale(step)
        if self.skip_mom_decay:
            return high
        return high * (1 + self.decay_mom_rate * (step - self.total_size + 1) / self.decay_step_size)

    def step(self, epoch=None):
        super().step(epoch)
        if self.cycle_momentum:
            step = self._schedule_step()
            for i, group in enumerate(self.optimizer.param_groups):
                group["betas"] = (self._momentum(step, i), 0.99)


class DeepSpeedLRRangeTest(_DeepSpeedStepping, LRRangeTest):
    """``LRRangeTest`` stepped as DeepSpeed steps it."""


class DeepSpeedOneCycle(_DeepSpeedStepping, OneCycle):
    """``OneCycle`` stepped as DeepSpeed steps it."""


SCHEDULERS = {
    **_public_classes(torch.optim.lr_scheduler, LRScheduler),
    **{cls.__name__.lower(): cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest, OneCycle)},
}
# These need Python callables or other schedulers, which a config file cannot hold.
for _name in ("lambdalr", "multiplicativelr", "sequentiallr", "chainedscheduler", "reducelronplateau"):
    SCHEDULERS.pop(_name, None)


def build_scheduler(section, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The learning-rate schedule described by a config ``scheduler`` section."""
    return _build("scheduler", SCHEDULERS, section.type, dict(section.params), optimizer)


DEEPSPEED_SCHEDULERS = {
    **SCHEDULERS,
    **{name: cls for name, cls in (("warmuplr", DeepSpeedWarmupLR), ("warmupdecaylr", DeepSpeedWarmupDecayLR),
                                   ("warmupcosinelr", DeepSpeedWarmupCosineLR), ("lrrangetest", DeepSpeedLRRangeTest),
                                   ("onecycle", DeepSpeedOneCycle))},
}


def build_deepspeed_scheduler(section, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """A config ``scheduler`` section as DeepSpeed builds it: its warm-up schedules step as
    DeepSpeed's do (``_DeepSpeedStepping``), torch's as torch's."""
    return _build("scheduler", DEEPSPEED_SCHEDULERS, section.type, dict(section.params), optimizer)


def _checked_only(cls: type) -> type:
    """``cls`` whose ``add_param_group`` skips torch's ``_disable_dynamo`` wrapper, for a build
    that is only checked: the wrapper's first call imports torch._dynamo (about 1.3 s of CPU,
    torch.distributed.tensor with it) to guard a compile that a config check never runs. Where
    the method has no wrapper, ``inspect.unwrap`` returns it as it is."""
    return type(cls.__name__, (cls,), {"add_param_group": inspect.unwrap(cls.add_param_group)})


CHECKED_OPTIMIZERS = {name: _checked_only(cls) for name, cls in OPTIMIZERS.items()}


def check_sections(optimizer, scheduler) -> list[str]:
    """What building the config's ``optimizer`` / ``scheduler`` sections (either may be None)
    would refuse, found by building them on a stand-in parameter: no model needed."""
    problems: list[str] = []
    built = None
    stand_in = [torch.nn.Parameter(torch.zeros(1))]
    if optimizer is not None:
        try:
            type_name, kwargs = _deepspeed_adam_params(optimizer.type, optimizer.params)
            built = _build("optimizer", CHECKED_OPTIMIZERS, type_name, kwargs, stand_in)
        except ConfigError as error:
            problems += error.problems
    if scheduler is not None:
        # Without a usable optimizer section the script brings its own: stand in with one that
        # has what momentum-cycling schedules (CyclicLR, OneCycleLR) need.
        built = built or CHECKED_OPTIMIZERS["sgd"](stand_in, lr=0.1, momentum=0.9)
        try:
            build_scheduler(scheduler, built)
        except ConfigError as error:
            problems += error.problems
    return problems


OptimizerArg = torch.optim.Optimizer | Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None
