"""Ring attention's blockwise math in one process, no spawn: the ranks of a ring as threads that pass
their parts through queues, against ``scaled_dot_product_attention`` over the whole sequences
(float64, outputs and the gradients of queries, keys and values). Ring sizes 2–4, grouped-query
attention (4 query heads, 2 or 1 key/value heads), causal, causal within packed rows' documents,
and not causal; the fused CPU kernel (grouped-query keys and values handed to it with their own
heads, and repeated for a kernel that takes no such shapes) and the matmul blocks other devices run.
A merge that does not rescale what was summed before misses, and so does a backward whose passed
part drops the gradients of its first stop."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
import torch.nn.functional as F

import engine.context.ring as ring
from engine.adapters import torch_internals
from engine.adapters.torch_internals import fused_cpu_attention
from engine.context.sharding import ContextShards, document_ids
from tests.support import broken

LENGTH = 24  # cuts into 2 × size equal chunks for sizes 2, 3 and 4
TOLERANCE = 1e-12
MISSED = 1e-3
FUSED = fused_cpu_attention()
KERNELS = {"fused CPU kernel": ring.FusedCpuBlocks(FUSED),
           # a kernel that takes as many key/value heads as query heads only: grouped ones repeated for it
           "fused CPU kernel, key/value heads repeated": ring.FusedCpuBlocks(FUSED._replace(grouped_query=False)),
           "matmul blocks": ring.MatmulBlocks}


class ThreadRing(ring.RingExchange):
    """A rank of an in-process ring: a send is a put into the next rank's mailbox."""

    def __init__(self, shards: ContextShards, mailboxes: list[queue.Queue]):
        super().__init__(shards, None, list(range(shards.size)))
        self.mailboxes = mailboxes

    def pass_along(self, tensors):
        self.mailboxes[self.send_to].put([t.clone() for t in tensors])
        return self.mailboxes[self.shards.index].get(timeout=60)


def inputs(kv_heads: int):
    g = torch.Generator().manual_seed(11)
    query, key, value = (torch.randn(2, heads, LENGTH, 8, generator=g, dtype=torch.float64) * 2
                         for heads in (4, kv_heads, kv_heads))
    return query, key, value, torch.randn(2, 4, LENGTH, 8, generator=g, dtype=torch.float64)


def packed_documents() -> torch.Tensor:
    """Two rows of documents whose positions restart: some queries meet no key of some parts."""
    starts = [[0, 5, 12, 13, 20], [0, 9, 10, 17]]
    positions = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(row, row[1:] + [LENGTH])])
                             for row in starts])
    return document_ids(positions)


def whole_sequence(query, key, value, upstream, causal: bool, documents):
    """One process: SDPA over the whole sequences; output and gradients."""
    whole = [t.clone().requires_grad_() for t in (query, key, value)]
    mask = None
    if documents is not None:
        mask = (documents[:, :, None] == documents[:, None, :]) & torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril()
        mask = mask[:, None]
    output = F.scaled_dot_product_attention(*whole, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=True)
    output.backward(upstream)
    return output.detach(), [t.grad for t in whole]


def ring_differences(size: int, kv_heads: int, causal: bool, documents) -> float:
    """The largest difference over ranks between the ring's output and gradients and one process's."""
    query, key, value, upstream = inputs(kv_heads)
    expected, gradients = whole_sequence(query, key, value, upstream, causal, documents)
    mailboxes = [queue.Queue() for _ in range(size)]
    differences, errors = [0.0] * size, []

    def rank(index):
        try:
            shards = ContextShards(size, index)
            exchange = ThreadRing(shards, mailboxes)
            exchange.documents = documents
            parts = [shards.split(t, dim=2).clone().requires_grad_() for t in (query, key, value)]
            output = exchange.attend(*parts, scale=None, causal=causal)
            output.backward(shards.split(upstream, dim=2))
            mine = shards.positions(LENGTH)
            differences[index] = max(float((output.detach() - expected[:, :, mine]).abs().max()),
                                     *(float((p.grad - g[:, :, mine]).abs().max()) for p, g in zip(parts, gradients)))
        except BaseException as error:  # a failing rank would leave the others waiting on its sends
            errors.append(error)
            for box in mailboxes:
                box.put(None)

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return max(differences)


MASKS = {"causal": (True, None), "documents": (True, packed_documents()), "not causal": (False, None)}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("size,kv_heads", [(2, 2), (3, 1), (4, 2)])
def test_the_ring_equals_attention_over_the_whole_sequence(monkeypatch, kernel, size, kv_heads):
    monkeypatch.setattr(ring, "block_kernel", lambda device: KERNELS[kernel])
    for name, (causal, documents) in MASKS.items():
        assert ring_differences(size, kv_heads, causal, documents) < TOLERANCE, (kernel, size, kv_heads, name)


