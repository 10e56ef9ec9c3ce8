"""What a strategy does to the model's repeated blocks before it wraps or shards them:
activation checkpointing and ``torch.compile``, each block on its own (as torchtitan does), so
that sharding units, checkpoint regions and compiled graphs line up.

Blocks (``activation_checkpointing.blocks``): ``auto`` takes a Hugging Face model's
``_no_split_modules`` classes when it names some, else the layers of the model's outermost
``ModuleList`` / ``Sequential`` (its transformer blocks: what ZeRO-3 shards one unit at a
time); or a list of class names. Both transforms leave the module tree and parameter names as
they are (no wrapper module): both replace a block's ``forward`` on the instance, so state
dicts and checkpoints do not change, and the hooks FSDP2 or DDP add run around them.

Checkpointing: ``torch.utils.checkpoint`` (non-reentrant) saves only a block's inputs and
recomputes the rest during the backward; RNG state is restored for the recomputation, so
dropout draws the same masks and gradients equal the run without it. With
``activation_checkpointing: auto`` each block is wrapped once, switchably: a shared
``CheckpointSwitch`` (the holder's ``capabilities().checkpoint_switch``) that the micro-size tuner turns on
and off between windows, without rebuilding or re-sharding anything. A compiled block then
compiles the switchable forward: one graph per switch position (dynamo guards on it).

Hugging Face blocks: a checkpointed block trains without the generation cache (``use_cache``
off, an empty ``past_key_values`` not passed), as under transformers' own gradient
checkpointing; otherwise the recomputation would write its keys and values a second time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from engine.errors import ConfigError

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)


def container_layers(container: torch.nn.Module):
    """A container's entries, with nested containers opened up."""
    for child in container.children():
        if isinstance(child, _CONTAINERS):
            yield from container_layers(child)
        else:
            yield child


def outermost_containers(module: torch.nn.Module):
    """The ``ModuleList`` / ``Sequential`` modules not inside another one (``module`` itself if it is one)."""
    if isinstance(module, _CONTAINERS):
        yield module
        return
    for child in module.children():
        yield from outermost_containers(child)


def _named_classes(module: torch.nn.Module, names) -> list[torch.nn.Module]:
    """The outermost modules whose class is named in ``names`` (not those inside a match)."""
    found = []

    def visit(node):
        if type(node).__name__ in names:
            found.append(node)
            return
        for child in node.children():
            visit(child)

    visit(module)
    return found


def repeated_blocks(module: torch.nn.Module, blocks="auto") -> list[torch.nn.Module]:
    """The blocks ``activation_checkpointing.blocks`` names in ``module``, in forward order."""
    if blocks == "auto":
        no_split = getattr(module, "_no_split_modules", None)
        if no_split:
            return _named_classes(module, set(no_split))
        return [layer for container in outermost_containers(module) for layer in container_layers(container)
                if any(p.requires_grad for p in layer.parameters())]
    found = _named_classes(module, set(blocks))
    if not found:
        classes = sorted({type(m).__name__ for m in module.modules()} - {type(module).__name__})
        raise ConfigError(f"activation_checkpointing.blocks: the model has no module of class "
                          f"{', '.join(blocks)}; its classes are {', '.join(classes)} (or write blocks: auto)")
    return found


# The keyword arguments under which Hugging Face blocks receive the generation cache (one name
# per model family) and the switch that makes them write to it.
CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def _without_cache(kwargs: dict) -> dict:
    """``kwargs`` with the block's key/value cache taken away while gradients are recorded.

    A Hugging Face model built from its config has ``use_cache`` on, so its blocks append their
    keys and values to a cache during the forward; the recomputation in the backward would
    append them a second time and attend over twice the sequence. Transformers' own
    ``gradient_checkpointing_enable`` drops the cache in training for the same reason. An empty
    cache holds nothing the block reads, so dropping it changes no result; a filled one (a
    prefix of earlier tokens) would, so it is refused rather than silently ignored."""
    if not torch.is_grad_enabled():
        return kwargs  # no backward, no recomputation: the cache is written once
    kept = dict(kwargs)
    for name in CACHE_ARGUMENTS:
        cache = kept.get(name)
        if cache is None:
            continue
        filled = getattr(cache, "get_seq_length", lambda: 0)()
        if filled:
            raise ConfigError(f"activation_checkpointing: a checkpointed block was given a {name} cache that already "
                              f"holds {filled} token(s); the backward recomputes the block, which would write them "
                              f"into the cache a second time. Train without a filled cache (pass use_cache=False "
                              f"and no {name}), or set activation_checkpointing.enabled: false")
        kept[name] = None
    if kept.get("use_cache"):
        kept["use_cache"] = False
    return kept


