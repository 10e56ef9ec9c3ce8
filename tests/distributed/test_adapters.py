"""Every entry of the framework adapters (engine/adapters), exercised on the installed,
pinned versions: a torch or DeepSpeed upgrade that moves an internal fails here, cheaply,
instead of at the first out-of-memory of a user's run."""

from __future__ import annotations

import importlib.util
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import engine

from engine.adapters import deepspeed_internals, torch_internals
from engine.errors import ConfigError, PeerError, UnsupportedFrameworkError
from tests.support.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(REPO, ".cache", "torch_extensions"))}
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


# -- torch: versions and tensor helpers ---------------------------------------------------------
def test_torch_version_is_checked(monkeypatch):
    if torch_internals.version() <= torch_internals.NEWEST_TESTED:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch_internals.check()  # a tested torch: no warning
    else:  # e.g. the compatibility run on torch 2.15
        monkeypatch.setattr(torch_internals, "_warned_untested", False)
        with pytest.warns(engine.UntestedFrameworkWarning):
            torch_internals.check()
    for version in ((2, 10), (1, 13)):
        monkeypatch.setattr(torch_internals, "version", lambda v=version: v)
        with pytest.raises(UnsupportedFrameworkError, match=r"older than Microstep supports \(tested with torch 2\.11 to 2\.14\)"):
            torch_internals.check()


def test_newer_torch_than_tested_warns_once_and_runs(monkeypatch):
    monkeypatch.setattr(torch_internals, "version", lambda: (2, 16))
    monkeypatch.setattr(torch_internals, "_warned_untested", False)
    with pytest.warns(engine.UntestedFrameworkWarning, match=r"newer than Microstep was tested with \(torch 2\.11 to 2\.14\)"):
        torch_internals.check()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_internals.check()  # once per process
        eng = engine.initialize(torch.nn.Linear(2, 1), {"train_batch_size": 2},
                                optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    x = torch.ones(2, 2)
    eng.train_batch((x, torch.zeros(2, 1)), lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]))
    assert eng.global_steps == 1


def test_torch_missing_internal_is_named(monkeypatch):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    # as on torch 2.11, which has no reset_iter_state (raising=False: there it is absent already)
    monkeypatch.delattr(FSDPModule, "reset_iter_state", raising=False)
    torch_internals.check()
    monkeypatch.delattr(FSDPParamGroup, "_to_sharded")
    monkeypatch.delattr(FSDPModule, "_get_fsdp_state")
    with pytest.raises(UnsupportedFrameworkError, match="lacks FSDPModule._get_fsdp_state, .*FSDPParamGroup._to_sharded"):
        torch_internals.check()


def test_tensor_helpers():
    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([3.0, 4.0])]
    flat = torch_internals.flatten(tensors)
    assert flat.tolist() == [0, 1, 2, 3, 4, 5, 3, 4]
    assert all(torch.equal(a, b) for a, b in zip(torch_internals.unflatten(flat, tensors), tensors))
    assert [n.item() for n in torch_internals.foreach_norm(tensors, 2.0)] == pytest.approx([math.sqrt(55), 5.0])
    torch_internals.foreach_mul_(tensors, 2.0)
    assert tensors[1].tolist() == [6.0, 8.0]
    found = torch.zeros(1)
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([float("inf")])]
    torch_internals.non_finite_check_and_unscale_(grads, found, torch.tensor([0.5]))
    assert grads[0].tolist() == [1.0, 2.0] and found.item() == 1.0


def test_autograd_sequence_numbers_fall_along_the_graph():
    """What engine.batching.forward_sizes relies on: a node's inputs were numbered before it."""
    x = torch.ones(2, requires_grad=True)
    first = x * 2
    second = (x + 1).sum()
    loss = first.sum() * second
    number = torch_internals.autograd_sequence_nr
    assert number(first.grad_fn) < number(second.grad_fn) < number(loss.grad_fn)
    for node, _ in loss.grad_fn.next_functions:
        assert number(node) < number(loss.grad_fn)


