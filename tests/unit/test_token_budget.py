import math
from collections import OrderedDict, UserDict, namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.batching.plan import split_evenly
from engine.batching.token_budget import (MicroGroup, TokenBudgetError, TokenSplitter, budget_candidates, fewest_micro_steps,
                                 group_by_tokens, over_budget_message, sequence_layout, smaller_budget, take_rows,
                                 token_cost)
from tests.support.lm_models import TinyCausalLM, loss_sum_and_count, padded_batch

Pair = namedtuple("Pair", "ids extra")


class Encoding(UserDict):
    """Stands in for a Hugging Face BatchEncoding (a UserDict built from a dict)."""


# -- grouping ------------------------------------------------------------------------------
lengths_st = st.lists(st.integers(0, 40), min_size=1, max_size=14)


def check_groups(groups, lengths, budget, steps, max_rows=None):
    assert len(groups) == steps
    assert all(len(g.rows) <= (max_rows or len(lengths)) for g in groups)
    real = [g for g in groups if not g.zero_weight]
    assert sorted(r for g in real for r in g.rows) == list(range(len(lengths)))  # each row once
    for g in real:
        assert g.length == max(1, max(lengths[r] for r in g.rows))
        assert [lengths[r] for r in g.rows] == sorted((lengths[r] for r in g.rows), reverse=True)
        assert g.real_tokens == sum(lengths[r] for r in g.rows) and g.samples == len(g.rows)
        assert g.padded_tokens <= budget or (len(g.rows) == 1 and g.over_budget)
        assert g.over_budget == (g.length > budget)
    shortest = min(range(len(lengths)), key=lambda r: (lengths[r], -r))
    for g in groups[len(real):]:  # zero-weight repeats come last, flagged, and count nothing
        assert g.zero_weight and g.rows == (shortest,) and g.samples == 0 and g.real_tokens == 0
    assert len(real) == min(steps, len(lengths))


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 120), extra=st.integers(0, 18),
       max_rows=st.one_of(st.none(), st.integers(1, 6)))
def test_groups_hold_every_row_once_within_the_budget(lengths, budget, extra, max_rows):
    fewest = fewest_micro_steps(lengths, budget, max_rows)
    check_groups(group_by_tokens(lengths, budget, max_rows=max_rows), lengths, budget, fewest, max_rows)
    check_groups(group_by_tokens(lengths, budget, fewest + extra, max_rows), lengths, budget, fewest + extra, max_rows)


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for blocks in set_partitions(rest):
        yield [[first], *blocks]
        for i in range(len(blocks)):
            yield [*blocks[:i], [first, *blocks[i]], *blocks[i + 1:]]


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=7), budget=st.integers(1, 40),
       max_rows=st.one_of(st.none(), st.integers(1, 4)))
def test_grouping_is_as_cheap_as_any_partition_of_the_rows(lengths, budget, max_rows):
    """Brute force over every way of grouping the rows: no grouping within the budget (and
    the row cap) needs fewer micro-steps, and none with the same count computes fewer
    padded tokens."""
    best = {}  # micro-steps -> fewest padded tokens
    for blocks in set_partitions(list(range(len(lengths)))):
        sizes = [len(b) * max(1, *(lengths[r] for r in b)) for b in blocks]
        if all((s <= budget or len(b) == 1) and len(b) <= (max_rows or len(b)) for s, b in zip(sizes, blocks)):
            best[len(blocks)] = min(best.get(len(blocks), math.inf), sum(sizes))
    assert fewest_micro_steps(lengths, budget, max_rows) == min(best)
    for steps, tokens in best.items():
        assert token_cost(group_by_tokens(lengths, budget, steps, max_rows)).padded_tokens == tokens


def test_cheapest_grouping_beats_filling_the_longest_row_first():
    # Greedy filling would run [10, 6] and [6, 6]: 32 padded tokens for 28 real ones.
    groups = group_by_tokens([6, 10, 6, 6], budget=20)
    assert [(g.rows, g.length) for g in groups] == [((1,), 10), ((0, 2, 3), 6)]
    assert token_cost(groups) == token_cost([MicroGroup((1,), 10, 10), MicroGroup((0, 2, 3), 6, 18)])
    assert token_cost(groups).padded_tokens == 28 and padding_fraction(token_cost(groups)) == 0


