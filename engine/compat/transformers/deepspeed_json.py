"""A Hugging Face DeepSpeed JSON (``TrainingArguments(deepspeed=...)``) as Microstep's config: its
``"auto"`` values filled from the training arguments as transformers fills them, the rest read by the
engine's DeepSpeed config reader."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from engine.errors import ConfigError

AUTO = "auto"


def filled_deepspeed_config(source, args, *, world_size: int, hidden_size: int | None, max_steps: int) -> dict:
    """``source`` (a path or a dict) with every ``"auto"`` replaced by what ``args`` say."""
    config = copy.deepcopy(source) if isinstance(source, dict) else json.loads(Path(source).read_text())
    micro, steps = args.per_device_train_batch_size, args.gradient_accumulation_steps
    top = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": steps,
        "train_batch_size": micro * steps * world_size,
        "gradient_clipping": args.max_grad_norm,
    }
    for key, value in top.items():
        _fill(config, key, value)
    _fill(config.get("fp16", {}), "enabled", bool(args.fp16))
    _fill(config.get("bf16", {}), "enabled", bool(args.bf16))
    optimizer = config.get("optimizer", {}).get("params", {})
    for key, value in {"lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2],
                       "eps": args.adam_epsilon, "weight_decay": args.weight_decay}.items():
        _fill(optimizer, key, value)
    _fill_scheduler(config.get("scheduler", {}).get("params", {}), args, max_steps)
    if hidden_size is not None:  # the bucket sizes transformers derives from the model's width
        zero = config.get("zero_optimization", {})
        for key, value in {"reduce_bucket_size": hidden_size * hidden_size,
                           "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                           "stage3_param_persistence_threshold": 10 * hidden_size}.items():
            _fill(zero, key, value)
    left = sorted(_auto_keys(config))
    if left:
        raise ConfigError(f"deepspeed=: {', '.join(left)} is \"auto\" and the training arguments do not say "
                          "what it is; give it a value in the JSON")
    return config


def _fill_scheduler(params: dict, args, max_steps: int) -> None:
    """WarmupLR / WarmupDecayLR / WarmupCosineLR's ``"auto"``: the learning rate, the warmup and the
    training's optimizer steps."""
    _fill(params, "warmup_min_lr", 0)
    _fill(params, "warmup_max_lr", args.learning_rate)
    _fill(params, "warmup_num_steps", args.get_warmup_steps(max_steps))
    _fill(params, "total_num_steps", max_steps)


def _fill(section: dict, key: str, value) -> None:
    if section.get(key) == AUTO:
        section[key] = value


def _auto_keys(config, prefix: str = ""):
    for key, value in config.items():
        if isinstance(value, dict):
            yield from _auto_keys(value, f"{prefix}{key}.")
        elif value == AUTO:
            yield f"{prefix}{key}"
