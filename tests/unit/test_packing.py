"""``packing: true``: each token-budget micro-batch's documents end to end in one row, with
``position_ids`` restarting per document, no attention mask and labels -100 at the seams. One
process, a float64 Llama trained with its own loss, against the plain model's ``.loss`` on the
whole padded global batch; broken packings (targets across seams, positions not restarting) miss."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.batching import packing
from engine.batching.token_budget import TokenBudgetError, sequence_layout
from engine.cli import main as cli_main
from engine.config.checks import check_without_model
from engine.config.schema import load_config
from tests.support import own_loss as o
from tests.support.reference import max_param_diff, reference_train, sgd, state

pytest.importorskip("transformers")

LENGTHS = [12, 2, 9, 1, 12, 5, 3, 10]  # 54 real tokens in 8 rows of 12 columns
BUDGET = 16  # packed: 4 micro-batches (accumulation 4), each one row of at most 16 tokens
CONFIG = {"train_batch_size": 8, "micro_batch_tokens": BUDGET, "packing": True}


def initialize(**extra):
    return engine.initialize(o.model("causal"), {**CONFIG, **extra}, optimizer=sgd)


def train(eng, data):
    return [eng.train_batch(batch, o.own_loss) for batch in data]


@pytest.fixture(scope="module")
def data():
    return o.batches("causal", 3, lengths=LENGTHS)


@pytest.fixture(scope="module")
def reference(data):
    return state(reference_train(o.model("causal"), data, o.own_loss, sgd))


def test_packing_equals_the_padded_full_batch(data, reference):
    eng = initialize()
    losses = train(eng, data)
    assert eng.window_split.micro_steps == 4  # accumulation > 1
    assert max_param_diff(eng.full_state_dict(), reference) < o.TOL
    with torch.no_grad():
        first = o.own_loss(o.model("causal"), data[0]).item()
    assert losses[0] == pytest.approx(first, rel=1e-7)  # the full batch's mean over its targets
    assert initialize().eval_batch(data[0], o.own_loss) == pytest.approx(first, rel=1e-7)  # evaluation packs too


def _forwards(eng) -> list[dict]:
    """What the model is called with, per forward."""
    seen = []

    def hook(module, args, kwargs):
        seen.append({key: value for key, value in kwargs.items() if isinstance(value, torch.Tensor)})

    eng.module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def test_no_padding_reaches_the_model(data):
    packed, padded = initialize(), initialize(packing=False)
    packed_calls, padded_calls = _forwards(packed), _forwards(padded)
    train(packed, data[:1])
    train(padded, data[:1])
    real = sum(LENGTHS)
    assert len(packed_calls) == 4
    for call in packed_calls:
        assert call["input_ids"].shape[0] == 1 and call["input_ids"].numel() <= BUDGET
        assert "attention_mask" not in call
        assert call["position_ids"].shape == call["input_ids"].shape
        assert call["labels"].shape == call["input_ids"].shape
    assert sum(call["input_ids"].numel() for call in packed_calls) == real  # every token real
    assert sum(call["input_ids"].numel() for call in padded_calls) > real  # the budget alone pads
    assert packed.last_window.padded_tokens == packed.last_window.real_tokens == real


def test_a_packed_row_restarts_positions_and_masks_the_seams():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [3, 0, 0, 0]])
    mask = (ids != 0).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    layout = sequence_layout(batch)
    (group,) = packing.group_packed(layout.lengths, 8)
    out = packing.take_packed(batch, layout, group)
    assert set(out) == {"input_ids", "labels", "position_ids"}
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 3]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7, -100, 9, -100]]
    shifted = {**batch, "shift_labels": batch["labels"]}
    del shifted["labels"]
    out = packing.take_packed(shifted, sequence_layout(shifted), group)
    assert out["shift_labels"].tolist() == [[5, 6, -100, 8, -100, -100]]


@pytest.mark.parametrize("broken", ["targets across seams", "positions not restarting"])
def test_broken_packings_miss(data, reference, broken, monkeypatch):
    if broken == "targets across seams":
        monkeypatch.setattr(packing, "mark_seams", lambda labels, starts, ends, shifted: labels)
    else:
        monkeypatch.setattr(packing, "document_positions", lambda columns: torch.arange(len(columns)))
    eng = initialize()
    train(eng, data)
    assert max_param_diff(eng.full_state_dict(), reference) > o.MISSED


# -- grouping -----------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=14), budget=st.integers(1, 60),
       extra=st.integers(0, 16), max_rows=st.one_of(st.none(), st.integers(1, 5)))
def test_packed_groups_hold_every_document_once_within_the_budget(lengths, budget, extra, max_rows):
    fewest = packing.fewest_packed_steps(lengths, budget, max_rows)
    groups = packing.group_packed(lengths, budget, fewest + extra, max_rows)
    assert len(groups) == fewest + extra
    real = [g for g in groups if not g.zero_weight]
    assert sorted(r for g in real for r in g.rows) == list(range(len(lengths)))
    assert len(real) == min(fewest + extra, len(lengths))
    for g in real:
        assert g.length == g.padded_tokens == sum(max(1, lengths[r]) for r in g.rows)
        assert g.real_tokens == sum(lengths[r] for r in g.rows) and g.samples == len(g.rows)
        assert len(g.rows) <= (max_rows or len(lengths))
        assert g.length <= budget or (len(g.rows) == 1 and g.over_budget)
    assert all(g.samples == 0 and g.real_tokens == 0 for g in groups[len(real):])
    with pytest.raises(TokenBudgetError, match="micro_steps must be an integer"):
        packing.group_packed(lengths, budget, fewest - 1, max_rows) if fewest > 1 else packing.group_packed(
            lengths, budget, 0, max_rows)


def test_batches_that_cannot_be_packed_are_refused(data):
    eng = initialize()
    batch = data[0]
    with pytest.raises(TokenBudgetError, match="needs the batch's token labels under 'labels'"):
        eng.train_batch({k: v for k, v in batch.items() if k != "labels"}, lambda m, b: m(**b).logits.sum())
    with pytest.raises(TokenBudgetError, match="a tensor with rows but no sequence dimension"):
        eng.train_batch({**batch, "weight": torch.ones(8)}, o.own_loss)
    with pytest.raises(TokenBudgetError, match="needs a mapping batch"):
        eng.train_batch((batch["input_ids"], batch["attention_mask"]), o.own_loss)


def test_a_token_classifier_on_a_causal_model_packs_every_label():
    """Targets that are the tokens' own (not shifted) keep every label in a packed row: exact; the seams a
    causal language model needs (each document's first label dropped) miss."""
    data = o.batches("causal_tokens", 2, lengths=LENGTHS)
    expected = state(reference_train(o.model("causal_tokens"), data, o.own_loss, sgd))
    eng = engine.initialize(o.model("causal_tokens"), CONFIG, optimizer=sgd)
    assert eng.window_split.packing is packing.no_seams
    train(eng, data)
    assert max_param_diff(eng.full_state_dict(), expected) < o.TOL
    broken = engine.initialize(o.model("causal_tokens"), CONFIG, optimizer=sgd)
    broken.window_split.packing = packing.seams_of_shifted_targets
    train(broken, data)
    assert max_param_diff(broken.full_state_dict(), expected) > o.MISSED


@pytest.mark.parametrize("kind", ["masked", "tokens", "t5"])
def test_packing_a_model_attending_both_ways_is_refused(kind):
    """BERT's and T5's documents would see each other in a packed row: refused at initialize, naming the fix."""
    with pytest.raises(engine.ConfigError, match="attends in both directions.*set packing: false"):
        engine.initialize(o.model(kind), CONFIG, optimizer=sgd)


def test_labels_of_another_length_than_the_inputs_are_named():
    """An encoder-decoder's batch given to a model the engine does not read: the labels' length is named."""
    batch = o.batches("t5", 1)[0]
    eng = engine.initialize(torch.nn.Linear(2, 2), CONFIG, optimizer=sgd)
    with pytest.raises(TokenBudgetError, match=r"batch\['labels'\] has 7 columns where the inputs have 12"):
        eng.train_batch(batch, lambda m, b: m(torch.zeros(1, 2)).sum())


# -- the config -----------------------------------------------------------------------------------
@pytest.mark.parametrize("config, message", [
    ({"train_batch_size": 8, "packing": True}, "packing: true packs each micro-batch's documents into one row of "
                                                "at most micro_batch_tokens tokens, but micro_batch_tokens is not set"),
    ({**CONFIG, "pipeline": {"stages": 2}}, "packing: true is not available under a pipeline of 2 stages"),
])
def test_the_config_refuses_packing_where_it_cannot_run(config, message, tmp_path, capsys):
    assert any(message in problem for problem in check_without_model(load_config(config)))
    with pytest.raises(engine.ConfigError, match="packing: true"):
        engine.initialize(o.model("causal"), config, optimizer=sgd)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    assert cli_main(["validate", str(path)]) == 2
    assert message in capsys.readouterr().err
