"""``TrainingArguments`` with transformers' signature and one more field, ``microstep``, and the engine
config they stand for.

What transformers' arguments become (:func:`engine_config`):

* ``per_device_train_batch_size`` → ``train_micro_batch_size_per_gpu``; ``gradient_accumulation_steps``
  as is (the global batch is their product with the data-parallel ranks, as in transformers);
* ``max_grad_norm`` → ``gradient_clipping``; ``bf16`` / ``fp16`` → their sections; ``seed`` as is;
  ``torch_compile`` (``torch_compile_mode``) → ``compile``;
* ``optim``, ``learning_rate``, ``weight_decay``, the Adam betas and epsilon, ``lr_scheduler_type`` and the
  warmup are not config keys here: the Trainer builds its optimizer and scheduler with transformers' own
  ``create_optimizer`` / ``create_scheduler`` and hands them to the engine;
* ``gradient_checkpointing`` stays the model's own (transformers enables it on the model, as it does);
* ``deepspeed=``: a DeepSpeed JSON (path or dict) read as Microstep's config, its ``"auto"`` values filled
  from these arguments as transformers fills them (:mod:`engine.compat.transformers.deepspeed_json`);
* ``microstep=``: a Microstep config (path or dict) merged over all of the above, for what
  ``TrainingArguments`` has no words for (ZeRO stage, experts, ``moe.load_balance``, ...).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import transformers

from engine.config.loaders import read_file
from engine.compat.transformers.deepspeed_json import filled_deepspeed_config


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' ``TrainingArguments``; ``microstep``: a Microstep config (a path or a dict) merged over
    what the other arguments map to. ``deepspeed`` is read by Microstep, not by DeepSpeed."""

    microstep: str | None = field(
        default=None,
        metadata={"help": "A Microstep config (a .yaml/.json path, or a dict) merged over the engine config the "
                          "other arguments map to: ZeRO stage, experts, moe.load_balance, ..."})

    def __post_init__(self):
        # transformers would start its own DeepSpeed integration here (DeepSpeed installed, its engine);
        # the door reads the JSON as Microstep's config instead.
        self.microstep_deepspeed, self.deepspeed = self.deepspeed, None
        super().__post_init__()


def engine_config(args: transformers.TrainingArguments, *, world_size: int, hidden_size: int | None,
                  max_steps: int) -> dict:
    """The engine config ``args`` stand for (see the module's docstring)."""
    config = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": float(args.max_grad_norm or 0.0),
        "seed": args.seed,
        "zero_optimization": {"stage": 0},
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
    if args.fp16:
        config["fp16"] = {"enabled": True}
    if args.torch_compile:
        config["compile"] = {"enabled": True, **({"mode": args.torch_compile_mode} if args.torch_compile_mode else {})}
    deepspeed = getattr(args, "microstep_deepspeed", None)
    if deepspeed is not None:
        config = merged(config, filled_deepspeed_config(deepspeed, args, world_size=world_size,
                                                        hidden_size=hidden_size, max_steps=max_steps))
    extra = getattr(args, "microstep", None)
    if extra is not None:
        config = merged(config, extra if isinstance(extra, dict) else read_file(extra).data)
    return config


def merged(base: dict, over: dict) -> dict:
    """``over`` merged into a copy of ``base``, section by section."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