# What another torch might have in place of the backward op: nothing, or the op with another signature
# (SDPA's public op stands in for one whose arguments changed).
OTHER_TORCH = {"no op": None, "another signature": torch.ops.aten.scaled_dot_product_attention}


@pytest.mark.parametrize("backward", OTHER_TORCH)
def test_a_torch_without_the_fused_cpu_kernel_runs_the_blocks_in_matmuls(monkeypatch, caplog, backward):
    assert isinstance(ring.block_kernel(torch.device("cpu")), ring.FusedCpuBlocks)  # this torch has it
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", OTHER_TORCH[backward])
    monkeypatch.setattr(ring, "_told_matmul_fallback", False)
    assert fused_cpu_attention() is None
    with caplog.at_level("WARNING", logger="engine"):
        assert ring.block_kernel(torch.device("cpu")) is ring.MatmulBlocks
        assert ring.block_kernel(torch.device("cpu")) is ring.MatmulBlocks
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "no fused CPU attention kernel" in caplog.records[0].message
    assert ring_differences(2, 1, True, None) < TOLERANCE  # the fallback is exact too


def test_grouped_query_heads_reach_the_kernel_where_it_takes_them(monkeypatch):
    """This torch's kernel takes 2 query heads to 1 key/value head; one that refuses such shapes (its
    own shape check raising) is told apart, and its blocks get the key/value heads repeated."""
    assert FUSED.grouped_query
    shapes = []

    def same_heads_only(query, key, value, *rest, **kwargs):
        if query.shape[1] != key.shape[1]:
            raise RuntimeError("key and value must have the same number of heads as query")
        shapes.append(key.shape[1])
        return FUSED.forward(query, key, value, *rest, **kwargs)

    assert not torch_internals._takes_grouped_query(same_heads_only, FUSED.backward)
    monkeypatch.setattr(ring, "block_kernel",
                        lambda device: ring.FusedCpuBlocks(FUSED._replace(forward=same_heads_only, grouped_query=False)))
    assert ring_differences(2, 1, True, None) < TOLERANCE
    assert set(shapes) == {4}  # every block got the 4 query heads' keys


def test_a_merge_without_the_rescale_misses(monkeypatch):
    monkeypatch.setattr(ring, "merge_block", broken.ring_merge_without_rescale)
    for name, (causal, documents) in MASKS.items():
        assert ring_differences(2, 2, causal, documents) > MISSED, name


def test_a_passed_part_whose_first_stop_drops_its_gradients_misses(monkeypatch):
    """The key and value gradients a part gathers at its first stop are what it carries on and home:
    dropped there (zeros carried instead), the keys' and values' gradients miss."""
    monkeypatch.setattr(ring, "_placed", lambda gradient, keys, part, dtype: torch.zeros(part.shape, dtype=dtype))
    for size in (2, 3):
        assert ring_differences(size, 2, True, None) > MISSED, size


def test_a_block_is_half_a_part_of_scores_away_from_the_diagonal():
    """Causal head–tail blocks: the own part causal, an earlier part's head chunk to every query, a
    later part to the tail chunk's queries; not causal: everything."""
    blocks = ring.RingBlocks(ContextShards(3, 1), 8, True, None)
    every, head, tail = slice(0, 8), slice(0, 4), slice(4, 8)
    assert [(b.queries, b.keys, b.causal) for b in map(blocks.block, range(3))] == [
        (every, head, False), (every, every, True), (tail, every, False)]
    assert ring.RingBlocks(ContextShards(3, 1), 8, False, None).block(2) == ring.Block(every, every, False, None)


def test_what_the_blocks_do_not_compute_is_refused_naming_ulysses():
    """A Hugging Face attention call with a sliding window shorter than the sequence, a soft cap or
    sinks: refused before any exchange (Ulysses runs the model's own attention on whole sequences)."""
    from engine.context.ulysses import Activity
    from engine.errors import EngineUsageError

    activity = Activity()
    attention = ring.RingExchange(ContextShards(2, 0), None, [0, 1]).hugging_face_attention(None, "sdpa", activity)
    query = torch.zeros(1, 4, 8, 8)
    with activity:
        for extra, words in (({"sliding_window": 12}, "sliding window of 12 tokens, shorter than the sequence's 16"),
                             ({"softcap": 30.0}, "soft-capped scores"), ({"s_aux": query}, "attention sinks"),
                             ({"dropout": 0.1}, "dropout 0.1")):
            with pytest.raises(EngineUsageError, match=words):
                attention(torch.nn.Module(), query, query, query, None, **extra)
