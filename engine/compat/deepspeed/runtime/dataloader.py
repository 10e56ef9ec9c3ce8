"""DeepSpeed's ``training_dataloader`` (what ``initialize(training_data=...)`` returns): :class:`MicroBatchLoader`."""
from __future__ import annotations

from engine.batching.data import DistributedBatches
from engine.batching.microbatch import batch_size, split_batch
from engine.batching.plan import split_evenly
from engine.errors import ConfigError

__all__ = ["MicroBatchLoader"]


class MicroBatchLoader:
    """DeepSpeed's ``training_dataloader``: this rank's micro-batches of a map-style dataset,
    window after window. Each global batch is ``engine.batching.data.DistributedBatches``', cut
    into the plan's A micro-batches. As with DeepSpeed's loader (a ``DistributedSampler``,
    seed 0), every optimizer step sees the samples DeepSpeed's would (split between the ranks
    differently), and a pass starts over in the sampler's epoch, which only ``set_epoch``
    changes: without it every epoch has epoch 0's order, as in DeepSpeed. A pass stopped
    early (``break``) resumes where it stopped."""

    def __init__(self, dataset, plan, *, collate_fn=None, drop_last: bool = False, seed: int = 0):
        if plan.is_data_defined:
            raise ConfigError(["training_data: batching a dataset needs train_batch_size or "
                               "train_micro_batch_size_per_gpu in the config"])
        try:
            self.batches = DistributedBatches(dataset, plan, shuffle=True, seed=seed, drop_last=drop_last,
                                              collate_fn=collate_fn)
        except ValueError as error:
            raise ConfigError([f"training_data: {error} (drop_last is the config's dataloader_drop_last)"]) from None
        self.accumulation = plan.gradient_accumulation_steps
        self.sampler_epoch = 0  # DeepSpeed's sampler's epoch: set_epoch alone changes it

    @property
    def data_sampler(self) -> MicroBatchLoader:
        """What DeepSpeed's loader calls its sampler: ``set_epoch(e)`` (and ``epoch``) here."""
        return self

    @property
    def epoch(self) -> int:
        return self.sampler_epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler_epoch = epoch
        self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches) * self.accumulation

    def __iter__(self):
        if self.batches.step == 0:  # a new pass: the sampler's epoch again, not the next one
            self.batches.set_epoch(self.sampler_epoch)
        for batch in self.batches:
            yield from split_batch(batch, split_evenly(batch_size(batch), self.accumulation))
