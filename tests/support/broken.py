"""Known-wrong engines, to show that a correctness test would catch the bug it is about.

Each function takes an engine and breaks it in place, by wrapping one method of its strategy
(the interface the engine drives: ``backward(loss, weight)``, ``step(multiplier, max_norm,
want_norm, grad_squares)``, ``discard_window()``) on that one instance. A test runs its scenario once as it
is (within the tolerance of the full-batch reference) and once broken (outside it).
"""

from __future__ import annotations

import contextlib
import types

import torch

from engine.strategies.model_transforms import CheckpointSwitch
from engine.window.model_loss import NoModelLoss


def intact(eng):
    return eng


def weighted_one_over_a(eng):
    """The fixed weighting of a naive accumulation loop (DeepSpeed's ``loss / A``): every
    micro-batch loss divided by the accumulation steps and gradients averaged over ranks,
    whatever the micro-batch, the rank or the window really holds. Exact only for equal
    micro-batches on equal ranks in full windows of mean losses."""
    strategy = eng.strategy
    backward, step = strategy.backward, strategy.step
    strategy.backward = lambda loss, weight: backward(loss, 1.0 / eng.plan.gradient_accumulation_steps)
    strategy.step = lambda multiplier, max_norm, want_norm=False, grad_squares=None: \
        step(1.0, max_norm, want_norm, grad_squares)
    return eng


def accounting_without_window_total(eng):
    """The one accounting (engine.accounting) broken: the boundary multiplier G / U left out,
    so a window of (sum, count) losses — the model's own loss read as one — is divided by the planned
    samples instead of its items, on whatever mesh and backend asks it."""
    eng.accounting.boundary_multiplier = lambda item_weighted, units, samples: 1.0
    return eng


def ignores_window_total(eng):
    """A window's gradient divided by the planned global batch instead of the samples (or
    token count) it really holds: a short window is weighted as a full one (its gradient
    shrinks with it, as with a fixed 1/A over fewer micro-steps), token losses by samples."""
    strategy = eng.strategy
    step = strategy.step
    strategy.step = lambda multiplier, max_norm, want_norm=False, grad_squares=None: \
        step(1.0, max_norm, want_norm, grad_squares)
    return eng


def gradient_doubled(eng):
    """Every gradient twice too large: a constant factor, which AdamW all but hides and SGD
    with momentum does not."""
    strategy = eng.strategy
    backward = strategy.backward
    strategy.backward = lambda loss, weight: backward(loss, 2.0 * weight)
    return eng


def gradient_ten_percent_too_large(eng):
    """Every gradient 10% too large: what a bf16 tolerance loose enough for rounding must still catch."""
    strategy = eng.strategy
    backward = strategy.backward
    strategy.backward = lambda loss, weight: backward(loss, 1.1 * weight)
    return eng


def clipped_each_micro_step(eng):
    """Clipping after every micro-step's backward (a loop calling ``clip_grad_norm_`` before
    each ``step()``) instead of once on the window's whole gradient. Unsharded models."""
    strategy, max_norm = eng.strategy, eng.config.gradient_clipping
    backward = strategy.backward

    def clipping(loss, weight):
        backward(loss, weight)
        torch.nn.utils.clip_grad_norm_(eng.module.parameters(), max_norm)

    strategy.backward = clipping
    return eng


def keeps_failed_windows(eng):
    """A window abandoned mid-way (a raising loss function, an out-of-memory) keeps its
    gradients: they leak into the next window. Unsharded models."""
    eng.strategy.discard_window = lambda: None
    return eng


def votes_alone(eng):
    """The automatic micro size deciding on each rank's own failures (no vote): only the rank
    that ran out of memory shrinks."""
    eng.strategy.agree_on_failures = lambda failure: {eng.rank: failure} if failure else {}