def test_extra_micro_steps_split_rows_evenly_before_any_zero_weight_step():
    groups = group_by_tokens([5] * 8, budget=40, micro_steps=2)
    assert [g.rows for g in groups] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    three = group_by_tokens([7, 2, 9], budget=100, micro_steps=5)
    assert [(g.rows, g.zero_weight) for g in three] == [((2,), False), ((0,), False), ((1,), False),
                                                        ((1,), True), ((1,), True)]


def test_a_row_longer_than_the_budget_runs_alone_with_a_warning():
    groups = group_by_tokens([3, 50, 2, 64], budget=20)
    assert [(g.rows, g.over_budget) for g in groups] == [((3,), True), ((1,), True), ((0, 2), False)]
    message = over_budget_message(groups, 20)
    assert "row 3 (64 tokens), row 1 (50 tokens) exceed micro_batch_tokens 20" in message
    assert "raise micro_batch_tokens to 64" in message
    assert over_budget_message(group_by_tokens([3, 2], 20), 20) is None


def test_a_row_cap_splits_micro_batches_the_budget_alone_would_allow():
    assert [g.rows for g in group_by_tokens([2] * 5, budget=100)] == [(0, 1, 2, 3, 4)]
    assert [g.rows for g in group_by_tokens([2] * 5, budget=100, max_rows=2)] == [(0,), (1, 2), (3, 4)]


def test_out_of_memory_halves_the_largest_micro_batch_of_several_rows():
    groups = group_by_tokens([30, 6, 6, 5, 2, 2], budget=24)  # [30] alone (over), [6, 6, 5], [2, 2]
    assert [g.padded_tokens for g in groups] == [30, 18, 4]
    assert smaller_budget(groups) == 9  # the single row of 30 cannot shrink: it does not count
    assert [g.padded_tokens for g in group_by_tokens([30, 6, 6, 5, 2, 2], budget=9)] == [30, 6, 6, 5, 4]
    assert smaller_budget(group_by_tokens([30, 6], budget=8)) == 0  # one row each: nothing to halve
    assert smaller_budget(group_by_tokens([3], budget=8, micro_steps=3)) == 0  # zero-weight repeats


def test_explore_candidates_halve_the_budget_while_it_holds_the_longest_row():
    assert budget_candidates(4096, longest=300) == [512, 1024, 2048, 4096]
    assert budget_candidates(4096, longest=512) == [512, 1024, 2048, 4096]
    assert budget_candidates(100, longest=300) == [100]  # never above the configured budget
    assert budget_candidates(5, longest=0) == [1, 2, 5]


def test_splitter_logs_what_it_trims_and_warns_about_long_rows_once(caplog):
    splitter = TokenSplitter()
    batch = padded_batch([30, 3, 2], width=30)
    with caplog.at_level("INFO", logger="engine"):
        for _ in range(3):
            layout, fewest = splitter.read(batch, budget=20)
            assert fewest == 2 and splitter.group(layout, 20, 4)[3].zero_weight
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "trimmed along dim 1" in line] == [layout.describe()]
    assert [line for line in lines if "exceed" in line] == [
        "row 0 (30 tokens) exceed micro_batch_tokens 20: each runs alone as a micro-batch of its own length, "
        "which may not fit in memory; raise micro_batch_tokens to 30 or truncate such sequences (shown once)"]


def test_all_padding_rows_keep_one_position():
    groups = group_by_tokens([0, 0, 0], budget=2)
    assert [(g.rows, g.length, g.real_tokens) for g in groups] == [((0,), 1, 0), ((1, 2), 1, 0)]


@pytest.mark.parametrize("call, message", [
    (lambda: group_by_tokens([4, 4, 4], 8, micro_steps=1),
     r"micro_steps must be an integer >= 2, the fewest that fit 3 rows in micro_batch_tokens 8; got 1"),
    (lambda: fewest_micro_steps([4], 0), "micro_batch_tokens must be a positive integer, got 0"),
    (lambda: group_by_tokens([4], True), "micro_batch_tokens must be a positive integer, got True"),
    (lambda: group_by_tokens([], 8), "cannot group an empty batch"),
])
def test_grouping_errors_say_what_to_change(call, message):
    with pytest.raises(TokenBudgetError, match=message):
        call()


