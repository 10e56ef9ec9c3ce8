"""``packing: true`` on two ranks runs the attention within each document (``engine.attention``)
and equals the padded full batch: on data 2, and under context 2 — Ulysses hands it the whole
sequence's document bounds; ring attention computes its own blocks and never calls it — with a
variant that lets documents attend across a seam under Ulysses, which misses. One spawn."""

from __future__ import annotations

import copy
import functools

import pytest

import engine
from engine.attention import hugging_face
from tests.support import own_loss as o
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, rank_slice, reference_train, sgd, state

pytest.importorskip("transformers")

CONFIG = {"train_batch_size": 8, "micro_batch_tokens": 16, "packing": True}
CONTEXT = {"ulysses": {"context_parallel": {"size": 2, "method": "ulysses"}},
           "ring": {"context_parallel": {"size": 2, "method": "ring"}}}


def _merged_first_two(read):
    return lambda *args: tuple((row[0] + row[1], *row[2:]) if len(row) > 1 else row for row in read(*args))


def packed_training(rank, world, extra=None, crossing=False):
    data = o.batches("causal", 2)
    expected = state(reference_train(o.model("causal"), data, o.own_loss, sgd))
    calls = []
    choose = hugging_face.choose_kernel

    def recording(*args):  # the documents' lengths every call of the documents' kernels was given
        kernel = choose(*args)

        def run_kernel(query, key, value, lengths, **kwargs):
            calls.append(lengths)
            return kernel(query, key, value, lengths, **kwargs)
        return run_kernel

    read_bounds = hugging_face.lengths_of_bounds
    hugging_face.choose_kernel = recording
    if crossing:  # Ulysses hands the documents as bounds: the first two of each row read as one
        hugging_face.lengths_of_bounds = _merged_first_two(read_bounds)
    try:
        eng = engine.initialize(o.model("causal"), {**CONFIG, **(extra or {})}, optimizer=sgd)
        for batch in data:
            eng.train_batch(rank_slice(batch, eng.plan), o.own_loss)
        return {"diff": max_param_diff(eng.full_state_dict(), expected),
                "documents": max((len(lengths[0]) for lengths in calls), default=0)}
    finally:
        hugging_face.choose_kernel = choose
        hugging_face.lengths_of_bounds = read_bounds


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_packing_on_two_ranks_runs_the_documents_attention_and_equals_the_full_batch():
    results = run_scenarios({
        "data 2": packed_training,
        "context 2, ulysses": functools.partial(packed_training, extra=CONTEXT["ulysses"]),
        "context 2, ring": functools.partial(packed_training, extra=CONTEXT["ring"]),
        "context 2, ulysses, documents merged": functools.partial(packed_training, extra=CONTEXT["ulysses"],
                                                                  crossing=True),
    }, world_size=2, timeout=220)
    for name in ("data 2", "context 2, ulysses", "context 2, ring"):
        assert all(rank["diff"] < o.TOL for rank in results[name]), (name, results[name])
    assert all(rank["documents"] > 1 for rank in results["data 2"] + results["context 2, ulysses"])
    assert all(rank["documents"] == 0 for rank in results["context 2, ring"])  # the ring's own blocks
    assert all(rank["diff"] > o.MISSED for rank in results["context 2, ulysses, documents merged"])
