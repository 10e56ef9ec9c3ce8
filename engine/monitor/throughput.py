"""Model FLOPs utilisation (MFU), as the monitor reports it next to tokens/s per device.

MFU = 6 · N · (tokens/s per device) / (the device's peak FLOP/s), where N is the model's
parameter count and 6 · N the FLOPs of one token's forward and backward through its weight
matrices (the usual estimate; attention's own term is left out, so long sequences read a little
low). The peak is the device's dense bf16 figure (what torchtitan and Megatron compare
against, whatever precision the run uses), known for the NVIDIA / AMD data-centre GPUs below;
``monitor.peak_flops`` gives it for any other device (a CPU, a GPU not listed). Without a known
peak, or without token counts, MFU is not reported.
"""

from __future__ import annotations

import torch

# Dense bf16 peak FLOP/s by device name (first match wins: more specific names first).
PEAK_BF16_FLOPS = (
    ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12),
    ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
    ("MI300X", 1307e12), ("MI325X", 1307e12), ("MI250X", 383e12),
)


def device_peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of ``device`` when it is a GPU listed in ``PEAK_BF16_FLOPS``."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for known, peak in PEAK_BF16_FLOPS if known in name), None)


def parameter_count(module: torch.nn.Module) -> int:
    """The whole model's parameters: a sharded parameter (FSDP2's DTensor) counts its global
    size, a DeepSpeed ZeRO-3 placeholder its ``ds_numel``."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in module.parameters())


def flops_per_token(module: torch.nn.Module) -> float:
    return 6.0 * parameter_count(module)


def model_flops_utilisation(flops_per_token_: float, tokens_per_s_per_device: float, peak: float) -> float:
    """The fraction of the peak the model's FLOPs reach (0.4 = 40% MFU)."""
    return flops_per_token_ * tokens_per_s_per_device / peak
