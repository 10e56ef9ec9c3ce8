"""Supervised fine-tuning with TRL's SFTTrainer, padding-free, in the shape of TRL's SFT script
(trl/scripts/sft.py), trained by Microstep: the one line that differs from a TRL script is the import of
``SFTConfig`` / ``SFTTrainer`` (marked below).

Everything is local: a tiny Mixtral (its router loss on) built from a config, a byte-level tokenizer
(examples/hf_local.py), the lines of a text file as documents (TRL's language-modeling format, a "text"
field). With ``--padding_free true --packing true`` (TRL packs documents into rows of ``--max_length``
tokens, best fit) each micro-batch is its documents end to end in one row. With the one line changed,
each optimizer step trains the mean loss over every token of the whole global batch and the routers'
load-balancing term over that whole batch, where TRL's SFTTrainer adds each micro-batch's term.

    python examples/trl_sft.py --output_dir /tmp/sft --padding_free true --packing true --max_length 256
    python -m launch --nproc-per-node 2 examples/trl_sft.py --output_dir /tmp/sft --padding_free true --packing true
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from transformers import HfArgumentParser

from engine.compat.trl import SFTConfig, SFTTrainer  # the one changed line (was: from trl import ...)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_local import byte_tokenizer, tiny_model  # noqa: E402

CORPUS = str(Path(__file__).resolve().parent / "data" / "corpus.txt")


@dataclass
class ScriptArguments:
    dataset_file: str = field(default=CORPUS, metadata={"help": "A text file, one document per line."})
    model_type: str = field(default="mixtral", metadata={"help": "llama or mixtral (built from a config)"})
    max_train_samples: int | None = field(default=None)


def main(argv=None):
    parser = HfArgumentParser((ScriptArguments, SFTConfig))
    script_args, training_args = parser.parse_args_into_dataclasses(argv)
    dataset = datasets.load_dataset("text", data_files={"train": script_args.dataset_file})["train"]
    if script_args.max_train_samples is not None:
        dataset = dataset.select(range(min(len(dataset), script_args.max_train_samples)))
    tokenizer = byte_tokenizer()
    model = tiny_model(script_args.model_type, len(tokenizer))

    trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)


if __name__ == "__main__":
    main()
