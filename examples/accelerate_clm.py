"""A causal language model trained with Hugging Face accelerate's loop, in the shape of transformers'
examples/pytorch/language-modeling/run_clm_no_trainer.py, trained by Microstep: the one line that
differs from an accelerate script is the import of ``Accelerator`` (marked below).

Everything is local: a tiny Llama built from a config (no hub), the lines of
examples/data/corpus.txt as byte-level rows of different lengths, padded per batch (label -100 on
the padding). With that one line changed, each optimizer step trains the mean loss over every real
token of its global batch (per_device_train_batch_size x processes x gradient_accumulation_steps
rows), where accelerate's own Accelerator averages the micro-batches' means.

    python -m launch --nproc-per-node 2 examples/accelerate_clm.py --output_dir /tmp/clm
    accelerate launch --cpu --num_processes 2 examples/accelerate_clm.py --output_dir /tmp/clm
    python examples/accelerate_clm.py --resume_from_checkpoint /tmp/clm/step_4 ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.tracking import GeneralTracker
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler

from engine.compat.accelerate import Accelerator  # the one changed line: was `from accelerate import Accelerator`

logger = get_logger(__name__)
CORPUS = Path(__file__).resolve().parent / "data" / "corpus.txt"


class JsonLinesTracker(GeneralTracker):
    """A tracker writing one JSON line per log call into ``logging_dir/metrics.jsonl`` (no extra package)."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str):
        super().__init__()
        self.path = Path(logging_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, values: dict):
        self.log({"config": values})

    def log(self, values: dict, step: int | None = None, **kwargs):
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **values}) + "\n")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Train a tiny causal language model with accelerate's loop")
    parser.add_argument("--train_file", default=str(CORPUS), help="a text file, one example per line")
    parser.add_argument("--max_lines", type=int, default=None, help="use the file's first lines only")
    parser.add_argument("--validation_split_percentage", type=int, default=10)
    parser.add_argument("--block_size", type=int, default=48, help="rows are cut to this many bytes")
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--per_device_eval_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--max_train_steps", type=int, default=None)
    parser.add_argument("--lr_scheduler_type", default="linear")
    parser.add_argument("--num_warmup_steps", type=int, default=0)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--float64", action="store_true", help="train in float64 (for comparisons)")
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--checkpointing_steps", default=None, help="an integer: save_state every that many steps")
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--with_tracking", action="store_true", help="log to OUTPUT_DIR/metrics.jsonl")
    return parser.parse_args(argv)


def model_config(vocab_size: int = 256) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       attn_implementation="eager")


def read_rows(path: str, block_size: int, max_lines: int | None) -> list[list[int]]:
    """Each line's bytes, cut to ``block_size``: rows of very different lengths."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()[:max_lines]
    return [list(line.encode("utf-8"))[:block_size] for line in lines if line.strip()]


def collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right padding to the batch's longest row; the padding is masked and labelled -100."""
    longest = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main(argv=None):
    args = parse_args(argv)
    accelerator_log_kwargs = {}
    if args.with_tracking:
        accelerator_log_kwargs["log_with"] = JsonLinesTracker("clm_no_trainer", args.output_dir)
        accelerator_log_kwargs["project_dir"] = args.output_dir
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, **accelerator_log_kwargs)
    logger.info(accelerator.state, main_process_only=False)
    set_seed(args.seed)

    with accelerator.main_process_first():
        rows = read_rows(args.train_file, args.block_size, args.max_lines)
    held_out = len(rows) * args.validation_split_percentage // 100
    train_rows, eval_rows = rows[held_out:], rows[:held_out]

    model = LlamaForCausalLM(model_config())
    if args.float64:
        model = model.double()

    train_dataloader = DataLoader(train_rows, shuffle=False, collate_fn=collate,
                                  batch_size=args.per_device_train_batch_size)
    eval_dataloader = DataLoader(eval_rows, collate_fn=collate, batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "norm.weight"]
    grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(grouped_parameters, lr=args.learning_rate)

    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    overrode_max_train_steps = args.max_train_steps is None
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    lr_scheduler = get_scheduler(
        name=args.lr_scheduler_type, optimizer=optimizer,
        num_warmup_steps=args.num_warmup_steps * accelerator.num_processes,
        num_training_steps=args.max_train_steps if overrode_max_train_steps
        else args.max_train_steps * accelerator.num_processes)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    # the data loader was sharded: the steps per epoch again
    num_update_steps_per_epoch = math.ceil(len(train_dataloader) / args.gradient_accumulation_steps)
    if overrode_max_train_steps:
        args.max_train_steps = args.num_train_epochs * num_update_steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / num_update_steps_per_epoch)
    checkpointing_steps = int(args.checkpointing_steps) if args.checkpointing_steps else None

    if args.with_tracking:
        accelerator.init_trackers("clm_no_trainer", {k: v for k, v in vars(args).items()
                                                     if isinstance(v, (int, float, str, bool))})

    total_batch_size = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    logger.info(f"  Num examples = {len(train_rows)}, total train batch size = {total_batch_size}, "
                f"optimization steps = {args.max_train_steps}")
    progress_bar = tqdm(range(args.max_train_steps), disable=not accelerator.is_local_main_process)
    completed_steps = starting_epoch = 0
    resume_step = None

    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        name = os.path.basename(os.path.normpath(args.resume_from_checkpoint))
        completed_steps = int(name.replace("step_", ""))
        starting_epoch = completed_steps // num_update_steps_per_epoch
        resume_step = (completed_steps % num_update_steps_per_epoch) * args.gradient_accumulation_steps
        progress_bar.update(completed_steps)

    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        total_loss = 0.0
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step is not None:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for batch in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(**batch)
                loss = outputs.loss
                total_loss += loss.detach().float()
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress_bar.update(1)
                completed_steps += 1
                if checkpointing_steps and completed_steps % checkpointing_steps == 0:
                    output_dir = f"step_{completed_steps}"
                    if args.output_dir is not None:
                        output_dir = os.path.join(args.output_dir, output_dir)
                    accelerator.save_state(output_dir)
            if completed_steps >= args.max_train_steps:
                break

        model.eval()
        losses = []
        for batch in eval_dataloader:
            with torch.no_grad():
                outputs = model(**batch)
            losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(args.per_device_eval_batch_size)))
        eval_loss = torch.mean(torch.cat(losses))
        perplexity = math.exp(eval_loss)
        accelerator.print(f"epoch {epoch}: perplexity: {perplexity:.4f} eval_loss: {eval_loss:.4f} "
                          f"steps: {completed_steps} lr: {lr_scheduler.get_last_lr()[0]:.6g}")
        if args.with_tracking:
            accelerator.log({"perplexity": perplexity, "eval_loss": float(eval_loss),
                             "train_loss": float(total_loss) / len(train_dataloader), "epoch": epoch,
                             "step": completed_steps}, step=completed_steps)

    if args.output_dir is not None:
        accelerator.wait_for_everyone()
        state_dict = accelerator.get_state_dict(model)  # whole weights whatever the ZeRO stage
        unwrapped_model = accelerator.unwrap_model(model)
        unwrapped_model.save_pretrained(args.output_dir, is_main_process=accelerator.is_main_process,
                                        save_function=accelerator.save, state_dict=state_dict)
        accelerator.print(f"saved {args.output_dir}")
    if args.with_tracking:
        accelerator.end_training()  # last: accelerate's also ends the process group


if __name__ == "__main__":
    main()