def _checkpointed(forward):
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True,
                                                 **_without_cache(kwargs))

    return run


class CheckpointSwitch:
    """Whether switchably checkpointed blocks checkpoint now (off until the tuner turns it on).
    Flip it only between windows: a forward and its backward must see the same position."""

    def __init__(self):
        self.on = False


def _switchable(forward, switch: CheckpointSwitch):
    checkpointed = _checkpointed(forward)

    def run(*args, **kwargs):
        return (checkpointed if switch.on else forward)(*args, **kwargs)

    return run


def apply_switchable_checkpointing(blocks: list[torch.nn.Module], every: int = 1) -> CheckpointSwitch:
    """Wrap every ``every``-th of ``blocks`` (the first included) in checkpointing that the
    returned switch turns on and off."""
    switch = CheckpointSwitch()
    for block in blocks[::every]:
        block.forward = _switchable(block.forward, switch)
    return switch


def apply_activation_checkpointing(blocks: list[torch.nn.Module], every: int = 1) -> list[torch.nn.Module]:
    """Checkpoint every ``every``-th of ``blocks`` (the first included); the checkpointed ones."""
    chosen = blocks[::every]
    for block in chosen:
        block.forward = _checkpointed(block.forward)
    return chosen


def apply_compile(blocks: list[torch.nn.Module], request) -> None:
    """``torch.compile`` each block (the whole model when it has none) in place (``request``: an ``engine.config.torch_features.CompileRequest``)."""
    for block in blocks:
        # The forward, not the module call: hooks a sharding framework adds stay outside the graph.
        block.forward = torch.compile(block.forward, mode=request.mode, dynamic=request.dynamic,
                                      backend=request.backend, fullgraph=request.fullgraph)


@dataclass(frozen=True)
class ModelBlocks:
    """The blocks the transforms wrap, chosen on a whole model: those to checkpoint (every
    ``every``-th of the checkpointing blocks) and those to compile (its repeated blocks, or the
    model itself when it has none)."""

    checkpointed: tuple
    compiled: tuple

    def held(self, module: torch.nn.Module) -> "ModelBlocks":
        """Those of the blocks ``module`` holds (a pipeline stage's, chosen on the whole model)."""
        inside = {id(m) for m in module.modules()}
        return ModelBlocks(tuple(b for b in self.checkpointed if id(b) in inside),
                           tuple(b for b in self.compiled if id(b) in inside))


def model_blocks(module: torch.nn.Module, checkpointing, compile) -> ModelBlocks:
    """The blocks of ``module`` that the setup's checkpointing and compile wrap (each may be None: off)."""
    checkpointed = ()
    if checkpointing is not None:
        blocks = repeated_blocks(module, checkpointing.blocks)
        if not blocks:
            raise ConfigError("activation_checkpointing.blocks: auto found no repeated blocks (no ModuleList or "
                              "Sequential of layers with parameters, no _no_split_modules); name the blocks' "
                              "classes: blocks: [MyBlock]")
        checkpointed = tuple(blocks[::checkpointing.every])
    compiled = tuple(repeated_blocks(module, "auto") or [module]) if compile is not None else ()
    return ModelBlocks(checkpointed, compiled)


def transform_blocks(blocks: ModelBlocks, checkpointing, compile) -> CheckpointSwitch | None:
    """Checkpoint, then compile, ``blocks`` as the setup asks. A compiled block that is also
    checkpointed compiles its checkpointed forward. Returns the switch of
    ``activation_checkpointing: auto`` (else None)."""
    switch = None
    if blocks.checkpointed:
        if checkpointing.automatic:
            switch = apply_switchable_checkpointing(list(blocks.checkpointed))
        else:
            apply_activation_checkpointing(list(blocks.checkpointed))
    if blocks.compiled:
        apply_compile(list(blocks.compiled), compile)
    return switch


def transform_model(module: torch.nn.Module, checkpointing, compile) -> CheckpointSwitch | None:
    """:func:`transform_blocks` on the blocks :func:`model_blocks` finds in ``module``."""
    return transform_blocks(model_blocks(module, checkpointing, compile), checkpointing, compile)