def fixed_size_groups(lengths, padded_length, micro_batch_size):
    """The micro-batches a fixed micro size makes of the same rows, for comparison: consecutive,
    near-equal and none above ``micro_batch_size`` (as the plan cuts them), each padded to the
    batch's ``padded_length`` since nothing is trimmed."""
    sizes = split_evenly(len(lengths), math.ceil(len(lengths) / micro_batch_size))
    edges = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    return [MicroGroup(tuple(range(a, b)), padded_length, sum(lengths[a:b])) for a, b in zip(edges, edges[1:])]


def padding_fraction(cost):
    return 1 - cost.real_tokens / cost.padded_tokens


def largest_micro_batch(groups):
    """Padded tokens of the biggest micro-batch: what memory holds."""
    return max(g.padded_tokens for g in groups)


def test_fixed_micro_size_pads_every_micro_batch_to_the_batch_length():
    lengths = [30, 2, 3, 4, 2, 1, 3, 5]  # one long row, the rest short: skewed
    fixed_groups = fixed_size_groups(lengths, padded_length=30, micro_batch_size=3)
    fixed = token_cost(fixed_groups)
    assert (fixed.micro_steps, fixed.padded_tokens, largest_micro_batch(fixed_groups)) == (3, 240, 90)
    assert [g.rows for g in fixed_size_groups(lengths, 30, 3)] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    budget_groups = group_by_tokens(lengths, budget=90)
    budget = token_cost(budget_groups)
    assert budget.real_tokens == fixed.real_tokens == 50
    assert budget.padded_tokens < fixed.padded_tokens and largest_micro_batch(budget_groups) <= 90
    assert padding_fraction(fixed) == pytest.approx(1 - 50 / 240)


# -- layout: lengths and sequence tensors -------------------------------------------------------
def test_default_rule_trims_every_rows_by_T_tensor_and_says_so():
    batch = padded_batch([3, 1, 4], width=5)
    batch |= {"per_row": torch.ones(3), "scores": torch.zeros(3, 2), "embeddings": torch.zeros(3, 5, 2)}
    layout = sequence_layout(batch)
    assert layout.lengths == (3, 1, 4) and layout.padded_length == 5
    assert layout.sequence_paths == ("batch['input_ids']", "batch['attention_mask']", "batch['labels']",
                                     "batch['embeddings']")
    assert layout.other_paths == ("batch['per_row']", "batch['scores']")
    assert layout.describe() == (
        "micro_batch_tokens: lengths from batch['attention_mask'] (right padding, padded length 5); "
        "trimmed along dim 1 (every [rows, 5, ...] tensor; set sequence_keys to choose): "
        "batch['input_ids'], batch['attention_mask'], batch['labels'], batch['embeddings']; "
        "rows only: batch['per_row'], batch['scores']")


def test_sequence_keys_exclude_a_tensor_that_only_happens_to_be_T_wide():
    batch = padded_batch([2, 4], width=4) | {"class_scores": torch.rand(2, 4)}
    layout = sequence_layout(batch, sequence_keys=["input_ids", "labels"])
    assert layout.sequence_paths == ("batch['input_ids']", "batch['attention_mask']", "batch['labels']")
    assert layout.other_paths == ("batch['class_scores']",) and "(sequence_keys)" in layout.describe()
    micro = take_rows(batch, layout, group_by_tokens(layout.lengths, 2)[1])
    assert micro["input_ids"].shape == (1, 2) and torch.equal(micro["class_scores"], batch["class_scores"][:1])


def test_a_nested_mask_is_found_and_containers_keep_their_types():
    batch = {"text": OrderedDict(padded_batch([1, 3])), "image": [torch.zeros(2, 5, 4)], "step": 7}
    layout = sequence_layout(batch)
    assert layout.source == "batch['text']['attention_mask']" and layout.lengths == (1, 3)
    assert layout.other_paths == ("batch['image'][0]",)
    micro = take_rows(batch, layout, MicroGroup((1,), 3, 3))
    assert isinstance(micro["text"], OrderedDict) and micro["step"] == 7
    assert micro["text"]["input_ids"].shape == (1, 3) and micro["image"][0].shape == (1, 5, 4)


