"""The model's own loss (``m(**batch).loss``) read as (sum, count) by its labels, one process,
against the float64 full-batch reference; the per-micro-batch mean (what the loss is without the
reading) is the broken variant that misses."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import engine
from engine.window.model_loss import (
    NOT_READ, READ_TYPES, ModelLoss, NoModelLoss, Reading, _causal_targets, _labelled, loss_computation, model_loss,
)
from tests.support import own_loss as o
from tests.support.moe_models import float64_term, hf_loss, hf_moe, lm_batches
from tests.support.reference import max_param_diff, reference_train, sgd, state

pytest.importorskip("transformers")

CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}  # accumulation 4


def initialize(model, **extra):
    return engine.initialize(model, {**CONFIG, **extra}, optimizer=sgd)


@pytest.mark.parametrize("manual", [False, True], ids=["train_batch", "manual"])
@pytest.mark.parametrize("kind", ["causal", "masked", "tokens", "rows", "regression", "t5", "bart"])
def test_each_loss_type_equals_the_full_batch(kind, manual):
    data = o.batches(kind, 3)
    reference = reference_train(o.model(kind), data, o.own_loss, sgd)
    result = o.compare(initialize(o.model(kind)), kind, data, manual=manual, reference=reference)
    assert result["diff"] < o.TOL
    assert result["loss0"] == pytest.approx(result["expected_loss0"], rel=1e-6)  # the full batch's mean
    if kind != "regression":  # every row holds one item there: rows and items weigh alike
        broken = o.compare(o.unread(initialize(o.model(kind))), kind, data, manual=manual, reference=reference)
        assert broken["diff"] > o.MISSED


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_an_encoder_decoder_is_not_read_as_shifted_targets(kind):
    """T5 and BART average their own cross entropy over every label that is not -100 (their decoder
    reads the labels shifted right): counting the shifted targets, as a causal model's, misses."""
    data = o.batches(kind, 2)
    reference = reference_train(o.model(kind), data, o.own_loss, sgd)
    eng = initialize(o.model(kind))
    assert eng.losses.model.reading.items is _labelled
    eng.losses.model = ModelLoss(eng.module, Reading(_causal_targets, lambda config: True), takes_cache=False)
    assert o.compare(eng, kind, data, manual=False, reference=reference)["diff"] > o.MISSED


def test_every_loss_type_of_transformers_is_sorted_into_read_or_not():
    from transformers.loss.loss_utils import LOSS_MAPPING

    assert set(LOSS_MAPPING) == READ_TYPES | set(NOT_READ)
    assert not READ_TYPES & set(NOT_READ)


def test_a_model_whose_loss_the_engine_cannot_place_is_not_read():
    """How the forward computes its loss decides: transformers' function, a loss module of its own, or
    neither (not read: warned, refused under strict)."""
    import transformers

    assert loss_computation(transformers.LlamaForCausalLM) == "function"
    assert loss_computation(transformers.T5ForConditionalGeneration) == "own"

    class Squared(transformers.LlamaForCausalLM):  # a causal model computing its loss some other way
        def forward(self, input_ids=None, labels=None, **kwargs):
            output = super().forward(input_ids=input_ids, **kwargs)
            output.loss = (output.logits.sum(-1) ** 2).mean()
            return output

    assert loss_computation(Squared) == "unknown"
    assert isinstance(model_loss(Squared(o.model("causal").config)), NoModelLoss)
    qa = transformers.BertForQuestionAnswering(o._bert_config())
    assert isinstance(model_loss(qa), NoModelLoss) and qa.loss_type in NOT_READ


def test_which_models_are_read():
    assert model_loss(o.model("causal")).loss_type == "ForCausalLM"
    assert model_loss(o.model("rows")).loss_type == "ForSequenceClassification"
    assert isinstance(model_loss(torch.nn.Linear(2, 2)), NoModelLoss)
    replaced = o.model("causal")
    replaced.loss_function = lambda *args, **kwargs: torch.zeros(())  # the user's own: not read
    assert isinstance(model_loss(replaced), NoModelLoss)


def test_evaluation_is_the_full_batch_mean():
    data = o.batches("causal", 1)
    eng = initialize(o.model("causal"))
    with torch.no_grad():
        expected = o.own_loss(o.model("causal"), data[0]).item()
    assert eng.eval_batch(data[0], o.own_loss) == pytest.approx(expected, rel=1e-7)


def test_num_items_in_batch_is_read_as_the_divisor_it_is():
    """A batch that gives transformers' ``num_items_in_batch`` makes ``.loss`` sum / num_items: still exact."""
    data = o.batches("causal", 2)
    reference = reference_train(o.model("causal"), data, o.own_loss, sgd)
    given = [{**batch, "num_items_in_batch": torch.tensor(7)} for batch in data]
    eng = initialize(o.model("causal"))
    for batch in given:
        eng.train_batch(batch, o.own_loss)
    assert max_param_diff(eng.full_state_dict(), state(reference)) < o.TOL


