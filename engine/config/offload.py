"""What the torch backend makes of DeepSpeed's offload keys under ``zero_optimization``.

The torch backend offloads with FSDP2's ``CPUOffloadPolicy``: sharded parameters, their
gradients and the optimizer state live on the host, and the optimizer steps there. So:

| request (DeepSpeed keys) | torch backend |
|---|---|
| ``offload_param`` and / or ``offload_optimizer`` to ``cpu``, stage 2 or 3 | CPU offload |
| the same at stage 1 | CPU offload on FSDP2, which shards the parameters too (as stage 2; a note says so) |
| ``offload_param`` or ``offload_optimizer`` alone | CPU offload of both; a note says what else goes to the host |
| ``nvme``, ``ratio`` < 1, ``super_offload``, stage 0 | error |
| ``device: none`` (DeepSpeed's default) | nothing to do |

Every error says how to fix it within the torch backend, and names ``backend: deepspeed`` (which
does all of these) as DeepSpeed is installed or not. ``pin_memory`` (DeepSpeed's default: true)
pins the host copies when there is an accelerator to copy to; the legacy ``cpu_offload`` /
``cpu_offload_param`` / ``cpu_offload_use_pin_memory`` switches mean the same. Other sub-keys
(NVMe buffers, pipelining) have no FSDP2 counterpart: a note names them. This module reads a
``ZeroConfig`` and imports nothing of the engine (a config-layer leaf).
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec

SECTIONS = ("offload_param", "offload_optimizer")
LEGACY = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
LEGACY_PIN = "cpu_offload_use_pin_memory"
KEYS = frozenset(SECTIONS) | frozenset(LEGACY) | {LEGACY_PIN}  # what the torch backend reads
_USED = {"device", "pin_memory", "ratio", "super_offload"}
_DEVICES = ("cpu", "nvme", "none")


def _deepspeed_advice() -> str:
    """The other way out, as it stands on this machine (advice must not lead to another error)."""
    if find_spec("deepspeed") is not None:
        return "or set backend: deepspeed (DeepSpeed's ZeRO-Offload does this)"
    return "or install DeepSpeed (pip install 'microstep[deepspeed]') and set backend: deepspeed"


@dataclass(frozen=True)
class TorchOffload:
    """The torch backend's reading of a ``zero_optimization`` section."""

    to_host: bool = False  # FSDP2 CPU offload: parameters, gradients, optimizer state on the host
    pin_memory: bool = False  # pin the host copies (applies only with an accelerator)
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def _requests(extras: dict, problems: list[str]) -> dict[str, dict]:
    """{section: its settings} for each offload section the config holds (legacy switches
    included), as DeepSpeed reads them."""
    requests = {}
    for section in SECTIONS:
        value = extras.get(section)
        if value is None:
            continue
        if not isinstance(value, dict):
            problems.append(f"zero_optimization.{section}: expected a section such as "
                            f"{{device: cpu, pin_memory: true}}, got {value!r}")
            continue
        requests[section] = value
    for switch, section in LEGACY.items():
        if extras.get(switch) is True and section not in requests:
            requests[section] = {"device": "cpu", "pin_memory": extras.get(LEGACY_PIN) is True}
    return requests


def torch_offload(zero) -> TorchOffload:
    """Read ``zero`` (a ``ZeroConfig``: ``stage`` and DeepSpeed's keys in ``model_extra``)."""
    extras = zero.model_extra or {}
    problems: list[str] = []
    notes: list[str] = []
    requests = _requests(extras, problems)
    deepspeed = _deepspeed_advice()
    to_host = {}
    for section, settings in requests.items():
        device = settings.get("device", "none")
        if device not in _DEVICES:
            problems.append(f"zero_optimization.{section}.device: expected cpu, nvme or none, got {device!r}")
            continue
        if device == "nvme":
            problems.append(f"zero_optimization.{section}.device: nvme: the torch backend (FSDP2) offloads "
                            f"to host memory only; use device: cpu, {deepspeed}")
        if settings.get("ratio", 1.0) != 1.0:
            problems.append(f"zero_optimization.{section}.ratio: {settings['ratio']!r}: the torch backend "
                            f"offloads all of the optimizer state or none; remove ratio, {deepspeed}")
        if settings.get("super_offload"):
            problems.append(f"zero_optimization.{section}.super_offload: not available on the torch backend; "
                            f"remove it, {deepspeed}")
        unused = sorted(set(settings) - _USED)
        if unused and device == "cpu":
            notes.append(f"zero_optimization.{section}: {', '.join(unused)} not used by the torch backend's "
                         "CPU offload (FSDP2)")
        if device != "none":
            to_host[section] = settings.get("pin_memory", True)
    asked = " and ".join(f"zero_optimization.{section}" for section in to_host)
    if to_host and zero.stage < 1:  # reported with the other problems: fixing those must not reveal it
        problems.append(f"{asked}: offloading needs ZeRO: set zero_optimization.stage: 1, 2 or 3 (the torch backend "
                        f"offloads with FSDP2), {deepspeed}")
    if problems or not to_host:
        return TorchOffload(problems=tuple(problems), notes=tuple(notes))
    if zero.stage == 1:
        notes.append(f"{asked} at ZeRO stage 1: the torch backend offloads with FSDP2, which shards the parameters "
                     "too (as at stage 2); the result is the same")
    if "offload_param" not in to_host:
        notes.append("zero_optimization.offload_optimizer: the torch backend (FSDP2) steps the optimizer where the "
                     "parameters are: the sharded parameters and gradients are held on the host too, and each "
                     "layer is copied to the device for its forward and backward")
    elif "offload_optimizer" not in to_host:
        notes.append("zero_optimization.offload_param: the torch backend (FSDP2) steps the optimizer where "
                     "the parameters are: gradients and optimizer state are held on the host too")
    return TorchOffload(to_host=True, pin_memory=all(to_host.values()), problems=tuple(problems), notes=tuple(notes))