def test_without_a_mask_a_lengths_function_and_leaf_paths_describe_a_tuple_batch():
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    batch = (ids, Pair(ids.clone(), "tag"), torch.tensor([1.0, 2.0]))
    layout = sequence_layout(batch, lengths=lambda b: (b[0] != 0).sum(1),
                             sequence_keys=["batch[0]", "batch[1][0]"])
    assert layout.lengths == (2, 1) and layout.padded_length == 3 and layout.source == "the lengths function"
    assert layout.other_paths == ("batch[2]",)
    micro = take_rows(batch, layout, MicroGroup((1, 0), 2, 3))
    assert isinstance(micro, tuple) and isinstance(micro[1], Pair) and micro[1].extra == "tag"
    assert torch.equal(micro[0], torch.tensor([[7, 0], [5, 6]])) and torch.equal(micro[2], torch.tensor([2.0, 1.0]))


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda: padded_batch([2, 3], side="left"), {},
     r"batch\['attention_mask'\]: row 0 is left-padded; micro_batch_tokens needs right padding "
     r"\(tokenizer.padding_side = 'right'\): a left-padded row's next-token loss predicts"),
    (lambda: {"input_ids": torch.zeros(2, 3), "attention_mask": torch.tensor([[1, 0, 1], [1, 1, 1]])}, {},
     r"row 0 has padding between real tokens"),
    (lambda: {"input_ids": torch.zeros(2, 3), "attention_mask": torch.tensor([[1, 1, 0], [0, 1, 1]])}, {},
     r"row 1 is left-padded"),
    (lambda: {"input_ids": torch.zeros(2, 2), "attention_mask": torch.tensor([[1, 0], [2, 1]])}, {},
     r"must hold 0 \(padding\) and 1 \(real token\); row 1 holds other values"),
    (lambda: {"input_ids": torch.zeros(2, 2), "attention_mask": torch.ones(2, 1, 2)}, {},
     r"has shape \(2, 1, 2\); micro_batch_tokens reads a \[rows, length\] mask"),
    (lambda: {"input_ids": torch.zeros(2, 3)}, {},
     r"the batch has no 'attention_mask'; pass lengths\(batch\)"),
    (lambda: {"input_ids": torch.zeros(2, 3)}, {"lengths": lambda b: torch.tensor([1, 2])},
     r"set sequence_keys, e.g. \['input_ids', 'labels'\] \(paths: batch\['input_ids'\]\)"),
    (lambda: {"a": padded_batch([1, 2]), "b": padded_batch([2, 2])}, {},
     r"holds 2 attention masks \(batch\['a'\]\['attention_mask'\], batch\['b'\]\['attention_mask'\]\)"),
    (lambda: padded_batch([1, 2]), {"sequence_keys": ["input_ids", "lables"]},
     r"sequence_keys names 'lables', which is no tensor of the batch"),
    (lambda: padded_batch([1, 2]), {"sequence_keys": "input_ids"}, r"must be a list of names"),
    (lambda: padded_batch([1, 2]) | {"x": torch.zeros(2, 3)}, {"sequence_keys": ["x"]},
     r"with T the attention mask's length 2; got .*batch\['x'\]: \[2, 3\]"),
    (lambda: {"a": torch.zeros(2, 3), "b": torch.zeros(2, 4)},
     {"lengths": lambda b: [1, 1], "sequence_keys": ["a", "b"]}, r"with T one length"),
    (lambda: padded_batch([1, 2]), {"lengths": lambda b: torch.tensor([1.0, 2.0])}, r"must return integers"),
    (lambda: padded_batch([1, 2]), {"lengths": lambda b: torch.tensor([[1, 2]])}, r"shape \[2\]; got shape \[1, 2\]"),
    (lambda: padded_batch([1, 2]), {"lengths": lambda b: torch.tensor([1, 3])},
     r"gives row 1 3 tokens; a length must be in 0..2"),
    (lambda: padded_batch([1, 2]), {"lengths": lambda b: torch.tensor([1, 1])},
     r"gives row 1 1 tokens but batch\['attention_mask'\] marks 2 real ones; trimming would drop"),
])
def test_layout_errors_say_what_is_wrong_and_how_to_fix_it(make, kwargs, message):
    with pytest.raises(TokenBudgetError, match=message):
        sequence_layout(make(), **kwargs)


