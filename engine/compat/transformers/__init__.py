"""Hugging Face transformers' ``Trainer`` and ``TrainingArguments``, exact: change the import line.

    from engine.compat.transformers import Trainer, TrainingArguments

A script written for transformers then trains the whole global batch's objective (the model's own
loss over every micro-batch and rank, a mixture of experts' load-balancing term included) with
Microstep's engine; see :mod:`engine.compat.transformers.trainer` and docs/huggingface.md.
"""

from engine.compat.transformers.arguments import TrainingArguments
from engine.compat.transformers.trainer import Trainer

__all__ = ["Trainer", "TrainingArguments"]
