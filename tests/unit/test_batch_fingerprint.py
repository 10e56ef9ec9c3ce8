"""The batch fingerprint the ranks of one replica compare (engine/distributed/batch_fingerprint.py):
equal for equal batches, different for every reordering, reshaping or change a fault probe made
(issue 45: the old position weights, period 13, made rows swapped at a length that is a multiple
of 13 look equal), and exact when summed in any order."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.distributed.batch_fingerprint import FINGERPRINT_SIZE, batch_fingerprint


def fp(tree):
    return batch_fingerprint(tree, torch.device("cpu"))


def same(a, b) -> bool:
    return torch.equal(fp(a), fp(b))


def tokens(rows, length, seed=0):
    return torch.randint(0, 50_000, (rows, length), generator=torch.Generator().manual_seed(seed))


def hf_batch(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def test_equal_batches_give_equal_fingerprints_of_whole_numbers_below_2_40():
    batch = hf_batch(tokens(4, 52))
    first, again = fp(batch), fp({k: v.clone() for k, v in batch.items()})
    assert torch.equal(first, again)
    assert first.shape == (FINGERPRINT_SIZE,) and first.dtype == torch.float64
    assert bool(((first >= 0) & (first < 2 ** 40) & (first == first.round())).all())


@pytest.mark.parametrize("length", [52, 13, 26, 2048, 7, 1])
def test_swapped_rows_differ(length):
    """The probe: context ranks given the same rows in another order trained 2.6e-4 off."""
    ids = tokens(4, length)
    swapped = ids[[1, 0, 2, 3]]
    assert not torch.equal(ids, swapped)
    assert not same(hf_batch(ids), hf_batch(swapped))


def test_rows_13_apart_at_length_2048_swapped_differ():
    ids = tokens(16, 2048)
    order = list(range(16))
    order[0], order[13] = 13, 0
    assert not same(ids, ids[order])


@pytest.mark.parametrize("shift", [1, 2, 13, 51])
def test_rotations_of_a_row_and_of_the_rows_differ(shift):
    ids = tokens(4, 52)
    assert not same(ids, torch.roll(ids, shift, dims=1))  # every row rotated
    row_rotated = ids.clone()
    row_rotated[2] = torch.roll(ids[2], shift)
    assert not same(ids, row_rotated)  # one row rotated
    assert not same(ids, torch.roll(ids, 1, dims=0))  # the rows rotated
    assert not same(ids, ids.reshape(-1).roll(shift).reshape(4, 52))  # the flat data rotated


def test_shifted_rows_and_left_against_right_padding_differ():
    """The same tokens padded on the right or on the left, or shifted along the row."""
    right = torch.tensor([[5, 6, 7, 0, 0, 0], [8, 9, 0, 0, 0, 0]])
    left = torch.tensor([[0, 0, 0, 5, 6, 7], [0, 0, 0, 0, 8, 9]])
    shifted = torch.tensor([[0, 5, 6, 7, 0, 0], [8, 9, 0, 0, 0, 0]])
    assert not same(right, left)
    assert not same(right, shifted)
    assert not same(hf_batch(right), hf_batch(left))


def test_rows_differing_only_in_padding_differ():
    """The same rows padded to another length, with another pad value, or a mask that hides
    another number of pad positions."""
    rows = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    longer = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]])
    other_pad = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 2]])
    assert not same(rows, longer)
    assert not same(rows, other_pad)
    mask = (rows != 0).long()
    wider_mask = mask.clone()
    wider_mask[1, 2] = 1
    assert not same({"input_ids": rows, "attention_mask": mask}, {"input_ids": rows, "attention_mask": wider_mask})
    labels = rows.masked_fill(rows == 0, -100)
    assert not same({"input_ids": rows, "labels": labels}, {"input_ids": rows, "labels": rows})


def test_one_changed_token_differs_wherever_it_is():
    ids = tokens(4, 52)
    base = fp(ids)
    seen = {tuple(base.tolist())}
    for row, position in itertools.product(range(4), range(52)):
        changed = ids.clone()
        changed[row, position] += 1
        seen.add(tuple(fp(changed).tolist()))
    assert len(seen) == 1 + 4 * 52  # all different from the batch and from each other


def test_one_changed_bit_of_a_float_differs():
    x = torch.randn(3, 5, dtype=torch.float32)
    y = x.clone()
    y.view(torch.int32)[1, 2] ^= 1
    assert not same(x, y)


def test_structure_counts_shape_and_place_in_the_tree():
    ids = tokens(4, 6)
    assert not same(ids, ids.reshape(6, 4))
    assert not same(ids, ids.reshape(-1))
    labels = tokens(4, 6, seed=1)
    assert not same({"input_ids": ids, "labels": labels}, {"input_ids": labels, "labels": ids})
    assert not same((ids, labels), (labels, ids))
    assert not same((ids,), (ids, ids))


def test_floats_compare_by_value_nan_and_signed_zero_alike():
    x = torch.tensor([1.5, float("nan"), -0.0, float("inf")], dtype=torch.float32)
    y = torch.tensor([1.5, -float("nan"), 0.0, float("inf")], dtype=torch.float64)
    assert same(x, y)
    assert not same(x, torch.tensor([1.5, float("nan"), 0.0, -float("inf")]))
    assert same(torch.tensor([True, False]), torch.tensor([1, 0]))


def test_no_collision_among_many_random_batches():
    """Whole numbers of 120 bits: a few thousand random batches never meet (the odds, 2**-120 a
    pair under the random-function model, are in the module's docstring)."""
    prints = {tuple(fp(tokens(2, 8, seed=seed)).tolist()) for seed in range(2000)}
    assert len(prints) == 2000


def test_sums_of_fingerprints_are_exact_in_any_order():
    """The window's all-reduce sums one fingerprint per replica in whatever order the ring adds:
    whole numbers below 2**40 added up to 2**13 at a time stay exact, so equal sets give equal sums."""
    prints = torch.stack([fp(tokens(2, 8, seed=seed)) for seed in range(512)])
    forward = torch.zeros(FINGERPRINT_SIZE, dtype=torch.float64)
    for row in prints:
        forward += row
    backward = torch.zeros(FINGERPRINT_SIZE, dtype=torch.float64)
    for row in reversed(prints):
        backward += row
    assert torch.equal(forward, backward)
    exact = [sum(int(v) for v in prints[:, k].tolist()) for k in range(FINGERPRINT_SIZE)]
    assert forward.tolist() == [float(v) for v in exact]


def test_a_tensor_longer_than_a_chunk_is_keyed_past_the_chunk():
    """A large tensor (a parameter) is hashed a chunk at a time, each chunk keyed by its number:
    a change, a swap of the chunks or a rotation past the chunk's end still differs."""
    from engine.distributed.batch_fingerprint import _CHUNK

    x = torch.randint(0, 1000, (2 * _CHUNK + 10,))
    changed = x.clone()
    changed[_CHUNK + 5] += 1
    assert not same(x, changed)
    halves = torch.cat([x[_CHUNK:2 * _CHUNK], x[:_CHUNK], x[2 * _CHUNK:]])
    assert not same(x, halves)
    assert not same(x, x.roll(1))
