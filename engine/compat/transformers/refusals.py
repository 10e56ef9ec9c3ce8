"""What the Trainer door cannot run exactly, refused before training starts, one line each."""

from __future__ import annotations

import transformers

from engine.errors import ConfigError

# training_step overrides that only wrap transformers' own in a context (TRL's activation offloading)
WRAPPING_TRAINING_STEPS = {"trl.trainer.sft_trainer"}


def check_supported(trainer) -> None:
    """Refuse the arguments and overrides the door does not honour, naming why."""
    args = trainer.args
    problems = []
    if args.auto_find_batch_size:
        problems.append("auto_find_batch_size: transformers halves the global batch on running out of memory; the "
                        "door keeps the global batch: set per_device_train_batch_size (and "
                        "gradient_accumulation_steps) instead")
    if args.label_smoothing_factor:
        problems.append("label_smoothing_factor: the smoothed loss is not the model's own .loss, which the engine "
                        "reads as (sum, count); smooth in the model's loss or drop it")
    if trainer.compute_loss_func is not None:
        problems.append("compute_loss_func: its loss is scaled by transformers' num_items_in_batch, which the door "
                        "does not hand in; override compute_loss to return the model's own .loss or a (sum, count) "
                        "pair")
    if trainer.is_deepspeed_enabled:
        problems.append("deepspeed: transformers' own TrainingArguments started DeepSpeed; import TrainingArguments "
                        "from engine.compat.transformers, which reads the JSON as Microstep's config")
    if trainer.is_fsdp_enabled:
        problems.append("fsdp: transformers' FSDP would hold the model besides the engine; drop fsdp and set "
                        "microstep={'zero_optimization': {'stage': 3}}")
    if args.n_gpu > 1:
        problems.append("n_gpu > 1 (torch.nn.DataParallel): launch one process per device (torchrun, python -m launch)")
    if getattr(args, "activation_offloading", False):
        problems.append("activation_offloading: TRL offloads inside its training_step, which the door does not call "
                        "(the engine runs each window); use gradient_checkpointing to save activation memory")
    owner = _training_step_owner(type(trainer))
    if owner is not None:
        problems.append(f"training_step is overridden by {owner.__qualname__}: the engine runs each window's "
                        "backward and step itself; move the per-micro-batch code into compute_loss")
    if problems:
        raise ConfigError(problems)


def check_config(config: dict) -> None:
    """What the engine config may not ask of the door: micro-batches are the data loader's, one batch per
    process (a mesh whose ranks share a batch, tensor / context / pipeline, would be handed different ones;
    an automatic micro size or a token budget would have the engine form them)."""
    problems = []
    sizes = {"tensor_parallel": config.get("tensor_parallel", {}).get("size", 1),
             "context_parallel": config.get("context_parallel", {}).get("size", 1),
             "pipeline": config.get("pipeline", {}).get("stages", 1)}
    shared = [f"{key}: {size}" for key, size in sizes.items() if size not in (1, None)]
    if shared:
        problems.append(f"{', '.join(shared)}: the Trainer's data loader gives every process its own batch, while "
                        "these ranks must share one; train such a mesh with engine.initialize and eng.batches()")
    micro = config.get("train_micro_batch_size_per_gpu")
    if micro in ("auto", "explore"):
        problems.append(f"train_micro_batch_size_per_gpu: {micro!r}: the Trainer's data loader forms the "
                        "micro-batches (per_device_train_batch_size); give a number")
    if config.get("micro_batch_tokens") is not None:
        problems.append("micro_batch_tokens: the Trainer's data loader forms the micro-batches "
                        "(per_device_train_batch_size); remove micro_batch_tokens")
    if problems:
        raise ConfigError(problems)


def _training_step_owner(cls):
    """The class below transformers' Trainer that overrides ``training_step`` itself, if any."""
    for klass in cls.__mro__:
        if klass is transformers.Trainer:
            return None
        if "training_step" in vars(klass) and klass.__module__ not in WRAPPING_TRAINING_STEPS:
            return klass
    return None
