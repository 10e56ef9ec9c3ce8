"""Evaluation without a pipeline: the model's forwards over a batch's micro-batches, the mean loss
over every rank (per sample or per item, as ``engine.window.accounting.evaluation_terms`` weighs
each micro-batch)."""

from __future__ import annotations

import torch

from engine.window.accounting import evaluation_terms


@torch.no_grad()
def evaluate_pieces(engine, pieces, loss_fn) -> float:
    """Forwards of ``(micro_batch, samples)`` pieces (0 samples: weight 0) through ``engine`` in eval
    mode, guarded by its window runner (the same number on every rank); one all-reduce of the totals."""
    strategy, context = engine.strategy, engine.context
    total = torch.zeros(2, dtype=torch.float64, device=strategy.device)  # Σ loss × share, Σ units

    def forwards():
        total.zero_()
        for micro_batch, n in pieces:
            # this rank's part of each sequence, weighed by its tokens
            output = context.item_weighted(loss_fn(engine, context.shard(micro_batch)))
            total.add_(torch.stack(evaluation_terms(output, n)).to(total.device))

    was_training = engine.module.training
    engine.module.eval()
    try:
        engine.window_runner.guard(forwards)
    finally:
        engine.module.train(was_training)
        strategy.release_gathered_parameters()
    stats = strategy.all_reduce_sum(total)
    return float(stats[0] / stats[1])
