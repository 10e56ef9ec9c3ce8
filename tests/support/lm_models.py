"""A tiny causal language model and its padded batches, shared by the token-budget tests
(tests/unit/test_token_budget.py, tests/distributed/test_token_engine.py) and the tests that
train it under tensor parallelism or the checkpointing tuner: right-padded rows, labels -100 on
padding, next-token losses as a (sum, count) pair and as the full-batch token mean."""

import torch
import torch.nn.functional as F

def padded_batch(lengths, width=None, side="right", seed=0):
    """input_ids / attention_mask / labels padded to ``width``, labels -100 on padding."""
    width = width or max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 11, (len(lengths), width), generator=generator)
    columns = torch.arange(width)
    lengths_t = torch.tensor(lengths)[:, None]
    real = columns < lengths_t if side == "right" else columns >= width - lengths_t
    ids = ids.where(real, torch.zeros_like(ids))
    return {"input_ids": ids, "attention_mask": real.long(), "labels": ids.where(real, torch.full_like(ids, -100))}


class TinyCausalLM(torch.nn.Module):
    """Token and absolute position embeddings, a causal running mean, an output head: every
    position sees only earlier ones, so right padding never reaches real tokens."""

    def __init__(self, vocab=11, width=6, positions=16):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(positions, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask):  # causal: the mask changes nothing
        h = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1]))
        h = h.cumsum(1) / torch.arange(1, input_ids.shape[1] + 1, dtype=h.dtype)[:, None]
        return self.head(torch.tanh(h))


def loss_sum_and_count(model, batch):
    """Next-token cross-entropy summed over tokens whose label is not -100, and their count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    logits = getattr(logits, "logits", logits)[:, :-1]
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


STEPS = [[14, 3, 2, 5, 1, 3, 2, 9], [2, 2, 15, 1, 4, 3, 11, 6]]  # most short, a few long


def lm_batches(steps=STEPS, width=16):
    return [padded_batch(lengths, width, seed=i) for i, lengths in enumerate(steps)]


def token_mean(model, batch):
    """The full-batch reference loss: the mean over every real next-token label."""
    loss_sum, count = loss_sum_and_count(model, batch)
    return loss_sum / count
