"""What Microstep makes of DeepSpeed's ``data_types``, ``torch_autocast``,
``activation_checkpointing`` and ``compile`` sections (top-level keys, kept in
``deepspeed_extras`` and handed to the DeepSpeed backend as written, less Microstep's own keys).

| section | Microstep keys (torch backend) | DeepSpeed keys not used on the torch backend (a note) |
|---|---|---|
| ``data_types`` | ``grad_accum_dtype``: fp32 (default) or the enabled half precision | the others |
| ``torch_autocast`` | ``enabled``, ``dtype``: autocast over fp32 parameters instead of low-precision parameters | ``lower_precision_safe_modules`` |
| ``activation_checkpointing`` | ``enabled`` (true, false or ``auto``), ``blocks`` (``auto`` or class names), ``every``; the whole section may be ``auto`` (``{enabled: auto}``) | ``partition_activations``, ``cpu_checkpointing``, ... |
| ``compile`` | ``enabled``, ``mode``, ``dynamic``, ``backend``, ``fullgraph`` | ``deepcompile``, ``offload_activation``, ... |

And under ``zero_optimization`` the sizes that map onto torch's overlap knobs (``torch_overlap``):
``reduce_bucket_size`` (DDP's bucket), ``allgather_bucket_size`` (ZeRO-1's parameter broadcast),
``stage3_prefetch_bucket_size`` / ``prefetch_bucket_size`` (FSDP2's explicit prefetch).

A config-layer leaf: reads plain dicts, imports nothing of the engine.
"""
from __future__ import annotations

from dataclasses import dataclass

SECTIONS = ("data_types", "torch_autocast", "activation_checkpointing", "compile")
OUR_KEYS = {"activation_checkpointing": frozenset({"enabled", "blocks", "every"}),
            "compile": frozenset({"enabled", "mode", "dynamic", "backend", "fullgraph"})}
_GRAD_ACCUM = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16"}
_AUTOCAST_DTYPE = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "bf16": "bf16",
                   "float16": "fp16", "torch.float16": "fp16", "fp16": "fp16", "half": "fp16"}
AUTO = "auto"
_COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CheckpointingRequest:
    """Activation checkpointing as asked: which blocks, and every how many of them."""

    blocks: str | tuple[str, ...] = "auto"  # "auto" or class names
    every: int = 1
    # enabled: auto: the blocks are wrapped switchably and the micro-size tuner turns
    # checkpointing on and off by measurement (engine.autotune.tuner)
    automatic: bool = False


@dataclass(frozen=True)
class CompileRequest:
    """``torch.compile`` arguments for each block."""

    mode: str | None = None
    dynamic: bool | None = None
    backend: str = "inductor"
    fullgraph: bool = False


@dataclass(frozen=True)
class TorchFeatures:
    """The four sections as read."""

    autocast: str | None = None  # "bf16" / "fp16": torch_autocast enabled with that dtype; None: off
    grad_accum_dtype: str = "fp32"  # "fp32" | "bf16" | "fp16"
    checkpointing: CheckpointingRequest | None = None
    compile: CompileRequest | None = None
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def _section(extras: dict, name: str, problems: list[str]) -> dict:
    value = extras.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        problems.append(f"{name}: expected a section (a mapping of keys), got {value!r}")
        return {}
    return value


def _flag(section: dict, path: str, problems: list[str]) -> bool:
    value = section.get("enabled", False)
    if not isinstance(value, bool):
        problems.append(f"{path}.enabled: expected true or false, got {value!r}")
        return False
    return value


def _grad_accum_dtype(extras: dict, half: str | None, problems: list[str], notes: list[str]) -> str:
    section = _section(extras, "data_types", problems)
    unused = sorted(set(section) - {"grad_accum_dtype"})
    if unused:
        notes.append(f"data_types: {', '.join(unused)} not used by the torch backend")
    value = section.get("grad_accum_dtype")
    if value is None:
        return "fp32"
    dtype = _GRAD_ACCUM.get(str(value).lower())
    if dtype is None:
        problems.append(f"data_types.grad_accum_dtype: expected fp32, bf16 or fp16, got {value!r}")
        return "fp32"
    if dtype != "fp32" and dtype != half:
        problems.append(f"data_types.grad_accum_dtype: {value!r} needs {dtype}.enabled: gradients are accumulated "
                        "in the training's own half precision or in fp32; use fp32 (the default)")
        return "fp32"
    return dtype