def checkpointing_switch_ignored(eng, ranks=None):
    """``activation_checkpointing: auto`` whose tuner flips a switch the blocks do not read, on
    ``ranks`` (all when None): checkpointing turned on in name only, there."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if ranks is None or rank in ranks:
        eng.micro_batch_tuner.switch = CheckpointSwitch()
    return eng


def summed_micro_batches(eng):
    """Under a pipeline, micro-batch gradients summed instead of averaged (DeepSpeed #7773): every
    micro-batch loss counted A times too much, so the gradient (and its norm) is A times too large."""
    schedules = eng.strategy.schedules
    run = schedules.run

    def summing(inputs, micro_batches, loss_fn, **options):
        return run(inputs, micro_batches, lambda outputs, index: loss_fn(outputs, index) * micro_batches, **options)

    schedules.run = summing
    return eng



def _colwise_without_input_reduction():
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel

    class ColwiseWithoutInputReduction(ColwiseParallel):
        def _apply(self, module, device_mesh):
            distribute_module(module, device_mesh, self._partition_linear_fn)  # parameters only

            def forward(x):  # local pieces: the input's gradient is never reduced
                bias = module.bias.to_local() if module.bias is not None else None
                return torch.nn.functional.linear(x, module.weight.to_local(), bias)

            module.forward = forward
            return module

    return ColwiseWithoutInputReduction()


def unreduced_replicated_gradients(plan: dict) -> dict:
    """A tensor-parallel plan whose column-split layers do not all-reduce their input's
    gradient over the tensor group (Megatron's "f" operator left out): the gradient reaching
    the replicated layers before them (the norms) is each rank's partial sum, so those
    replicated parameters get unreduced gradients and drift apart. Pass it as
    ``engine.initialize(..., tensor_plan=...)`` (built in the rank: styles do not pickle)."""
    return {pattern: _colwise_without_input_reduction() if style == "colwise" else style
            for pattern, style in plan.items()}


def context_shard_means(eng):
    """Context parallelism with each rank's loss taken as the mean over its part of the
    sequences, weighted like any mean (by samples): parts holding few real tokens count as
    much as full ones (the mean-per-shard mistake): neither the context's reading nor the model's
    own loss's (engine.window.model_loss) turns it back into a sum."""
    eng.context.item_weighted = lambda output: output
    eng.losses.model = NoModelLoss()
    return eng


def context_ranks_left_out(eng):
    """Context parallelism whose micro-step weights count the data ranks only (W = data, not data ×
    context): the gradients averaged over data × context ranks are not multiplied back by the
    parts that add up to one sequence."""
    mesh = eng.accounting.mesh
    eng.accounting.mesh = types.SimpleNamespace(size=lambda dims: mesh.size(tuple(d for d in dims if d != "context")))
    return eng


def pipeline_positions_not_handed(eng):
    """Packed rows under a pipeline whose stages are not handed the rows' restarting positions: the model
    numbers each row 0..S-1, one causal mask over the whole row, attention crosses documents."""
    eng.strategy.schedules.positions = lambda positions: contextlib.nullcontext
    return eng


def context_window_ignored(eng):
    """Ulysses attending over the whole sequence with a plain causal mask, a sliding window shorter than the
    sequence dropped (what it did before it read the window): every token sees all that precedes it."""
    import engine.context.ulysses as ulysses

    ulysses.window_mask = lambda length, window, dtype, device: ulysses.causal_mask(length, dtype, device)
    return eng


def context_shift_after_split(eng):
    """Context parallelism with the labels shifted inside each rank's part after the split
    (counts local to the shard): the target across each seam is lost and the tail chunk's
    targets are shifted into its head's."""
    context = eng.context
    shard = context.shard

    def split_then_shift(batch):
        context.shift = False
        sharded = shard(batch)
        context.shift = True
        labels = sharded["labels"]
        shifted = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
        sharded["labels"] = sharded["shift_labels"] = shifted
        context._tokens = (shifted != -100).sum()
        sharded["num_items_in_batch"] = context._tokens.clamp(min=1)
        return sharded

    context.shard = split_then_shift
    return eng


def context_one_mask_per_row(eng):
    """Packed rows under context parallelism attended with one causal mask over each whole row:
    a document's tokens attend to the documents before it in the row."""
    context = eng.context
    shard = context.shard

    def shard_without_documents(batch):
        part = shard(batch)
        context.exchange.documents = None
        return part

    context.shard = shard_without_documents
    return eng


def ring_merge_without_rescale(output, logsumexp, block_output, block_logsumexp):
    """Ring attention's block merge (``engine.context.ring.merge_block``) weighing each new block
    against the merged log-sum-exp but leaving what was summed before as it was (not rescaled by
    e^(old − new log-sum-exp))."""
    merged = torch.logaddexp(logsumexp, block_logsumexp)
    safe = torch.where(torch.isfinite(merged), merged, torch.zeros_like(merged))
    return output + block_output * torch.exp(block_logsumexp - safe)[..., None], merged


def context_positions_reset_per_part(eng):
    """Packed rows under context parallelism whose positions restart at 0 in every rank's part (as
    if a part were a sequence of its own): rotary embeddings see the wrong places."""
    context = eng.context
    shard = context.shard

    def shard_restarting_positions(batch):
        part = shard(batch)
        positions = part["position_ids"]
        part["position_ids"] = torch.arange(positions.shape[1]).expand_as(positions)
        return part

    context.shard = shard_restarting_positions
    return eng


def moe_micro_batch_term(eng):
    """Each forward's own load-balancing term (what the model computes alone, and what DeepSpeed-MoE
    and a plain accumulation loop use): fᵢ and the token count of one micro-batch on one rank."""
    eng.experts.load_balance = "micro_batch"
    return eng


def moe_counts_of_this_part(eng):
    """Global balance under context parallelism with each rank's router counts taken over its own
    part of the sequences (not summed over the context group): the term of a part, not of the batch."""
    eng.experts._all_reduce_sum = lambda counts: counts
    return eng


def moe_running_average(eng):
    """Megatron's ``global_aux_loss``: micro-batch k's term uses the counts of micro-batches 1..k of the
    window (summed over the data ranks), not the whole window's."""
    from engine.experts.terms import scoped
    from engine.experts.window import _Global

    experts = eng.experts

    def counted_forward(k, micro_batch, run):
        window = experts._window
        seen, _ = experts._window_counts(window.counted[:k + 1], [])
        with scoped(_Global(seen, window.factors[k])):
            return run(micro_batch)

    experts._counted_forward = counted_forward
    experts.global_counts = "count_forward"
    return eng


def moe_bias_from_one_micro_batch(eng):
    """Aux-loss-free bias moved by the load of the window's last micro-batch alone (a per-micro-batch
    update), not the whole window's."""
    routers = eng.experts.bias_routers
    counting = routers.counting

    def last_only(forward):
        counted = counting(forward)

        def run(micro_batch):
            routers._loads = [None] * len(routers.routers)
            return counted(micro_batch)
        return run

    routers.counting = last_only
    return eng


def moe_bias_from_this_rank(eng):
    """Aux-loss-free bias moved by this rank's load only (no sum over the data ranks)."""
    routers = eng.experts.bias_routers
    window_load = routers.window_load
    routers.window_load = lambda all_reduce_sum: window_load(lambda tensor: tensor)
    return eng


def moe_term_per_stage(eng):
    """Global balance under a pipeline without the stages' exchange of router counts: each stage's routers
    get the gradient of a term over their own counts (C and R of its layers on this rank), the last stage's
    loss the value of its own."""
    routers = eng.executor.hooks.routers
    window_term = routers.window_term
    routers.window_term = lambda counts, weight: window_term(routers.window_counts().to(counts.device), weight)
    return eng


def moe_pipeline_weight_without_ranks(eng):
    """The weight of a term's gradient added beside a pipeline's loss with a divisor missing the data
    dimension: U / G instead of U · W / G (exact on one data rank only)."""
    accounting = eng.accounting
    accounting.outside_loss_weight = lambda units: units / accounting.weighting_batch()
    return eng


def experts_averaged_over_the_expert_group(eng):
    """Expert parallelism: each expert gradient averaged over its expert group (as if it were a dense
    gradient the group's ranks each computed) instead of summed: N times too small."""
    shards = eng.strategy.group_held
    reduce = shards.reduce_gradients_

    def averaged(bucket_bytes=None):
        reduce(bucket_bytes)
        for entry in shards.parameters:
            entry.param.grad.div_(shards.size)

    shards.reduce_gradients_ = averaged
    return eng


def experts_not_reduced_over_replicas(eng):
    """Expert parallelism: each expert gradient divided by W but never summed over the ranks holding
    the same experts (each replica steps on its own expert group's tokens alone)."""
    shards = eng.strategy.group_held

    def divided(bucket_bytes=None):
        for entry in shards.parameters:
            if entry.param.grad is None:
                entry.param.grad = torch.zeros_like(entry.param)
            entry.param.grad.div_(shards.divisor)

    shards.reduce_gradients_ = divided
    return eng


def experts_norm_counted_on_every_rank(eng):
    """Expert parallelism: the gradient norm counts each rank's expert slice as if every rank held it
    (the slices' squares divided by the world instead of by their replicas): clipping sees too small a norm."""
    eng.strategy.group_held.slices = lambda param: 1
    return eng


class _KeepsEverything:
    """A held forward as a plain one: nothing recomputed, the whole output kept."""

    running = staticmethod(contextlib.nullcontext)
    kept = staticmethod(lambda output: output)


def moe_held_forward_keeps_everything(eng):
    """Held forwards (``moe.global_counts: hold_forwards``) that keep until the window's backwards all a
    plain forward keeps: the output head's and the loss's saved activations (the log-probabilities)
    and the model's whole output (its logits)."""
    eng.experts.held_forward = _KeepsEverything()
    return eng