# -- building micro-batches ----------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=10), extra_width=st.integers(0, 3),
       budget=st.integers(1, 40), extra=st.integers(0, 4))
def test_micro_batches_keep_every_real_token_and_drop_only_padding(lengths, extra_width, budget, extra):
    width = max(1, *lengths) + extra_width
    inner = padded_batch(lengths, width)
    batch = Encoding(inner | {"row_id": torch.arange(len(lengths)), "scale": torch.tensor(2.0), "name": "run"})
    layout = sequence_layout(batch)
    groups = group_by_tokens(layout.lengths, budget, fewest_micro_steps(lengths, budget) + extra)
    kept = {}
    for group in groups:
        micro = take_rows(batch, layout, group)
        assert isinstance(micro, Encoding) and micro["name"] == "run" and micro["scale"] is batch["scale"]
        assert micro["row_id"].tolist() == list(group.rows)
        for key in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(micro[key], inner[key][list(group.rows), :group.length])
        assert int(micro["attention_mask"].sum()) == sum(lengths[r] for r in group.rows)
        if not group.zero_weight:
            for i, row in enumerate(group.rows):
                kept[row] = micro["labels"][i][micro["attention_mask"][i].bool()].tolist()
    assert kept == {r: inner["labels"][r][inner["attention_mask"][r].bool()].tolist() for r in range(len(lengths))}


# -- exactness: trimmed micro-batches give the full batch's (sum, count) ------------------------
def window_sum_and_grads(model, batch, groups=None, layout=None):
    """The (loss sum, count, gradient) of the whole batch, or summed over micro-batches the
    way the engine weights them (zero-weight steps run but count nothing)."""
    model.zero_grad()
    total, count = torch.zeros((), dtype=torch.float64), 0
    for group in groups or [None]:
        micro = batch if group is None else take_rows(batch, layout, group)
        loss, items = loss_sum_and_count(model, micro)
        weight = 0.0 if group is not None and group.zero_weight else 1.0
        (loss * weight).backward()
        total, count = total + loss.detach() * weight, count + int(items) * weight
    return total, count, [p.grad.clone() for p in model.parameters()]


def assert_same_window(model, batch, budget, extra_steps=0):
    layout = sequence_layout(batch)
    groups = group_by_tokens(layout.lengths, budget, fewest_micro_steps(layout.lengths, budget) + extra_steps)
    assert token_cost(groups).padded_tokens < layout.padded_length * len(layout.lengths)
    full, micro = window_sum_and_grads(model, batch), window_sum_and_grads(model, batch, groups, layout)
    assert micro[1] == full[1]
    torch.testing.assert_close(micro[0], full[0], rtol=1e-12, atol=0)
    for got, expected in zip(micro[2], full[2]):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-13)
    return groups


SKEWED = [14, 3, 2, 5, 1, 3, 2, 9]  # most short, a few long


@pytest.mark.parametrize("extra_steps", [0, 3, 9])  # 9: more micro-steps than rows (zero-weight)
def test_token_budget_windows_equal_the_full_batch_in_float64(extra_steps):
    torch.manual_seed(0)
    groups = assert_same_window(TinyCausalLM().double(), padded_batch(SKEWED, width=16), 16, extra_steps)
    assert sum(g.zero_weight for g in groups) == max(0, fewest_micro_steps(SKEWED, 16) + extra_steps - 8)


@pytest.fixture(scope="module")
def llama():
    # sdpa, not eager: eager attention takes its softmax in float32 even in a float64 model,
    # and a float32 sum over a longer row of keys rounds differently (~1e-10 here).
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float64)


def test_hugging_face_llama_window_is_exact(llama):
    assert_same_window(llama, padded_batch(SKEWED, width=16), budget=20, extra_steps=2)
