"""Model and optimizer state of the torch strategies, as a torch.distributed.checkpoint
(DCP) directory keyed by parameter names: loadable by every torch strategy on any world size
(single process, DDP, ZeRO-1, FSDP2). engine.state.checkpoint saves everything else.

Parameters held apart (``engine.distributed.group_held``) are plain tensors holding one slice of a
whole: they are stored as DTensors sharded over their group (``GroupHeldParameters.placed``), model
and optimizer state alike, so that DCP reshards them onto another split (1 included) at a load."""

from __future__ import annotations

import io
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from engine.distributed.collectives import agree, describe
from engine.distributed.group_held import NO_GROUP_HELD, GroupHeldParameters
from engine.distributed.process_group import control_group
from engine.errors import CheckpointError
from engine.state.async_save import defer


def _placed(value, param: torch.Tensor, name: str, group_held: GroupHeldParameters):
    """``value`` (``param``'s, or its optimizer state's) as a checkpoint stores it: a held-apart
    parameter's tensor of the parameter's shape (not, e.g., a step count) as a DTensor over its group."""
    entry = group_held.entry(name)
    if entry is None or not torch.is_tensor(value) or value.shape != param.shape:
        return value
    return group_held.placed(value, entry)


def _model_state_placed(module: torch.nn.Module, group_held: GroupHeldParameters) -> dict:
    params = dict(module.named_parameters())
    return {key: _placed(value, params[key], key, group_held) if key in params else value
            for key, value in _model_state(module).items()}


def _as_local(state: dict, group_held: GroupHeldParameters) -> dict:
    """A loaded state's parameters held apart (DTensors over their group) as this rank's slices."""
    return {key: value.to_local() if group_held.entry(key) is not None and isinstance(value, DTensor) else value
            for key, value in state.items()}


def save_training_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str,
                        group_held: GroupHeldParameters = NO_GROUP_HELD) -> None:
    """DCP checkpoint of ``module`` (DTensor shards or plain tensors) and ``optimizer``.

    The optimizer state is one flat entry per tensor, keyed by the parameter's name
    (``optimizer.state.<fqn>.<key>``), for the parameters in ``optimizer.param_groups`` —
    under ZeRO-1 only this rank's own, so DCP stores the union of the ranks' disjoint
    pieces; under FSDP the entries are DTensors and DCP stores their shards. Non-tensor
    values are stored pickled. Group hyperparameters (lr, betas, ...) are stored once.
    ``group_held``: the model's parameters held apart (``engine.distributed.group_held``), stored resharded."""
    payload, problem, cause = None, None, None
    try:
        names = _param_names(module)
        state: dict[str, dict] = {}  # DCP flattens it to "optimizer.state.<fqn>.<key>"
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in optimizer.state.get(p, {}).items():
                    # a tuple is stored whole (pickled); a tensor as its own entry
                    value = _placed(value, p, names[id(p)], group_held)
                    state.setdefault(names[id(p)], {})[key] = value if torch.is_tensor(value) else (value,)
        payload = {"model": _model_state_placed(module, group_held),
                   "optimizer": {"type": _type_name(optimizer), "param_groups": (_hyperparameters(optimizer),),
                                 "state": state}}
    except Exception as error:  # noqa: BLE001 - agreed on before DCP's own collectives
        problem, cause = f"collecting the model/optimizer state failed: {describe(error)}", error
    agree(problem, cause)
    # checkpoint.async: copied to host memory now, written by the background writer later
    if not defer(lambda staged: _dcp(dcp.save, staged, directory), payload):
        _dcp(dcp.save, payload, directory)


