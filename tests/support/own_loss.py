"""Hugging Face models trained with their own loss (``m(**batch).loss``), one per loss type the
engine reads, on rows whose real items differ a lot; the float64 full-batch reference is the plain
model's ``.loss`` on the whole global batch (the mean over its items). Shared by
tests/unit/test_model_loss.py and tests/distributed/test_model_loss.py."""

from __future__ import annotations

import copy

import torch

from engine.batching.microbatch import split_batch
from engine.window.model_loss import NoModelLoss
from tests.support.reference import max_param_diff, rank_slice, reference_train, sgd, state

VOCAB, WIDTH = 16, 12
LENGTHS = [12, 2, 9, 1, 12, 5, 3, 10]  # real tokens per row: micro-batches of very different counts
# transformers takes the cross-entropy in float32 (logits.float()); the engine's loss is scaled by
# W / G and G / U where the reference divides by U at once: the roundings differ below 1e-8. The
# per-micro-batch mean (the broken variant) misses by 1e-3 and more.
TOL = 1e-7
MISSED = 1e-4


def _bert_config(**extra):
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=32, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, **extra)


TARGET = 7  # an encoder-decoder's label columns: another length than its inputs'
TARGET_LENGTHS = [7, 1, 4, 2, 6, 3, 1, 5]


def _seq2seq(kind: str) -> torch.nn.Module:
    import transformers

    if kind == "t5":
        cfg = transformers.T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_decoder_layers=1,
                                    num_heads=2, dropout_rate=0.0, pad_token_id=0, decoder_start_token_id=0)
        return transformers.T5ForConditionalGeneration(cfg).double()
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                  decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                  decoder_start_token_id=2)
    return transformers.BartForConditionalGeneration(cfg).double()


def model(kind: str) -> torch.nn.Module:
    """A small float64 model of ``kind``: causal (Llama), masked (BERT), tokens (token
    classification), rows (sequence classification), regression, t5 / bart (encoder-decoders)."""
    import transformers

    torch.manual_seed(0)
    if kind in ("t5", "bart"):
        return _seq2seq(kind)
    if kind in ("causal", "causal_tokens"):  # a causal language model; a token classifier on the same body
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                       num_labels=3, classifier_dropout=0.0)
        cls = transformers.LlamaForCausalLM if kind == "causal" else transformers.LlamaForTokenClassification
        return cls._from_config(cfg, attn_implementation="sdpa", dtype=torch.float64)
    classes = {"masked": (transformers.BertForMaskedLM, {}),
               "tokens": (transformers.BertForTokenClassification, {"num_labels": 3}),
               "rows": (transformers.BertForSequenceClassification, {"num_labels": 3}),
               "regression": (transformers.BertForSequenceClassification, {"num_labels": 1})}
    cls, extra = classes[kind]
    return cls(_bert_config(**extra)).double()


def batches(kind: str, steps: int, lengths=LENGTHS, seed: int = 5) -> list[dict]:
    """Right-padded rows of the given real lengths, with the labels ``kind``'s users give."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        rows = len(lengths)
        ids = torch.randint(1, VOCAB, (rows, WIDTH), generator=g)
        mask = (torch.arange(WIDTH)[None, :] < torch.tensor(lengths)[:, None]).long()
        ids = ids * mask
        batch = {"input_ids": ids, "attention_mask": mask}
        if kind == "causal":
            batch["labels"] = ids.masked_fill(mask == 0, -100)
        elif kind == "masked":  # about half the real tokens are predicted
            chosen = (torch.rand(rows, WIDTH, generator=g) < 0.5) & (mask == 1)
            batch["labels"] = ids.masked_fill(~chosen, -100)
        elif kind in ("tokens", "causal_tokens"):
            batch["labels"] = torch.randint(0, 3, (rows, WIDTH), generator=g).masked_fill(mask == 0, -100)
        elif kind in ("t5", "bart"):  # targets of their own lengths, padded -100
            targets = torch.randint(3, VOCAB, (rows, TARGET), generator=g)
            real = torch.arange(TARGET)[None, :] < torch.tensor(TARGET_LENGTHS)[:, None]
            batch["labels"] = targets.masked_fill(~real, -100)
        elif kind == "rows":  # rows without a label (-100) count for nothing
            batch["labels"] = torch.randint(0, 3, (rows,), generator=g).masked_fill(torch.tensor(lengths) < 4, -100)
        else:
            batch["labels"] = torch.randn(rows, generator=g, dtype=torch.float64)
        out.append(batch)
    return out


def own_loss(model, batch):
    """The line every Hugging Face script writes."""
    return model(**batch).loss


def unread(eng):
    """The broken variant: the model's own loss taken as a mean over the micro-batch's rows (what
    every engine without the reading does)."""
    eng.losses.model = NoModelLoss()
    return eng


def unread_on_pipeline(eng):
    """The broken variant under a pipeline: the last stage's own loss taken as a mean over rows."""
    eng.executor.stages.model_loss.observe = lambda kwargs, output: None
    return eng


def train(eng, data, *, manual: bool) -> list[float]:
    """``eng`` on this rank's share of each global batch of ``data``, by ``train_batch`` or by the
    manual loop (``eng(**micro_batch).loss``); the windows' losses."""
    losses = []
    for batch in data:
        mine = rank_slice(batch, eng.plan)
        if manual:
            for micro_batch in split_batch(mine, eng.plan.micro_batch_sizes):
                eng.backward(eng(**micro_batch).loss)
                eng.step()
            losses.append(float(eng.last_window.loss))
        else:
            losses.append(eng.train_batch(mine, own_loss))
    return losses


def compare(eng, kind: str, data, *, manual: bool, reference=None) -> dict:
    """Train ``eng`` (built on a copy of ``model(kind)``) and compare with the full-batch reference."""
    reference = reference or reference_train(model(kind), data, own_loss, sgd)
    losses = train(eng, data, manual=manual)
    with torch.no_grad():
        first = own_loss(model(kind), data[0]).item()
    return {"diff": max_param_diff(eng.full_state_dict(), state(reference)), "loss0": losses[0],
            "expected_loss0": first}


def fresh(kind: str) -> torch.nn.Module:
    return copy.deepcopy(model(kind))
