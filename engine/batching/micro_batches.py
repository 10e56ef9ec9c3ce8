"""A window handed to ``train_batch`` as the micro-batches it holds, cut and collated already.

A data loader that collates every micro-batch on its own (a Trainer's: each padded to its own
longest row, or packed into one row of its own length) gives micro-batches that cannot be stacked
into one per-device batch without padding them again, which would change what a packed row's
routers count. :class:`MicroBatches` hands them over as they are: ``train_batch`` runs each one
as one micro-step, counting for its rows, and weights the window by what they hold (fewer than
the plan's micro-steps at the end of an epoch make a short window). A micro-batch's rows are its
batch dimension; one that also carries per-batch vectors (a packed row's document boundaries,
``cu_seq_lens``) counts the rows of its tensors of two or more dimensions.
"""

from __future__ import annotations

from engine.batching.microbatch import batch_size, tensor_leaves
from engine.batching.plan import BatchPlan
from engine.batching.window_split import Split
from engine.errors import BatchError, EngineUsageError


class MicroBatches(tuple):
    """``eng.train_batch(MicroBatches([mb0, mb1, ...]), loss_fn)``: one window of these micro-batches."""

    def split(self, plan: BatchPlan) -> Split:
        """The window's micro-steps: one per micro-batch, at most the plan's accumulation steps."""
        accumulation = plan.gradient_accumulation_steps
        if not 0 < len(self) <= accumulation:
            raise EngineUsageError(
                f"train_batch() got MicroBatches of {len(self)} micro-batches; a window of this plan holds 1 to "
                f"{accumulation} (gradient_accumulation_steps)")
        return Split(len(self), [(micro_batch, rows(micro_batch)) for micro_batch in self])


def rows(micro_batch) -> int:
    """The micro-batch's batch size; failing one shared by every tensor, the one its tensors of two or more
    dimensions share."""
    try:
        return batch_size(micro_batch)
    except BatchError:
        sizes = {t.shape[0] for _, t in tensor_leaves(micro_batch) if t.dim() >= 2}
        if len(sizes) != 1:
            raise
        return sizes.pop()