def test_a_mixture_of_experts_own_loss_with_padding_includes_its_global_term():
    """Mixtral's ``.loss`` (mean over real tokens + λ·aux) on padded rows: read as a sum, the term is
    divided back by the micro-batch's count, so the window holds λ times the global batch's term once."""
    model, batches = hf_moe(), lm_batches(2, 8, padded=True)
    with float64_term(model):
        expected = state(reference_train(model, batches, hf_loss, sgd))
        eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 8, "gradient_accumulation_steps": 4},
                                optimizer=sgd)
        for batch in batches:
            eng.train_batch(batch, hf_loss)
    assert max_param_diff(eng.full_state_dict(), expected) < o.TOL


def test_a_mean_the_engine_cannot_read_is_warned_once_and_refused_under_strict(caplog):
    data = o.batches("causal", 2)

    def derived(model, batch):  # a tensor computed from .loss: not the model's own any more
        return model(**batch).loss * 1.0

    eng = initialize(o.model("causal"))
    with caplog.at_level(logging.WARNING, logger="engine"):
        for batch in data:
            eng.train_batch(batch, derived)
    warnings = [r.getMessage() for r in caplog.records if "cannot read as (sum, count)" in r.getMessage()]
    assert len(warnings) == 1 and "different numbers of items per row" in warnings[0] and "m(**batch).loss" in warnings[0]
    strict = initialize(o.model("causal"), strict=True)
    with pytest.raises(engine.EngineUsageError, match="strict: the loss is a scalar"):
        strict.train_batch(data[0], derived)
    assert strict.global_steps == 0 and strict.micro_steps == 0
    strict.train_batch(data[0], o.own_loss)  # the model's own loss is read: nothing to refuse
    assert strict.global_steps == 1


def packed_rows(steps: int, documents=(5, 3, 4, 2, 6, 4, 3, 5, 2, 6, 1, 7), width: int = 12, rows: int = 4, seed=9):
    """Documents end to end in rows of ``width`` tokens, ``position_ids`` restarting at each, no attention
    mask, the first token of each document labelled -100 (Hugging Face's DataCollatorWithFlattening)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids, positions, labels = [], [], []
        docs = list(documents)
        for _ in range(rows):
            row_ids, row_pos, row_labels = [], [], []
            while docs and len(row_ids) + docs[0] <= width:
                n = docs.pop(0)
                tokens = torch.randint(1, o.VOCAB, (n,), generator=g).tolist()
                row_ids += tokens
                row_pos += list(range(n))
                row_labels += [-100] + tokens[1:]
            fill = width - len(row_ids)  # the rest of the row: a document of its own, unlabelled
            row_ids += [0] * fill
            row_pos += list(range(fill))
            row_labels += [-100] * fill
            ids.append(row_ids), positions.append(row_pos), labels.append(row_labels)
        out.append({"input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions),
                    "labels": torch.tensor(labels)})
    return out


def test_packed_rows_keep_their_documents_apart_without_the_cache():
    """Rows of packed documents trained with the model's own loss equal the full batch, where the model
    masks per document (which transformers does only without its key/value cache)."""
    data = packed_rows(2)

    def reference_loss(model, batch):
        return model(**batch, use_cache=False).loss

    reference = reference_train(o.model("causal"), data, reference_loss, sgd)
    eng = engine.initialize(o.model("causal"), {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2},
                            optimizer=sgd)
    for batch in data:
        eng.train_batch(batch, o.own_loss)
    assert max_param_diff(eng.full_state_dict(), state(reference)) < o.TOL
    crossing = reference_train(o.model("causal"), data, o.own_loss, sgd)  # the cache on: attention crosses
    assert max_param_diff(state(crossing), state(reference)) > o.MISSED


def test_a_plain_loss_backward_is_refused_at_step_and_leaves_nothing_behind():
    """``loss.backward()`` on the engine's output (DeepSpeed 0.18 accepts it) runs outside the engine's
    weighting: refused at the step with the reason, its gradients discarded, and training goes on exact."""
    data = o.batches("causal", 2)
    reference = reference_train(o.model("causal"), data, o.own_loss, sgd)
    eng = initialize(o.model("causal"))
    eng(**{k: v[:2] for k, v in data[0].items()}).loss.backward()
    with pytest.raises(engine.EngineUsageError, match=r"A plain loss.backward\(\) is not one: .* discarded"):
        eng.step()
    assert eng.micro_steps == 0 and all(p.grad is None or not p.grad.any() for p in eng.module.parameters())
    for batch in data:
        eng.train_batch(batch, o.own_loss)
    assert max_param_diff(eng.full_state_dict(), state(reference)) < o.TOL