def _autocast(extras: dict, half: str | None, problems: list[str], notes: list[str]) -> str | None:
    section = _section(extras, "torch_autocast", problems)
    if not _flag(section, "torch_autocast", problems):
        return None
    if "lower_precision_safe_modules" in section:
        notes.append("torch_autocast.lower_precision_safe_modules: not used by the torch backend (autocast "
                     "chooses each op's precision itself)")
    written = section.get("dtype")
    dtype = _AUTOCAST_DTYPE.get(str(written).lower()) if written is not None else None
    if written is not None and dtype is None:
        problems.append(f"torch_autocast.dtype: expected bfloat16 or float16, got {written!r}")
        return None
    if half is not None and dtype is not None and dtype != half:
        problems.append(f"torch_autocast.dtype: {written!r} contradicts {half}.enabled; keep one half precision")
        return None
    return dtype or half or "bf16"


def _checkpointing_enabled(section: dict, problems: list[str]) -> bool | str:
    """true, false or "auto" (the tuner decides)."""
    value = section.get("enabled", False)
    if value == AUTO:
        return AUTO
    if not isinstance(value, bool):
        problems.append(f"activation_checkpointing.enabled: expected true, false or auto, got {value!r}")
        return False
    return value


def _checkpointing(extras: dict, problems: list[str], notes: list[str]) -> CheckpointingRequest | None:
    # the short spelling `activation_checkpointing: auto` is `{enabled: auto}`
    written = extras.get("activation_checkpointing")
    section = {"enabled": AUTO} if written == AUTO else _section(extras, "activation_checkpointing", problems)
    theirs = sorted(set(section) - OUR_KEYS["activation_checkpointing"])
    enabled = _checkpointing_enabled(section, problems)
    if theirs:
        notes.append(
            f"activation_checkpointing: {', '.join(theirs)} configure DeepSpeed's own checkpoint function (which a "
            "model calls itself: deepspeed.checkpointing.configure(mpu, deepspeed_config=...) reads them, "
            "engine.compat.deepspeed.checkpointing) and do not change how the engine checkpoints blocks"
            + ("" if enabled else "; set activation_checkpointing.enabled: true to checkpoint the model's blocks"))
    if not enabled:
        return None
    blocks = section.get("blocks", "auto")
    if not (blocks == "auto" or (isinstance(blocks, list) and blocks and all(isinstance(b, str) for b in blocks))):
        problems.append(f"activation_checkpointing.blocks: expected auto or a list of module class names, got {blocks!r}")
        return None
    every = section.get("every", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        problems.append(f"activation_checkpointing.every: expected a positive integer, got {every!r}")
        return None
    return CheckpointingRequest("auto" if blocks == "auto" else tuple(blocks), every, automatic=enabled == AUTO)


def _compile(extras: dict, problems: list[str], notes: list[str]) -> CompileRequest | None:
    section = _section(extras, "compile", problems)
    theirs = sorted(set(section) - OUR_KEYS["compile"])
    if theirs:
        notes.append(f"compile: {', '.join(theirs)} (DeepSpeed's DeepCompile) not used by the torch backend")
    if not _flag(section, "compile", problems):
        return None
    mode, dynamic = section.get("mode"), section.get("dynamic")
    backend, fullgraph = section.get("backend", "inductor"), section.get("fullgraph", False)
    found = len(problems)
    if mode not in _COMPILE_MODES:
        problems.append(f"compile.mode: expected one of {', '.join(map(str, _COMPILE_MODES[1:]))}, got {mode!r}")
    if dynamic is not None and not isinstance(dynamic, bool):
        problems.append(f"compile.dynamic: expected true, false or null (torch decides), got {dynamic!r}")
    if not isinstance(backend, str):
        problems.append(f"compile.backend: expected a torch.compile backend name such as inductor, got {backend!r}")
    if not isinstance(fullgraph, bool):
        problems.append(f"compile.fullgraph: expected true or false, got {fullgraph!r}")
    if len(problems) > found:
        return None
    return CompileRequest(mode, dynamic, backend, fullgraph)


def torch_features(extras: dict, half: str | None) -> TorchFeatures:
    """Read the sections from ``extras`` (``Config.deepspeed_extras``); ``half``: "bf16", "fp16"
    or None, the half precision the config enables."""
    problems: list[str] = []
    notes: list[str] = []
    autocast = _autocast(extras, half, problems, notes)
    grad_accum = _grad_accum_dtype(extras, autocast or half, problems, notes)
    if autocast is not None and grad_accum != "fp32":
        problems.append("data_types.grad_accum_dtype: under torch_autocast gradients accumulate in the fp32 "
                        "parameters' own gradients; remove grad_accum_dtype or torch_autocast")
        grad_accum = "fp32"
    checkpointing, compile, transform_problems, transform_notes = model_transforms_requested(extras)
    return TorchFeatures(autocast, grad_accum, checkpointing, compile, tuple(problems) + transform_problems,
                         tuple(notes) + transform_notes)


def model_transforms_requested(extras: dict):
    """(checkpointing, compile, problems, notes): the ``activation_checkpointing`` and
    ``compile`` sections as read (both backends apply them)."""
    problems: list[str] = []
    notes: list[str] = []
    checkpointing, compile = _checkpointing(extras, problems, notes), _compile(extras, problems, notes)
    return checkpointing, compile, tuple(problems), tuple(notes)


def without_our_keys(extras: dict) -> dict:
    """``extras`` as DeepSpeed reads it: Microstep's own keys taken out of its sections."""
    cleaned = dict(extras)
    if cleaned.get("activation_checkpointing") == AUTO:  # Microstep's short spelling of {enabled: auto}
        del cleaned["activation_checkpointing"]
    for name, ours in OUR_KEYS.items():
        if isinstance(cleaned.get(name), dict):
            theirs = {k: v for k, v in cleaned[name].items() if k not in ours}
            if theirs:
                cleaned[name] = theirs
            else:
                del cleaned[name]
    return cleaned


# -- overlap knobs under zero_optimization -------------------------------------------------------
OVERLAP_KEYS = frozenset({"reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                          "prefetch_bucket_size"})
FP32_BYTES = 4  # DeepSpeed counts elements; the torch backend's buckets hold fp32 gradients and masters


@dataclass(frozen=True)
class TorchOverlap:
    """DeepSpeed's bucket sizes as the torch backend uses them (None: torch's default)."""

    reduce_bucket_bytes: int | None = None  # DDP's gradient buckets and the boundary all-reduce's
    allgather_bucket_bytes: int | None = None  # ZeRO-1's broadcast of updated parameters
    prefetch_parameters: int | None = None  # ZeRO-2/3: parameters of the next units gathered ahead
    problems: tuple[str, ...] = ()


def torch_overlap(zero_extras: dict) -> TorchOverlap:
    """Read DeepSpeed's size keys from ``zero_extras`` (``ZeroConfig.model_extra``), in elements."""
    problems, sizes = [], {}
    for key in sorted(OVERLAP_KEYS & set(zero_extras)):
        value = zero_extras[key]
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 5e8, as DeepSpeed configs write it
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and "prefetch" not in key):
            problems.append(f"zero_optimization.{key}: expected a number of elements "
                            f"({'>= 0' if 'prefetch' in key else '> 0'}), got {value!r}")
            continue
        sizes[key] = value
    reduce, gather = sizes.get("reduce_bucket_size"), sizes.get("allgather_bucket_size")
    prefetch = sizes.get("stage3_prefetch_bucket_size", sizes.get("prefetch_bucket_size"))
    return TorchOverlap(reduce and reduce * FP32_BYTES, gather and gather * FP32_BYTES, prefetch, tuple(problems))
