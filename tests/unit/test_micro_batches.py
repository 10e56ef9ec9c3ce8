"""engine.MicroBatches: a window handed to train_batch as its collated micro-batches (each padded to its own
length), run as they are: exact against the full-batch reference, a short window weighted by what it holds,
rows counted past per-batch vectors, and more micro-batches than the plan's window refused."""

import pytest
import torch

import engine
from tests.support.reference import TinyLM, max_param_diff, reference_train, sgd, state, token_loss_sum


def rows_of(batch, start, stop, width):
    """Rows ``start:stop`` of a token batch cut to ``width`` columns (their own padding)."""
    return {key: value[start:stop, :width] for key, value in batch.items()}


def token_loss_sum_mean(model, batch):
    loss_sum, count = token_loss_sum(model, batch)
    return loss_sum / count


def test_micro_batches_of_their_own_widths_and_a_short_window_equal_the_full_batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 11, (7, 6), generator=g)
    lengths = torch.tensor([6, 2, 5, 1, 3, 6, 2])
    labels = torch.where(torch.arange(6)[None, :] < lengths[:, None], tokens, -100)
    whole = {"tokens": tokens, "labels": labels}
    windows = [[(0, 2), (2, 4)], [(4, 6), (6, 7)], [(0, 2)]]  # the last: a short window of one micro-batch
    global_batches = [{k: torch.cat([v[a:b] for a, b in window]) for k, v in whole.items()} for window in windows]
    expected = reference_train(TinyLM(), global_batches, token_loss_sum_mean, sgd)
    eng = engine.initialize(TinyLM(), {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
                            optimizer=sgd)
    for window in windows:
        cut = [rows_of(whole, a, b, int(lengths[a:b].max())) for a, b in window]
        eng.train_batch(engine.MicroBatches(cut), token_loss_sum)
    assert max_param_diff(eng.full_state_dict(), state(expected)) < 1e-12
    assert eng.global_steps == 3


def test_rows_are_counted_past_per_batch_vectors_and_too_many_micro_batches_are_refused():
    from engine.batching.micro_batches import rows

    packed = {"input_ids": torch.zeros(1, 9, dtype=torch.long), "cu_seq_lens": torch.tensor([0, 4, 9])}
    assert rows(packed) == 1
    eng = engine.initialize(TinyLM(), {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2},
                            optimizer=sgd)
    three = [{"tokens": torch.zeros(1, 3, dtype=torch.long), "labels": torch.zeros(1, 3, dtype=torch.long)}] * 3
    with pytest.raises(engine.EngineUsageError, match="MicroBatches of 3 micro-batches; a window of this plan "
                                                      "holds 1 to 2"):
        eng.train_batch(engine.MicroBatches(three), token_loss_sum)
