"""One process, one model replica: nothing to synchronise."""

from __future__ import annotations

from engine.strategies.base import TorchStrategy


class SingleProcess(TorchStrategy):
    name = "single"
    norm_in_statistics = True  # the statistics' host read decides the non-finite check too

    def setup(self, module, optimizer):
        self.module = module.to(self.device)
        self.transform(self.module)
        self.forward_module = self.module
        self.optimizer = optimizer
