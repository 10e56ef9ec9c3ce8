"""Supervised fine-tuning of a Hugging Face causal LM, written as DeepSpeed's own SFT scripts are
(DeepSpeed-Chat's step 1): trained by Microstep with only the import lines changed.

    python -m launch --nproc-per-node 2 examples/deepspeed_sft.py --model_name_or_path MODEL_DIR \\
        --zero_stage 3 --output_dir runs/sft

Below the imports everything is DeepSpeed's API as such scripts use it: ``--local_rank`` read
from the command line (``add_config_arguments`` fills it in from the launcher's environment),
``init_distributed``, an ``HfDeepSpeedConfig`` kept alive at ZeRO 3 while the model is loaded,
``FusedAdam`` on weight-decay groups, a transformers scheduler, ``initialize`` with the config as
a dict, ``outputs = model(**batch, use_cache=False); model.backward(outputs.loss); model.step()``
per micro-batch, ``tput_timer`` at each epoch's end, and the model saved in Hugging Face's format
by the usual ZeRO-3 pattern (each parameter gathered alone, ``ds_id`` / ``ds_status`` tested).

The rows are synthetic token sequences of different lengths, padded on the right; the padding's
labels are -100, so micro-batches hold different numbers of tokens: DeepSpeed's mean of
micro-batch means is not the global batch's token mean, Microstep's step is.
``tests/integration/test_compat_deepspeed_sft.py`` runs it at ZeRO 0 and 3 with DeepSpeed absent,
against the float64 full batch, and the same file with DeepSpeed's imports as the control.
"""

from __future__ import annotations

import argparse
import math
import os
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
from transformers import AutoModelForCausalLM, default_data_collator, get_scheduler

import engine.compat.deepspeed as deepspeed  # was: import deepspeed
from engine.compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam  # was: from deepspeed.ops.adam import ...
from engine.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # was: from deepspeed.runtime...
from engine.compat.deepspeed.accelerator import get_accelerator  # was: from deepspeed.accelerator import ...
from engine.compat.deepspeed.hf import HfDeepSpeedConfig  # was: from transformers.integrations.deepspeed import ...

