"""TRL's SFTTrainer and the door's on padding-free packed rows of a tiny float64 model, with their float64
full-batch reference (tests/integration/test_compat_trl.py). TRL is imported inside the functions."""

from __future__ import annotations

import copy

from tests.support import hf_trainer, moe_models, own_loss
from tests.support.reference import max_param_diff, reference_train, sgd, state

VOCAB = hf_trainer.VOCAB


def tokenizer():
    """A word-level tokenizer of ``t0`` .. ``t15`` (``t0`` pads, ``t1`` ends), built locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t0")


def dataset(count: int):
    """Tokenized documents of very different lengths (TRL keeps a dataset that has ``input_ids``)."""
    from datasets import Dataset

    return Dataset.from_list([{"input_ids": row["input_ids"]} for row in hf_trainer.rows(count)])


def packed(rows) -> dict:
    """TRL's padding-free collation: the rows end to end in one row, positions restarting per document."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(list(rows))


def reference(kind: str, data, global_batch: int, steps: int = 2) -> dict:
    """The model's own ``.loss`` on each whole global batch packed into one row (SGD, momentum); without the
    cache, with which transformers would let attention cross the documents."""
    net = hf_trainer.model(kind)
    batches = [{**packed(data.select(range(i, i + global_batch))), "use_cache": False}
               for i in range(0, global_batch * steps, global_batch)]
    with moe_models.float64_term(net) if kind == "moe" else hf_trainer._nothing():
        return state(reference_train(net, batches, own_loss.own_loss, sgd))


def train(trainer_cls, config_cls, kind: str, data, out: str, *, micro: int = 2, accumulation: int = 2,
          steps: int = 2, **extra):
    """A fresh ``hf_trainer.model(kind)`` trained padding-free by ``trainer_cls`` (TRL's or the door's)."""
    net = copy.deepcopy(hf_trainer.model(kind))
    settings = dict(padding_free=True, max_length=None, bf16=False)  # TRL's gradient_checkpointing=True kept
    args = hf_trainer.trainer_args(config_cls, out, micro=micro, accumulation=accumulation, steps=steps,
                                   **{**settings, **extra})
    trainer = trainer_cls(model=net, args=args, train_dataset=data, processing_class=tokenizer(),
                          optimizers=(sgd(net.parameters()), None))
    with moe_models.float64_term(net) if kind == "moe" else hf_trainer._nothing():
        trainer.train()
    return trainer


def against_reference(rank: int, world_size: int, kind: str, out: str, *, door: bool = True,
                      microstep: dict | None = None) -> float:
    """The door's padding-free run (or TRL's own, ``door=False``) against the full-batch reference."""
    import trl

    from engine.compat.trl import SFTConfig, SFTTrainer

    data = dataset(8 * world_size)
    extra = {"microstep": microstep} if microstep else {}
    classes = (SFTTrainer, SFTConfig) if door else (trl.SFTTrainer, trl.SFTConfig)
    trainer = train(*classes, kind, data, out, **extra)
    return max_param_diff(hf_trainer.trained_state(trainer), reference(kind, data, 2 * 2 * world_size))