# -- torch: DDP and FSDP2, on two ranks -----------------------------------------------------------
def _ddp_gradient_sync(rank, world):
    model = torch.nn.Linear(2, 1, bias=False)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    grads = []
    for sync in (False, True):
        model.zero_grad()
        torch_internals.set_ddp_gradient_sync(ddp, sync)
        ddp(torch.full((1, 2), float(rank + 1))).sum().backward()
        grads.append(model.weight.grad.clone())
    return grads


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ddp_gradient_sync_switch():
    (local0, synced0), (local1, synced1) = run_distributed(_ddp_gradient_sync, world_size=2, timeout=90)
    assert not torch.equal(local0, local1)  # no all-reduce
    assert torch.equal(synced0, synced1) and synced0.tolist() == [[1.5, 1.5]]  # the mean over ranks



def _fsdp_entries(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from engine.memory import storage_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    units = [model[0], model]
    x = torch.full((2, 4), float(rank + 1))
    out = {"params": sum(1 for unit in units for _ in torch_internals.fsdp_params(unit))}

    # The offload policy each unit was sharded with.
    offloaded = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(offloaded[0], mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(offloaded, mesh=mesh)
    out["policies"] = [type(p).__name__ for p in torch_internals.fsdp_offload_policies(units)]
    out["offloaded"] = [(type(p).__name__, getattr(p, "pin_memory", None))
                        for p in torch_internals.fsdp_offload_policies([offloaded[0], offloaded])]

    # A gradient accumulated without reduction, then dropped: nothing is left anywhere.
    model.set_requires_gradient_sync(False)
    model(x).sum().backward()
    out["unreduced_bytes"] = storage_bytes(torch_internals.fsdp_held_tensors(units))
    torch_internals.drop_unreduced_gradients(model, units)
    model.reshard()
    out["after_drop"] = storage_bytes(torch_internals.fsdp_held_tensors(units))

    # Accumulated without reduction, then reduced by hand: the mean over ranks, sharded.
    model(x).sum().backward()
    torch_internals.reduce_accumulated_gradients(model)
    out["reduced"] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    model.zero_grad()

    # The custom comms: guarded, and the all-to-all reduce-scatter, give the same gradient.
    calls = []
    for unit in units:
        all_gather, reduce_scatter = torch_internals.fsdp_comms(lambda group: calls.append(group.size()),
                                                                all_to_all_reduce_scatter=True)
        unit.set_custom_all_gather(all_gather)
        unit.set_custom_reduce_scatter(reduce_scatter)
    model.set_requires_gradient_sync(True)
    model(x).sum().backward()
    out["custom"] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    out["guard_calls"] = len(calls)
    out["held"] = storage_bytes(torch_internals.fsdp_held_tensors(units))

    # A forward abandoned mid-way, reset the way torch 2.11 needs: the next iteration is exact.
    model.zero_grad()
    model.set_requires_gradient_sync(True)
    for unit in units:
        unit.set_custom_all_gather(torch_internals.fsdp_comms()[0])
    hook = model[1].register_forward_pre_hook(lambda module, args: 1 / 0)
    try:
        model(x)
    except ZeroDivisionError:
        pass
    hook.remove()
    torch_internals._reset_iter_state_before_2_13(model)
    model(x).sum().backward()
    out["after_fallback_reset"] = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    model.zero_grad()

    # A guard that finds a failed peer stops the collective on every rank.
    def failing_guard(group):
        raise PeerError({1: 1})

    for unit in units:
        unit.set_custom_all_gather(torch_internals.fsdp_comms(failing_guard)[0])
    model.reshard()
    try:
        model(x)
    except PeerError:
        out["guard_raised"] = True
    torch_internals.drop_unreduced_gradients(model, units)
    dist.barrier()
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_fsdp2_entries():
    results = run_distributed(_fsdp_entries, world_size=2, timeout=90)
    for out in results:
        assert out["params"] == 4
        assert out["policies"] == ["OffloadPolicy", "OffloadPolicy"]
        assert out["offloaded"] == [("CPUOffloadPolicy", False), ("OffloadPolicy", None)]
        # sharded parameters (4 + 2 + 2 + ... values) stay; gathered copies and their gradients go
        assert out["after_drop"] < out["unreduced_bytes"] / 2
        assert out["guard_calls"] >= 2 and out["held"] > 0 and out["guard_raised"]
        for name, reduced in out["reduced"].items():
            assert torch.allclose(reduced, out["custom"][name]), name
            assert torch.allclose(reduced, out["after_fallback_reset"][name]), name
    # the mean over ranks: identical on both ranks
    for name in results[0]["reduced"]:
        assert torch.equal(results[0]["reduced"][name], results[1]["reduced"][name])


# -- DeepSpeed --------------------------------------------------------------------------------------
@needs_deepspeed
def test_deepspeed_version_is_checked(monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    with pytest.raises(UnsupportedFrameworkError, match=r"tested with deepspeed 0\.19\.x"):
        deepspeed_internals.import_deepspeed()


def test_missing_deepspeed_names_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ConfigError, match=r"pip install 'microstep\[deepspeed\]'"):
        deepspeed_internals.import_deepspeed()


def _deepspeed_entries(rank, world, root):
    ds = deepspeed_internals.import_deepspeed()
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "memory_efficient_linear": False}
        ds_engine, *_ = ds.initialize(model=model, optimizer=optimizer, dist_init_required=False, config={
            "train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0})
        row = {"check": deepspeed_internals.check_optimizer(ds_engine.optimizer, stage),
               "held": sum(1 for t in deepspeed_internals.held_tensors(ds_engine) if t is not None)}
        if stage == 0:
            row["stage0_scale"] = deepspeed_internals.stage0_loss_scale(ds_engine.optimizer)
            row["check_foreign"] = deepspeed_internals.check_optimizer(object(), 1)
        else:
            before = ds_engine.optimizer.loss_scale
            with deepspeed_internals.scaled_step(ds_engine, 4.0):
                row["scaled"] = ds_engine.optimizer.loss_scale / before
            row["restored"] = ds_engine.optimizer.loss_scale == before
        ds_engine.backward(ds_engine(torch.ones(1, 4)).sum())
        deepspeed_internals.drop_window_gradients(ds_engine, stage)
        row["grads_after_drop"] = [p.grad for p in ds_engine.module.parameters() if p.grad is not None]
        if stage >= 2:
            ds_engine.set_gradient_accumulation_boundary(False)
            ds_engine.backward(ds_engine(torch.ones(1, 4)).sum())
            ds_engine.set_gradient_accumulation_boundary(True)
            deepspeed_internals.finish_reduced_boundary(ds_engine)
            ds_engine.step()
            row["stepped"] = ds_engine.was_step_applied()
        if stage == 1:
            path = os.path.join(root, "ds")
            ds_engine.save_checkpoint(path, tag="t", save_latest=False)
            if rank == 0:
                deepspeed_internals.to_universal(os.path.join(path, "t"), os.path.join(root, "universal", "t"))
            dist.barrier()
            with deepspeed_internals.universal_checkpoint_loading(ds_engine):
                row["flag_inside"] = ds_engine._config.load_universal_checkpoint
                loaded, _ = ds_engine.load_checkpoint(os.path.join(root, "universal"), tag="t",
                                                   load_optimizer_states=True, load_lr_scheduler_states=False)
            row["universal_loaded"] = loaded is not None
            row["flag_after"] = ds_engine._config.load_universal_checkpoint
        ds_engine.destroy()
        out[stage] = row
    return out


@needs_deepspeed
@pytest.mark.deepspeed
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_deepspeed_entries(tmp_path):
    for out in run_distributed(_deepspeed_entries, world_size=2, args=(str(tmp_path),), timeout=200, env=ENV):
        assert out[0]["stage0_scale"] == 1.0 and "instead of its ZeRO optimizer" in out[0]["check_foreign"]
        for stage in (0, 1, 2, 3):
            row = out[stage]
            assert row["check"] is None and row["held"] > 0 and row["grads_after_drop"] == [], (stage, row)
        for stage in (1, 2, 3):
            assert out[stage]["scaled"] == pytest.approx(0.25) and out[stage]["restored"], stage
        assert out[2]["stepped"] and out[3]["stepped"]
        assert out[1]["flag_inside"] and not out[1]["flag_after"] and out[1]["universal_loaded"]
