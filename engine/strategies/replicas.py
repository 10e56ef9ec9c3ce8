"""Replicas whose gradients are averaged once, at the window's end: one process, ZeRO 0 / 1 with
low-precision parameters, and ZeRO 0 / 1 on a mesh with a tensor dimension.

Each rank of the gradient-reduction group (data × context) holds the whole model — its tensor
pieces where layers are split over the tensor dimension (``engine.strategies.parallelize``).
Nothing is reduced inside a window: the used gradients are averaged over the group after its
closing backward, in buckets (``TorchStrategy.average_gradients``), one all-reduce per window
whatever its micro-steps and none a failing rank could leave a peer waiting in. At ZeRO 1 the
optimizer state is owned (``engine.strategies.zero1``).

Low-precision parameters (``bf16`` / ``fp16`` without ``torch_autocast``, on a mesh of data
ranks): the model computes in a half-precision copy (``engine.precision.compute_copy``), the
optimizer updates the fp32 masters, whose gradients are the ones averaged. DDP is not used there:
its buckets would hold (and all-reduce) the half-precision gradients. The price against DDP under
autocast is that the all-reduce does not overlap the last backward; docs/config.md says when
autocast is the better choice.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from engine.strategies.base import TorchStrategy, repoint_optimizer
from engine.strategies.capabilities import fixed
from engine.strategies.zero1 import optimizer_state


class Replicas(TorchStrategy):
    def capabilities(self):
        # No collective of its own inside a window (the averaging follows its closing backward): the
        # check before that backward is its only one, unless the split model exchanges in its forwards;
        # its forwards may all run first, the replicas being averaged after the window anyway.
        return replace(super().capabilities(), can_hold_forwards=True,
                       communicates_before_closing_backward=fixed(self._split_model_exchanges()))

    def setup(self, module, optimizer):
        self.module = module.to(self.device)
        self.start_equal(self.module)
        # Half-precision parameters are autocast under a tensor mesh (engine.config.setup): never both here.
        self.compute_copy = self.precision.compute_copy(self.module)
        if self.compute_copy is not None:
            self.parallelize(self.compute_copy.model)
            self.forward_module = self.compute_copy.module
        else:
            names = {id(p): name for name, p in self.module.named_parameters()}
            self.parallelize(self.module)
            if self.mesh.tensor > 1:  # the split layers' parameters are new DTensors
                repoint_optimizer(optimizer, names, self.module)
            self.forward_module = self.module
        self.optimizer = optimizer
        self.owned = optimizer_state(self, self.module, optimizer)

    def reduce_gradients(self):
        if self.compute_copy is not None:
            self.compute_copy.move_gradients_to_masters()
        self.average_gradients()

    def optimizer_step(self):
        self.owned.step()
        if self.compute_copy is not None:
            self.compute_copy.refresh()

    @contextlib.contextmanager
    def gathered(self, modifier_rank):
        with super().gathered(modifier_rank):
            yield
        if self.compute_copy is not None:
            self.compute_copy.refresh()  # the masters may have changed: so does the half-precision copy

    def zero_grad(self):
        super().zero_grad()
        if self.compute_copy is not None:
            self.compute_copy.zero_grad()

    def held_tensors(self):
        held = super().held_tensors()
        return held if self.compute_copy is None else held + self.compute_copy.held_tensors()

    def load_training_state(self, directory):
        super().load_training_state(directory)
        if self.compute_copy is not None:
            self.compute_copy.refresh()
