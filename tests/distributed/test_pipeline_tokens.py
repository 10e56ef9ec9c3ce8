"""``micro_batch_tokens`` under a pipeline against the float64 full-batch reference (the
token-weighted loss over the real tokens): pipeline 2 on 2 ranks (1F1B, GPipe, interleaved)
and pipeline 2 × data 2 on 4 ranks (ZeRO 0 and 3). torch's stages run one shape per step, so a
window's micro-batches are cut to its bucket length (``engine.batching.token_budget``, "One
shape per window"); windows of other buckets build schedules of their own, counted here.
The model mixes positions causally, so cutting at the bucket is exact only for right padding.
Batches padded per rank (to their own longest row) are extended to the common shape with their
own padding; a rank of full rows that would need extending stops every rank with an error.

Broken variants that must miss the tolerance: each micro-batch's token mean (micro-batches
weighted alike, DeepSpeed #4777's usual workaround) and a count that includes the padding."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.batching.token_budget import (MicroGroup, bucket_length, group_uniformly, one_shape_cost,
                                         one_shape_micro_steps)
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, sgd, state

TOL = 1e-10
MISSED = 1e-4
VOCAB, WIDTH, T = 11, 8, 16


class CausalMix(torch.nn.Module):
    """Each position adds the mean of the positions up to it: padding after a row's real tokens
    leaves their outputs unchanged, padding before them would not."""

    def forward(self, x):
        steps = torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[None, :, None]
        return x + x.cumsum(1) / steps


def causal_lm(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, WIDTH), torch.nn.Linear(WIDTH, WIDTH), CausalMix(),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, VOCAB)).double()


def batch_of(lengths, seed):
    """(tokens, {labels, attention_mask}), right-padded to T; labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    tokens = torch.randint(1, VOCAB, (len(lengths), T), generator=g) * mask
    labels = torch.randint(0, VOCAB, (len(lengths), T), generator=g).masked_fill(mask == 0, -100)
    return tokens, {"labels": labels, "attention_mask": mask}


def windows(data_ranks):
    """Four global batches: mixed lengths (bucket 16); short rows (bucket 8; 16 on the last data rank);
    mixed again (its schedule reused); one row per rank (1F1B's two micro-batches: zero-weight)."""
    rows = 8 * data_ranks
    g = torch.Generator().manual_seed(5)
    mixed = torch.randint(1, T + 1, (rows,), generator=g).tolist()
    short = torch.randint(1, 6, (rows,), generator=g).tolist()
    if data_ranks > 1:
        short[-1] = T  # the last data rank's share stays at bucket 16
    again = torch.randint(1, T + 1, (rows,), generator=g).tolist()
    single = torch.randint(1, T + 1, (data_ranks,), generator=g).tolist()
    return [batch_of(lengths, seed) for seed, lengths in enumerate((mixed, short, again, single))]


def token_sum(outputs, labels):
    loss = F.cross_entropy(outputs.flatten(0, 1), labels["labels"].flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels["labels"] != -100).sum()


def token_mean_per_micro_batch(outputs, labels):
    """Broken: each micro-batch's token mean, weighted by its rows (near-equal under one shape)."""
    loss, count = token_sum(outputs, labels)
    return loss / count


def padding_counted(outputs, labels):
    """Broken: every position of the micro-batch counted, its bucket padding included."""
    return token_sum(outputs, labels)[0], labels["labels"].numel()


def reference(model, batches):
    """Plain PyTorch on each whole global batch: the mean over its real tokens."""
    model, losses = copy.deepcopy(model), []
    optimizer = sgd(model.parameters())
    for tokens, labels in batches:
        optimizer.zero_grad()
        loss, count = token_sum(model(tokens), labels)
        (loss / count).backward()
        losses.append(float(loss.detach() / count))
        optimizer.step()
    return model, losses


def share(batch, eng, dynamic=False):
    """This data-parallel rank's contiguous rows (every stage of a replica gets the same);
    ``dynamic``: padded to its own longest row, as a collate padding each batch does."""
    sizes = engine.batching.plan.split_evenly(batch[0].shape[0], eng.plan.world_size)
    start = sum(sizes[:eng.plan.rank])
    rows = slice(start, start + sizes[eng.plan.rank])
    columns = slice(0, int(batch[1]["attention_mask"][rows].sum(1).max()) if dynamic else T)
    return batch[0][rows, columns], {key: value[rows, columns] for key, value in batch[1].items()}


