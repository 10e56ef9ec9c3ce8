"""Attention within each document of a packed row (``engine.attention``), without the dense mask
transformers builds over the row: a float64 Llama's logits and gradients on packed rows equal the
plain model's (transformers' per-document mask) to float64 rounding; a variant that lets a document
attend across a seam misses; training with ``packing: true`` equals the padded full batch; the
kernel choice (flash-attention varlen on CUDA where installed) with the package's absence and
presence injected."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.attention import hugging_face, kernels
from engine.attention.hugging_face import apply_document_attention, why_not
from tests.support import own_loss as o
from tests.support.reference import max_param_diff, reference_train, sgd, state

transformers = pytest.importorskip("transformers")

EXACT = 1e-12  # float64 rounding: the documents' attention sums the same terms in another order
MISSED = 1e-4
# two packed rows (the engine packs one; transformers' mask takes any number): runs of equal
# lengths (one call each), a one-token document, a row of one document
ROWS = [[5, 3, 3, 3, 1, 7, 2], [24]]


def packed(rows=ROWS, seed=3):
    g = torch.Generator().manual_seed(seed)
    width = sum(rows[0])
    assert all(sum(row) == width for row in rows)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    ids = torch.randint(1, o.VOCAB, (len(rows), width), generator=g)
    return {"input_ids": ids, "position_ids": positions, "labels": ids, "use_cache": False}


def run(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out.logits.detach(), [p.grad.clone() for p in model.parameters()]


def largest_difference(first, second) -> float:
    (logits_a, grads_a), (logits_b, grads_b) = first, second
    return max([(logits_a - logits_b).abs().max().item()] + [(a - b).abs().max().item() for a, b in zip(grads_a, grads_b)])


@pytest.fixture
def kernel_calls(monkeypatch):
    """The documents' lengths every attention call of the documents' kernels was given."""
    calls = []
    choose = hugging_face.choose_kernel

    def recording(*args):
        kernel = choose(*args)

        def run_kernel(query, key, value, lengths, **kwargs):
            calls.append(lengths)
            return kernel(query, key, value, lengths, **kwargs)
        return run_kernel

    monkeypatch.setattr(hugging_face, "choose_kernel", recording)
    return calls


def test_documents_attention_equals_the_dense_mask(kernel_calls):
    plain = o.model("causal")
    documents = copy.deepcopy(plain)
    assert apply_document_attention(documents)
    batch = packed()
    assert largest_difference(run(plain, batch), run(documents, batch)) < EXACT
    layers = plain.config.num_hidden_layers
    assert kernel_calls == [tuple(map(tuple, ROWS))] * layers  # every layer, the documents read once


def test_a_document_attending_across_a_seam_misses(monkeypatch):
    plain = o.model("causal")
    documents = copy.deepcopy(plain)
    apply_document_attention(documents)
    read = hugging_face.lengths_of_mask

    def merged_first_two(marker):  # the first two documents of each row as one
        return tuple((row[0] + row[1], *row[2:]) if len(row) > 1 else row for row in read(marker))

    monkeypatch.setattr(hugging_face, "lengths_of_mask", merged_first_two)
    batch = packed()
    assert largest_difference(run(plain, batch), run(documents, batch)) > MISSED


def test_eager_models_and_what_is_not_a_packed_row_are_the_models_own():
    for implementation, tolerance in (("sdpa", EXACT), ("eager", 1e-7)):  # eager: its float32 softmax rounds
        plain = o.model("causal")
        plain.set_attn_implementation(implementation)
        documents = copy.deepcopy(plain)
        assert apply_document_attention(documents)
        assert largest_difference(run(plain, packed()), run(documents, packed())) < tolerance
        ids = packed()["input_ids"]
        padding = torch.ones_like(ids)
        padding[1, 20:] = 0
        with torch.no_grad():
            for extra in ({}, {"attention_mask": padding}):  # whole rows; a padding mask (the model's own path)
                difference = plain(input_ids=ids, **extra).logits - documents(input_ids=ids, **extra).logits
                assert difference.abs().max() < tolerance
        generated = [m.generate(ids[:1, :6], max_new_tokens=4, do_sample=False) for m in (plain, documents)]
        assert torch.equal(*generated)  # a key/value cache: the model's own mask and attention


def test_models_whose_mask_is_more_than_documents_keep_it():
    mistral = transformers.MistralForCausalLM._from_config(transformers.MistralConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, sliding_window=4), attn_implementation="sdpa")
    assert "sliding_window" in why_not(mistral)
    assert not apply_document_attention(mistral)
    assert mistral.config._attn_implementation == "sdpa"
    assert "not a Hugging Face model" in why_not(torch.nn.Linear(2, 2))


# -- the engine ---------------------------------------------------------------------------------
CONFIG = {"train_batch_size": 8, "micro_batch_tokens": 16, "packing": True}


@pytest.fixture(scope="module")
def data():
    return o.batches("causal", 2, lengths=o.LENGTHS)


@pytest.fixture(scope="module")
def reference(data):
    return state(reference_train(o.model("causal"), data, o.own_loss, sgd))


def test_training_with_packing_runs_the_documents_attention_and_equals_the_full_batch(data, reference,
                                                                                      kernel_calls):
    eng = engine.initialize(o.model("causal"), CONFIG, optimizer=sgd)
    assert eng.module.config._attn_implementation.startswith(hugging_face.PREFIX)
    for batch in data:
        eng.train_batch(batch, o.own_loss)
    assert max_param_diff(eng.full_state_dict(), reference) < o.TOL
    assert any(len(lengths[0]) > 1 for lengths in kernel_calls)  # packed rows of several documents ran
    unpacked = engine.initialize(o.model("causal"), {**CONFIG, "packing": False}, optimizer=sgd)
    assert unpacked.module.config._attn_implementation == "sdpa"  # only where packing is on


def test_training_across_seams_misses(data, reference, monkeypatch):
    read = hugging_face.lengths_of_mask
    monkeypatch.setattr(hugging_face, "lengths_of_mask",
                        lambda marker: tuple((row[0] + row[1], *row[2:]) if len(row) > 1 else row
                                             for row in read(marker)))
    eng = engine.initialize(o.model("causal"), CONFIG, optimizer=sgd)
    for batch in data:
        eng.train_batch(batch, o.own_loss)
    assert max_param_diff(eng.full_state_dict(), reference) > o.MISSED


# -- the kernel on CUDA ---------------------------------------------------------------------------
def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal):
    """flash_attn_varlen_func's contract ((tokens, heads, d), cumulative bounds), written out."""
    assert torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and max_q == max_k == int(cu_q.diff().max())
    out = []
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        piece = [t[start:end].transpose(0, 1) for t in (q, k, v)]
        out.append(F.scaled_dot_product_attention(*piece, is_causal=causal, scale=softmax_scale,
                                                  enable_gqa=True).transpose(0, 1))
    return torch.cat(out)


def test_flash_varlen_is_chosen_on_cuda_in_half_precision_where_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # absent: importing it fails
    assert kernels.find_flash_varlen() is None
    for version, found in (("2.7.4", reference_varlen), ("3.0.0", None)):
        monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
            __version__=version, flash_attn_varlen_func=reference_varlen))
        assert kernels.find_flash_varlen() is found
    grouped = kernels.grouped_sdpa
    assert kernels.choose_kernel("cuda", torch.float32, reference_varlen) is grouped
    assert kernels.choose_kernel("cuda", torch.bfloat16, None) is grouped
    assert kernels.choose_kernel("cpu", torch.bfloat16, reference_varlen) is grouped
    flash = kernels.choose_kernel("cuda", torch.bfloat16, reference_varlen)
    assert flash is not grouped
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 24, 8, generator=g, dtype=torch.float64)
    key, value = (torch.randn(2, 2, 24, 8, generator=g, dtype=torch.float64) for _ in range(2))
    lengths = tuple(map(tuple, ROWS))
    expected = grouped(query, key, value, lengths, scale=0.3, dropout=0.0, causal=True)
    assert (flash(query, key, value, lengths, scale=0.3, dropout=0.0, causal=True) - expected).abs().max() < EXACT
