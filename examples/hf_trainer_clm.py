"""A causal language model trained with Hugging Face's Trainer, in the shape of transformers'
examples/pytorch/language-modeling/run_clm.py, trained by Microstep: the one line that differs from a
transformers script is the import of ``Trainer`` / ``TrainingArguments`` (marked below).

Everything is local: a tiny Mixtral (its router loss on) or Llama built from a config, a byte-level
tokenizer (examples/hf_local.py), the text files given (examples/data/corpus.txt by default) tokenized,
concatenated and cut into blocks. With the one line changed, each optimizer step trains the mean loss over
the whole global batch (per_device_train_batch_size x processes x gradient_accumulation_steps blocks), the
routers' load-balancing term counted over that whole batch, where transformers' Trainer adds each
micro-batch's term.

    python examples/hf_trainer_clm.py --output_dir /tmp/clm --max_steps 20 --do_train --do_eval
    python -m launch --nproc-per-node 2 examples/hf_trainer_clm.py --output_dir /tmp/clm --do_train
    python examples/hf_trainer_clm.py --output_dir /tmp/clm --do_train --resume_from_checkpoint /tmp/clm/checkpoint-10
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import datasets
import transformers
from transformers import HfArgumentParser, default_data_collator, set_seed
from transformers.trainer_utils import get_last_checkpoint

from engine.compat.transformers import Trainer, TrainingArguments  # the one changed line (was: from transformers)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_local import byte_tokenizer, tiny_model  # noqa: E402

logger = logging.getLogger(__name__)
CORPUS = str(Path(__file__).resolve().parent / "data" / "corpus.txt")


@dataclass
class ModelArguments:
    model_type: str = field(default="mixtral", metadata={"help": "llama or mixtral (built from a config, no hub)"})


@dataclass
class DataTrainingArguments:
    train_file: str = field(default=CORPUS, metadata={"help": "A text file, one document per line."})
    validation_file: str | None = field(default=None, metadata={"help": "A text file; default: a split of train."})
    validation_split_percentage: int = field(default=5)
    block_size: int = field(default=64, metadata={"help": "Tokens per training row."})
    max_train_samples: int | None = field(default=None)


def main(argv=None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    transformers.utils.logging.set_verbosity_warning()

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
    set_seed(training_args.seed)

    files = {"train": data_args.train_file, **({"validation": data_args.validation_file}
                                              if data_args.validation_file else {})}
    raw = datasets.load_dataset("text", data_files=files)
    if "validation" not in raw:
        held = raw["train"].train_test_split(test_size=data_args.validation_split_percentage / 100, shuffle=False)
        raw = datasets.DatasetDict({"train": held["train"], "validation": held["test"]})

    tokenizer = byte_tokenizer()
    model = tiny_model(model_args.model_type, len(tokenizer))

    def tokenize(examples):
        return tokenizer([line + tokenizer.eos_token for line in examples["text"]])

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(tokenize, batched=True, remove_columns=["text"])

    block = data_args.block_size

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = (len(joined["input_ids"]) // block) * block
        result = {k: [t[i:i + block] for i in range(0, total, block)] for k, t in joined.items()}
        result["labels"] = [list(ids) for ids in result["input_ids"]]
        return result

    with training_args.main_process_first(desc="grouping texts"):
        lm = tokenized.map(group_texts, batched=True)
    train_dataset, eval_dataset = lm["train"], lm["validation"]
    if data_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))

    trainer = Trainer(model=model, args=training_args,
                      train_dataset=train_dataset if training_args.do_train else None,
                      eval_dataset=eval_dataset if training_args.do_eval else None,
                      processing_class=tokenizer, data_collator=default_data_collator)

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = {**result.metrics, "train_samples": len(train_dataset)}
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 50 else float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
