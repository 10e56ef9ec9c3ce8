"""A Hugging Face script's three functions, as ``python -m engine verify`` takes them:

    python -m engine verify configs/verify_llama.yaml --nproc 2 \\
        --model examples.verify_llama:model --batch examples.verify_llama:batch \\
        --loss examples.verify_llama:loss_sum

``model()`` builds a tiny LlamaForCausalLM from a config (no download), seeded, so every
process builds the same one. ``batch(step)`` is a step's whole global batch: right-padded rows
of different lengths, padding labelled -100. ``loss_sum`` is what a script should return under
accumulation, ``(sum over real tokens, their count)``; ``loss_mean`` is the classic mistake (a
mean over each micro-batch's tokens), which verify reports as not equal, with the fix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQUENCE, GLOBAL_BATCH = 32, 8, 16  # GLOBAL_BATCH: the config's train_batch_size


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQUENCE,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def batch(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    input_ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQUENCE), generator=generator)
    lengths = torch.randint(2, SEQUENCE + 1, (GLOBAL_BATCH,), generator=generator)
    attention_mask = (torch.arange(SEQUENCE)[None, :] < lengths[:, None]).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _token_losses(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # position t predicts token t + 1
    return logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()


def loss_sum(model, batch):
    """Right under accumulation: the engine divides by the global batch's token count."""
    logits, labels = _token_losses(model, batch)
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"), (labels != -100).sum()


def loss_mean(model, batch):
    """The classic mistake: each micro-batch's own token mean, then averaged over micro-batches."""
    logits, labels = _token_losses(model, batch)
    return F.cross_entropy(logits, labels, ignore_index=-100)
