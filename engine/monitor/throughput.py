"""Model FLOPs utilisation (MFU), as the monitor reports it next to tokens/s per device.

MFU = 6 · N · (tokens/s per device) / (the device's peak FLOP/s), where N is the model's
active parameter count and 6 · N the FLOPs of one token's forward and backward through its weight
matrices (the usual estimate; attention's own term is left out, so long sequences read a little
low). Active: a token passes through top-k of a mixture-of-experts layer's experts, so a module of
experts counts k / E of its parameters (``active_parameter_count``; a Mixtral of 8 experts, top-2,
counts a quarter of its experts). The peak is the device's dense bf16 figure (what torchtitan and Megatron compare
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


def active_parameter_count(module: torch.nn.Module) -> float:
    """The parameters one token passes through: every parameter, except that a module of experts
    counts top-k of its E experts (k / E of its parameters). A module of experts is either Hugging
    Face's form (an integer ``num_experts`` and parameters ``[num_experts, ...]``, at least one a stack
    of matrices; under expert parallelism the rank's own experts and count) or a ``ModuleList`` of
    like modules with "expert" in its name. k is the nearest integer ``top_k`` (the module's own, its
    parent's, a sibling router's), else the model config's ``num_experts_per_tok``, else the one
    ``top_k`` the model's modules agree on; without any, every expert counts."""
    total = float(parameter_count(module))
    parents = {id(child): parent for parent in module.modules() for child in parent.children()}
    fallback = _model_top_k(module)
    counted: list[str] = []
    for name, sub in module.named_modules():
        if any(name.startswith(done + ".") for done in counted):
            continue
        experts = _experts_held(name, sub)
        if not experts:
            continue
        top_k = _nearest_top_k(sub, parents) or fallback
        if top_k is None or top_k >= experts:
            continue
        counted.append(name)
        held = parameter_count(sub)
        total -= held - held * top_k / experts
    return total


def _experts_held(name: str, module: torch.nn.Module) -> int | None:
    experts = getattr(module, "num_experts", None)
    if isinstance(experts, int) and not isinstance(experts, bool) and getattr(module, "top_k", None) is None:
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in module.parameters(recurse=False)]
        if shapes and all(shape and shape[0] == experts for shape in shapes) and any(len(s) >= 3 for s in shapes):
            return experts
    if isinstance(module, torch.nn.ModuleList) and len(module) >= 2 and "expert" in name.lower():
        items = list(module)
        if all(not isinstance(item, (torch.nn.ModuleList, torch.nn.ModuleDict)) and type(item) is type(items[0])
               and [p.shape for p in item.parameters()] == [p.shape for p in items[0].parameters()]
               for item in items) and any(True for _ in items[0].parameters()):
            return len(items)
    return None


def _int_attribute(module, name: str) -> int | None:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _nearest_top_k(module: torch.nn.Module, parents: dict) -> int | None:
    own = _int_attribute(module, "top_k")
    if own:
        return own
    parent = parents.get(id(module))
    if parent is None:
        return None
    return _int_attribute(parent, "top_k") or next(
        (k for sibling in parent.children() if sibling is not module and (k := _int_attribute(sibling, "top_k"))), None)


def _model_top_k(module: torch.nn.Module) -> int | None:
    configured = _int_attribute(getattr(module, "config", None), "num_experts_per_tok")
    if configured:
        return configured
    found = {k for sub in module.modules() if (k := _int_attribute(sub, "top_k"))}
    return found.pop() if len(found) == 1 else None


def flops_per_token(module: torch.nn.Module) -> float:
    """6 · the active parameters (``active_parameter_count``)."""
    return 6.0 * active_parameter_count(module)


def model_flops_utilisation(flops_per_token_: float, tokens_per_s_per_device: float, peak: float) -> float:
    """The fraction of the peak the model's FLOPs reach (0.4 = 40% MFU)."""
    return flops_per_token_ * tokens_per_s_per_device / peak