def load_training_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str,
                        model_keys=None, group_held: GroupHeldParameters = NO_GROUP_HELD) -> None:
    """Inverse of :func:`save_training_state`, resharding to this run's layout: each
    rank reads the entries of the parameters its optimizer holds (its own shards under
    FSDP, its own parameters under ZeRO-1). Checks the model's names and shapes and the
    optimizer's type and groups on every rank before anything is changed. ``model_keys``:
    the whole model's state keys when ``module`` is a part of it (a pipeline stage), which
    reads only its own; default: ``module``'s. ``group_held``: the model's parameters held apart,
    whose slices are read from whatever split saved them."""
    names = _param_names(module)
    problem, cause, model_state, templates, saved_groups = None, None, None, {}, None
    try:
        saved = FileSystemReader(directory).read_metadata().state_dict_metadata
        model_state = _model_state_placed(module, group_held)
        problem = _model_mismatch(model_state, saved, directory, model_keys)
        small = {"optimizer": {"type": None, "param_groups": None}}
        _dcp(dcp.load, small, directory, local=True)
        saved_type, (saved_groups,) = small["optimizer"]["type"], small["optimizer"]["param_groups"]
        problem = problem or _optimizer_mismatch(optimizer, saved_type, saved_groups, directory)
        by_param = _saved_optimizer_entries(saved)
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = names[id(p)]
                for key in by_param.get(name, ()):
                    meta = saved[f"optimizer.state.{name}.{key}"]
                    entry = group_held.entry(name)
                    if not isinstance(meta, TensorStorageMetadata):
                        template = None
                    elif entry is not None and tuple(meta.size) == tuple(entry.full_shape):  # a slice of it
                        template = group_held.placed(torch.empty_like(p, dtype=meta.properties.dtype), entry)
                    elif tuple(meta.size) == tuple(p.shape) and p.dim() > 0:  # sharded like p
                        template = torch.empty_like(p, dtype=meta.properties.dtype)
                    else:  # e.g. Adam's step: torch's load_state_dict moves it where it belongs
                        template = torch.empty(meta.size, dtype=meta.properties.dtype)
                    templates.setdefault(name, {})[key] = template
    except CheckpointError as error:
        problem, cause = str(error), error
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - library errors, rephrased
        problem, cause = f"cannot read the model/optimizer state in {directory}: {describe(error)}", error
    agree(problem, cause)

    payload = {"model": model_state, "optimizer": {"state": templates}}
    try:
        _dcp(dcp.load, payload, directory)
    except (Exception, CheckpointException) as error:
        raise CheckpointError(f"reading the model/optimizer state in {directory} failed (the model "
                              f"may be partly loaded: re-create the engine): {describe(error)}") from error
    if payload["model"]:
        set_model_state_dict(module, _as_local(payload["model"], group_held))
    loaded = {name: {key: value.to_local() if isinstance(value, DTensor) and group_held.entry(name) else value
                     for key, value in entries.items()} for name, entries in payload["optimizer"]["state"].items()}
    index, torch_state, torch_groups = 0, {}, []
    for group, hyper in zip(optimizer.param_groups, saved_groups):
        ids = []
        for p in group["params"]:
            entries = loaded.get(names[id(p)])
            if entries:
                torch_state[index] = {k: v[0] if isinstance(v, tuple) else v for k, v in entries.items()}
            ids.append(index)
            index += 1
        extra = {"param_names": group["param_names"]} if "param_names" in group else {}
        torch_groups.append({**hyper, **extra, "params": ids})
    optimizer.load_state_dict({"state": torch_state, "param_groups": torch_groups})