def computed(batch, micro_steps, data_ranks):
    """Tokens a window computes: on every rank, its micro-batches cut to the bucket of the
    longest row of any rank and padded to the most rows any rank's micro-batches hold."""
    length = bucket_length(int(batch[1]["attention_mask"].sum(1).max()), 32)
    rows = -(-max(engine.batching.plan.split_evenly(batch[0].shape[0], data_ranks)) // micro_steps)
    return data_ranks * micro_steps * rows * length


def train(rank, world, *, schedule="1f1b", zero=0, loss_fn=token_sum, dynamic=False):
    data_ranks = world // 2
    batches, model = windows(data_ranks), causal_lm()
    expected, reference_losses = reference(model, batches)
    settings = {"train_batch_size": 8 * data_ranks, "micro_batch_tokens": 32,
                "pipeline": {"stages": 2, "schedule": schedule}, "zero_optimization": {"stage": zero}}
    eng = engine.initialize(copy.deepcopy(model), settings, optimizer=sgd)
    losses, steps, built, tokens = [], [], [], []
    for batch in batches:
        losses.append(eng.train_batch(share(batch, eng, dynamic), loss_fn))
        window = eng.last_window
        steps.append(window.micro_steps)
        built.append(eng.strategy.schedules.built)
        tokens.append((window.real_tokens, window.padded_tokens))
    result = {"diff": max_param_diff(eng.full_state_dict(), state(expected)),
              "loss_diff": max(abs(a - b) for a, b in zip(losses, reference_losses)),
              "steps": steps, "built": built, "tokens": tokens,
              "real": [int(b[1]["attention_mask"].sum()) for b in batches],
              "computed": [computed(b, a, data_ranks) for b, a in zip(batches, steps)],
              "counters": (eng.global_steps, eng.micro_steps, eng.global_samples),
              "eval_diff": abs(eng.eval_batch(share(batches[0], eng, dynamic), token_sum)
                               - float(token_sum(expected(batches[0][0]), batches[0][1])[0]
                                       / batches[0][1]["attention_mask"].sum()))}
    eng.close()
    return result


def assert_exact(per_rank, micro_steps):
    for result in per_rank:
        assert result["diff"] < TOL, result
        assert result["loss_diff"] < TOL, result
        assert result["eval_diff"] < TOL, result
        assert result["steps"] == micro_steps, result
        assert result["counters"] == (4, sum(micro_steps), sum(8 * (len(per_rank) // 2) for _ in range(3))
                                      + len(per_rank) // 2)
        # the real tokens over every rank; the padded ones what the schedule computed: one shape on every rank
        assert [real for real, _ in result["tokens"]] == result["real"], result
        assert [padded for _, padded in result["tokens"]] == result["computed"], result


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_token_budget_under_two_stages_is_exact_and_builds_a_schedule_per_bucket():
    scenarios = {schedule: functools.partial(train, schedule=schedule) for schedule in ("1f1b", "gpipe", "interleaved")}
    scenarios["token mean per micro-batch"] = functools.partial(train, loss_fn=token_mean_per_micro_batch)
    scenarios["padding counted"] = functools.partial(train, loss_fn=padding_counted)
    results = run_scenarios(scenarios, world_size=2, timeout=280)
    # budget 32: bucket 16 -> 2 rows (4 micro-batches of 8 rows), bucket 8 -> 4 rows (2); one row: 1F1B runs
    # two micro-batches (the second a zero-weight step), GPipe and interleaved one
    assert_exact(results["1f1b"], [4, 2, 4, 2])
    assert [r["built"] for r in results["1f1b"]] == [[1, 2, 2, 3]] * 2  # the third window reuses the first's
    assert_exact(results["gpipe"], [4, 2, 4, 1])
    assert_exact(results["interleaved"], [4, 2, 4, 1])
    for name in ("token mean per micro-batch", "padding counted"):
        assert all(result["diff"] > MISSED for result in results[name]), name


def full_rows_refused(rank, world):
    """One data rank's batch of full rows (nothing to extend it with) shorter than the shape
    another rank needs: every rank raises the same error, none waits in a collective."""
    eng = engine.initialize(causal_lm(), {"train_batch_size": 8 * (world // 2), "micro_batch_tokens": 32,
                                          "pipeline": {"stages": 2}}, optimizer=sgd)
    tokens, labels = batch_of([16, 3, 5, 9] * 2 if eng.plan.rank == 0 else [6] * 8, seed=0)
    width = T if eng.plan.rank == 0 else 6
    try:
        eng.train_batch((tokens[:, :width], {key: value[:, :width] for key, value in labels.items()}), token_sum)
    except engine.errors.EngineUsageError as error:
        return str(error)
    finally:
        eng.close()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_token_budget_under_pipeline_and_data_parallel_is_exact():
    scenarios = {f"zero {zero}": functools.partial(train, zero=zero) for zero in (0, 3)}
    # each rank's batch padded to its own longest row: the shorter ones extended with their own padding
    scenarios["zero 3, dynamic padding"] = functools.partial(train, zero=3, dynamic=True)
    scenarios["token mean per micro-batch"] = functools.partial(train, loss_fn=token_mean_per_micro_batch)
    scenarios["full rows"] = full_rows_refused
    results = run_scenarios(scenarios, world_size=4, timeout=280)
    assert all("16 columns here" in message and "has 6 columns and no padding to extend it with" in message
               and "padding='max_length'" in message for message in results["full rows"]), results["full rows"]
    # the second window: one data rank's rows are short (4 per micro-batch), the other's not; they agree on 4
    for name in ("zero 0", "zero 3", "zero 3, dynamic padding"):
        assert_exact(results[name], [4, 4, 4, 2])
    assert all(result["diff"] > MISSED for result in results["token mean per micro-batch"])


def test_one_shape_per_window_keeps_the_budget_and_few_lengths():
    # 2^k x (1, 1.5): at most half more columns, two lengths per octave
    assert [bucket_length(n, 4096) for n in (1, 3, 5, 9, 16, 17, 100, 512, 513, 1500)] == \
        [1, 3, 6, 12, 16, 24, 128, 512, 768, 1536]
    assert bucket_length(1500, 4096, cap=1500) == 1500  # a batch of full rows is not extended
    assert bucket_length(600, 1000) == 768 and bucket_length(900, 1000) == 1000  # never over a budget it fits
    assert bucket_length(1200, 1000) == 1536  # a row over the budget runs alone, at a bucket length
    # a batch padded to fewer columns than the shape: extended with its own padding (a row not full)
    tokens, labels = batch_of([5, 2, 3], seed=0)
    batch = (tokens[:, :5], {key: value[:, :5] for key, value in labels.items()})
    layout = engine.batching.token_budget.sequence_layout(batch)
    inputs, extended = engine.batching.token_budget.take_rows(batch, layout, MicroGroup((0, 1), 8, 7))
    assert inputs.shape == (2, 8) and inputs[:, 5:].eq(0).all() and inputs[:, :5].equal(tokens[:2, :5])
    assert extended["labels"][:, 5:].eq(-100).all() and extended["attention_mask"][:, 5:].eq(0).all()
    assert extended["labels"][:, :5].equal(labels["labels"][:2, :5])
    assert one_shape_micro_steps(8, 16, 32) == 4
    assert one_shape_micro_steps(8, 8, 32, max_rows=3) == 3  # the rows cap
    assert one_shape_micro_steps(3, 32, 16) == 3  # over the budget: one row each
    lengths = [16, 3, 9, 1, 5, 12, 2, 7]
    groups = group_uniformly(lengths, 16, 32, 5)  # 5 agreed: rows split 2, 2, 2, 1, 1
    assert [g.rows for g in groups] == [(0, 1), (2, 3), (4, 5), (6,), (7,)]
    assert {g.length for g in groups} == {16} and sum(g.real_tokens for g in groups) == sum(lengths)
    cost = one_shape_cost(groups, 2)  # every micro-batch computed at 2 rows x 16
    assert (cost.micro_steps, cost.real_tokens, cost.padded_tokens) == (5, 55, 160)
    padded = group_uniformly([4, 2], 4, 32, 3)  # fewer rows than micro-steps: a zero-weight repeat
    assert [(g.rows, g.samples, g.length) for g in padded] == [((0,), 1, 4), ((1,), 1, 4), ((1,), 0, 4)]
    with pytest.raises(engine.errors.BatchError, match="would cut rows of 16 tokens"):
        group_uniformly(lengths, 8, 32, 4)
    with pytest.raises(engine.errors.BatchError, match="micro_batch_tokens must be a positive integer"):
        one_shape_micro_steps(8, 16, 0)
