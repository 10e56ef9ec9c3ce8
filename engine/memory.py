"""Memory, measured the same way everywhere it is used: the automatic micro-batch size, the
``defer_reduction: auto`` decision, the monitor's ``peak_memory_mb`` and the benchmarks.

*Held bytes*: the bytes of the distinct tensor storages a strategy holds for training —
parameters, gradients, optimizer state and a sharding framework's gathered copies
(``Strategy.held_tensors``). Deterministic, so tests can assert on it.

*Peak of a micro-step*: on CUDA, the allocator's peak (``torch.cuda.max_memory_allocated``).
CPU has no allocator peak counter, so there it is the held bytes at the end of the forward,
plus the activations the forward saved for backward (storages not held already and not freed
by then: a weight saved for backward counts once, a gathered copy ZeRO-3 freed not at all), plus
the gradients the backward has yet to allocate. Both are bytes of tensors (never the process's resident set size).
"""

from __future__ import annotations

import contextlib
import os

import torch


def storages(tensors) -> dict[int, int]:
    """{address: bytes} of the distinct storages behind ``tensors`` (DTensors count their local
    shard; None entries are skipped; views of one storage count once)."""
    found: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = tensor.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (see ``storages``)."""
    return sum(storages(tensors).values())


def format_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024


def held_bytes(strategy) -> int:
    return storage_bytes(strategy.held_tensors())


def memory_limit_bytes(limit: float | None, device: torch.device) -> int | None:
    """A configured limit in bytes: > 1 is bytes, (0, 1] a fraction of device memory (on
    CPU, of the machine's physical memory); None stays None."""
    if limit is None:
        return None
    if limit > 1:
        return int(limit)
    return int(limit * device_memory_bytes(device))


def device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _still_held(saved_storages) -> dict[int, int]:
    """Bytes by address of the storages a forward saved that are still held at its end."""
    held = {}
    for storage in saved_storages:
        try:
            if storage.nbytes():
                held[storage.data_ptr()] = storage.nbytes()
        except RuntimeError:  # invalidated since it was saved (a tensor-parallel layer's temporary): freed
            continue
    return held


class PeakMeter:
    """Peak memory over a span of micro-steps: ``start()``, run each forward inside
    ``forward()``, then read ``peak`` (bytes, see the module docstring)."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.device = strategy.device
        self._cpu_peak = 0

    def start(self) -> None:
        self._cpu_peak = 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def forward(self):
        if self.device.type == "cuda":  # the allocator keeps the peak itself
            yield
            return
        # Storages are read once the forward is through: ZeRO-3 has freed the gathered weights a
        # block saved by then (and a freed address may have been reused, so none is keyed early).
        saved_storages = []
        wrappers: dict[int, int] = {}

        def pack(tensor):
            # A DTensor saved by a tensor-parallel layer holds this rank's piece only.
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            try:
                saved_storages.append(local.untyped_storage())
            except RuntimeError:  # a wrapper without a storage of its own (an async collective's result)
                wrappers[id(local)] = local.numel() * local.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        saved = _still_held(saved_storages)
        # distinct storages: a weight saved for backward is a parameter already held, not an activation
        now = (sum({**storages(self.strategy.held_tensors()), **saved}.values()) + sum(wrappers.values())
               + self._gradients_to_come())
        self._cpu_peak = max(self._cpu_peak, now)

    @property
    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self._cpu_peak

    def _gradients_to_come(self) -> int:
        # .grad of the parameter itself: a DTensor's local tensor is not a leaf (reading its
        # .grad warns, and is always None)
        total = 0
        for p in self.strategy.module.parameters():
            if p.requires_grad and p.grad is None:
                local = p.to_local() if hasattr(p, "to_local") else p
                total += local.numel() * local.element_size()
        return total
