"""TRL's ``SFTTrainer`` and ``SFTConfig``, exact: change the import line.

    from engine.compat.trl import SFTConfig, SFTTrainer

The script then trains the whole global batch's SFT objective (every labelled token of every
micro-batch and rank, padding-free packed rows included, a mixture of experts' router term over the
global batch) with Microstep's engine through :class:`engine.compat.transformers.Trainer`; see
:mod:`engine.compat.trl.sft` and docs/huggingface.md.
"""

from engine.compat.trl.sft import SFTConfig, SFTTrainer

__all__ = ["SFTConfig", "SFTTrainer"]
