"""``from deepspeed.accelerator import get_accelerator``: DeepSpeed's device abstraction for
the device Microstep trains on (CUDA when available, else the CPU).

The methods DeepSpeed's examples call: device names and selection, seeding, synchronising,
memory statistics, the communication backend's name. On the CPU the memory statistics are
those of CUDA's allocator, which does not run there: 0.
"""
from __future__ import annotations

import torch

__all__ = ["get_accelerator", "Accelerator"]


class Accelerator:
    """CUDA when ``torch.cuda.is_available()``, else the CPU."""

    def __init__(self):
        self._cuda = torch.cuda.is_available()
        self._name = "cuda" if self._cuda else "cpu"

    # -- devices --------------------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """``'cuda'`` / ``'cuda:N'``, or ``'cpu'`` (whatever the index, as DeepSpeed's CPU accelerator)."""
        if device_index is None or not self._cuda:
            return self._name
        return f"cuda:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True  # the CPU always is

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    # -- random numbers ---------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def random(self):
        return torch.random

    # -- memory (CUDA's allocator; 0 on the CPU) --------------------------------------------------
    def _memory(self, name: str, device_index: int | None) -> int:
        return getattr(torch.cuda, name)(device_index) if self._cuda else 0

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._memory("memory_allocated", device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._memory("max_memory_allocated", device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._memory("memory_reserved", device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._memory("max_memory_reserved", device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The one accelerator of this process."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