def read_model_state(directory: str) -> dict[str, torch.Tensor]:
    """The whole model state a :func:`save_training_state` directory holds, every shard joined,
    as CPU tensors keyed by the model's own names; read in this process alone (no process group,
    no model: what ``zero_to_fp32`` does for DeepSpeed's checkpoints)."""
    try:
        saved = FileSystemReader(directory).read_metadata().state_dict_metadata
        model = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype) for key, meta in saved.items()
                 if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
        _dcp(dcp.load, model, directory, local=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - library errors, rephrased
        raise CheckpointError(f"cannot read the model state in {directory}: {describe(error)}") from error
    return {key[len("model."):]: value for key, value in model.items()}


def _model_state(module: torch.nn.Module) -> dict:
    """``get_model_state_dict(module)``; {} for a module without state (a pipeline rank whose
    stages hold no parameters or buffers, e.g. an activation alone), which torch refuses."""
    if not module.state_dict():
        return {}
    return get_model_state_dict(module)


def _param_names(module: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _type_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _hyperparameters(optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k not in ("params", "param_names")}
            for group in optimizer.param_groups]


def _saved_optimizer_entries(saved) -> dict[str, list[str]]:
    """{parameter name: [state keys]} of the checkpoint's optimizer entries."""
    by_param: dict[str, list[str]] = {}
    prefix = "optimizer.state."
    for key in saved:
        if key.startswith(prefix):
            name, _, state_key = key[len(prefix):].rpartition(".")
            by_param.setdefault(name, []).append(state_key)
    return by_param


def _model_mismatch(model_state: dict, saved, directory: str, model_keys=None) -> str | None:
    saved_model = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
    elsewhere = set(model_keys or ()) - set(model_state)  # other parts' keys (pipeline stages)
    missing, shapes = [], []
    covered = set()
    for key, value in model_state.items():
        if torch.is_tensor(value):
            meta = saved_model.get(key)
            if meta is None:
                missing.append(key)
            elif hasattr(meta, "size") and tuple(meta.size) != tuple(value.shape):
                shapes.append(f"{key}: checkpoint {tuple(meta.size)}, model {tuple(value.shape)}")
            covered.add(key)
        else:  # a non-tensor entry (extra state) may have been flattened into sub-keys
            found = {k for k in saved_model if k == key or k.startswith(key + ".")}
            if not found:
                missing.append(key)
            covered |= found
    unexpected = sorted(set(saved_model) - covered - elsewhere)
    if not (missing or unexpected or shapes):
        return None
    parts = []
    for label, items in (("missing from the checkpoint", missing),
                         ("in the checkpoint but not in this model", unexpected),
                         ("shape mismatch", shapes)):
        if items:
            parts.append(f"{label}: {', '.join(items[:8])}" + (f" (+{len(items) - 8} more)" if len(items) > 8 else ""))
    return f"the checkpoint in {directory} was saved from a different model — " + "; ".join(parts)


def _optimizer_mismatch(optimizer, saved_type: str, saved_groups: list[dict], directory: str) -> str | None:
    mine = _type_name(optimizer)
    if saved_type != mine:
        return f"the checkpoint in {directory} holds a {saved_type} optimizer state; this engine's optimizer is {mine}"
    if len(saved_groups) != len(optimizer.param_groups):
        return (f"the checkpoint's optimizer has {len(saved_groups)} parameter group(s); this engine's "
                f"has {len(optimizer.param_groups)}")
    for i, (saved, current) in enumerate(zip(saved_groups, _hyperparameters(optimizer))):
        if set(saved) != set(current):
            return (f"optimizer parameter group {i} has settings {sorted(saved)} in the checkpoint "
                    f"but {sorted(current)} here")
    return None


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading the non-tensor entries (optimizer type, parameter
    groups, non-tensor optimizer state) with ``weights_only=True`` instead of unrestricted pickle."""

    def load_bytes(self, read_item, value) -> None:
        # Read restricted; what the default planner then unpickles is our own re-serialisation of it.
        safe = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


def _dcp(fn, payload: dict, directory: str, *, local: bool = False) -> None:
    """``dcp.save`` / ``dcp.load`` on the control group, or without collectives in a single
    process (``local``: this rank alone reads small entries)."""
    no_dist = local or control_group() is None
    planner = {"planner": _WeightsOnlyLoadPlanner()} if fn is dcp.load else {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        fn(payload, checkpoint_id=directory, no_dist=no_dist,
           process_group=None if no_dist else control_group(), **planner)