PAD_ID = 0
NO_DECAY = ("bias", "norm.weight")  # names of parameters trained without weight decay
WEIGHTS_NAME = "pytorch_model.bin"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Supervised fine-tuning of a causal LM")
    parser.add_argument("--model_name_or_path", required=True, help="a Hugging Face model directory")
    parser.add_argument("--num_samples", type=int, default=32, help="synthetic training rows")
    parser.add_argument("--max_seq_len", type=int, default=8)
    parser.add_argument("--data_seed", type=int, default=3)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--num_train_epochs", type=int, default=2)
    parser.add_argument("--lr_scheduler_type", default="cosine")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--offload", action="store_true", help="ZeRO-Offload: optimizer (and parameters) on the host")
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed by the launcher")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def train_ds_config(args, world_size: int) -> dict:
    device = "cpu" if args.offload else "none"
    return {
        "train_batch_size": args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps,
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "steps_per_print": 10,
        "zero_optimization": {"stage": args.zero_stage, "offload_param": {"device": device},
                              "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }


def set_random_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)


def synthetic_rows(num_samples: int, max_seq_len: int, vocab_size: int, seed: int) -> list[dict]:
    """Token rows of 2 to ``max_seq_len`` tokens, right-padded; the padding is masked and its labels are -100."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_samples):
        length = int(torch.randint(2, max_seq_len + 1, (1,), generator=g))
        tokens = torch.full((max_seq_len,), PAD_ID, dtype=torch.long)
        tokens[:length] = torch.randint(1, vocab_size, (length,), generator=g)
        mask = (torch.arange(max_seq_len) < length).long()
        rows.append({"input_ids": tokens, "attention_mask": mask, "labels": tokens.masked_fill(mask == 0, -100)})
    return rows


def optimizer_grouped_parameters(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and not any(k in n for k in NO_DECAY)]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and any(k in n for k in NO_DECAY)]
    return [group for group in ({"params": decay, "weight_decay": weight_decay},
                                {"params": no_decay, "weight_decay": 0.0}) if group["params"]]


def to_device(batch: dict, device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def is_sharded(param) -> bool:
    """ZeRO 3's mark of a parameter this rank holds a shard of (not gathered right now)."""
    return hasattr(param, "ds_id") and param.ds_status == ZeroParamStatus.NOT_AVAILABLE


def save_hf_format(model, args) -> None:
    """The model's config and its state dict as ``from_pretrained`` reads them (rank 0; whole below ZeRO 3)."""
    model_to_save = model.module if hasattr(model, "module") else model
    os.makedirs(args.output_dir, exist_ok=True)
    torch.save(model_to_save.state_dict(), os.path.join(args.output_dir, WEIGHTS_NAME))
    model_to_save.config.to_json_file(os.path.join(args.output_dir, "config.json"))


def save_zero_three_model(model, global_rank: int, save_dir: str) -> None:
    """Every rank gathers each parameter in turn; rank 0 keeps its whole value and writes the file."""
    model_to_save = model.module if hasattr(model, "module") else model
    state = {}
    for name, param in model_to_save.named_parameters():
        if hasattr(param, "ds_id"):
            with deepspeed.zero.GatheredParameters([param] if is_sharded(param) else []):
                value = param.data.cpu()
        else:
            value = param.cpu()
        if global_rank == 0:
            state[name] = value
    if global_rank == 0:
        torch.save(state, os.path.join(save_dir, WEIGHTS_NAME))


def evaluate(model, loader, device) -> float:
    model.eval()
    losses = []
    for batch in loader:
        with torch.no_grad():
            losses.append(float(model(**to_device(batch, device)).loss))
    model.train()
    return sum(losses) / len(losses)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.local_rank == -1:
        device = torch.device(get_accelerator().device_name())
    else:
        get_accelerator().set_device(args.local_rank)
        device = torch.device(get_accelerator().device_name(), args.local_rank)
        deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()

    ds_config = train_ds_config(args, torch.distributed.get_world_size())
    set_random_seed(args.seed)
    torch.distributed.barrier()

    dschf = HfDeepSpeedConfig(ds_config) if args.zero_stage == 3 else None  # kept alive while the model loads
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
    del dschf

    rows = synthetic_rows(args.num_samples, args.max_seq_len, model.config.vocab_size, args.data_seed)
    train_loader = DataLoader(rows, collate_fn=default_data_collator, batch_size=args.per_device_train_batch_size,
                              sampler=RandomSampler(rows) if args.local_rank == -1 else DistributedSampler(rows))
    eval_loader = DataLoader(rows[:4], collate_fn=default_data_collator, batch_size=args.per_device_train_batch_size)

    optimizer_class = DeepSpeedCPUAdam if args.offload else FusedAdam
    optimizer = optimizer_class(optimizer_grouped_parameters(model, args.weight_decay), lr=args.learning_rate,
                                betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    lr_scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                 num_warmup_steps=args.num_warmup_steps,
                                 num_training_steps=args.num_train_epochs * steps_per_epoch)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, lr_scheduler=lr_scheduler,
                                                             dist_init_required=True)

    for epoch in range(args.num_train_epochs):
        model.train()
        for step, batch in enumerate(train_loader):
            batch = to_device(batch, device)
            outputs = model(**batch, use_cache=False)
            model.backward(outputs.loss)
            model.step()
        eval_loss = evaluate(model, eval_loader, device)
        if args.global_rank == 0:
            print(f"epoch {epoch + 1}/{args.num_train_epochs}: eval loss {eval_loss:.6f}", flush=True)
        model.tput_timer.update_epoch_count()

    if args.output_dir is not None:
        if args.global_rank == 0:
            save_hf_format(model, args)
        if args.zero_stage == 3:  # each rank holds a shard of every parameter: gather them one by one
            save_zero_three_model(model, args.global_rank, args.output_dir)
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
