"""ZeRO stages keep ZeRO's memory: bytes held after every backward (counted, deterministic)
against ZeRO theory, the collectives each micro-step sends (pinned by kind and count), and
``defer_reduction`` trading one for the other. Exactness for both settings is in
tests/distributed/test_distributed.py."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest
import torch

import engine
from bench.comm_count import CommCounter
from engine.memory import held_bytes
from tests.support.dist_utils import run_scenarios
from tests.support.reference import mse

WIDTH, LAYERS, MICRO, ACCUMULATION = 16, 4, 2, 4
REPO = Path(__file__).resolve().parents[2]
# DeepSpeed compiles a small op on first use: keep it where scripts/test.sh and the other tests keep it
DEEPSPEED_ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
LAYER_PARAMS = WIDTH * WIDTH + WIDTH
P = LAYERS * LAYER_PARAMS * 8  # model bytes (float64)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).double()


def make_engine(world, stage, defer, unit=10**8, backend="torch", **extra):
    zero = {"stage": stage, "defer_reduction": defer}
    if backend == "torch":
        zero["shard_unit_size"] = unit
    else:
        zero["stage3_param_persistence_threshold"] = 0
    config = {"backend": backend, "train_batch_size": MICRO * ACCUMULATION * world,
              "train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero, **extra}
    return engine.initialize(model() if backend == "torch" else model().float(), config,
                             optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))


def window(world, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(MICRO * ACCUMULATION, WIDTH, generator=g, dtype=dtype),
            torch.randn(MICRO * ACCUMULATION, WIDTH, generator=g, dtype=dtype))


def per_micro_step(eng, batch, measure, *, after_step=False):
    """One window through the manual loop; ``measure(eng)`` after each micro-step's backward
    (or after its ``step()``)."""
    x, y = batch
    out = []
    for micro_batch in zip(x.split(MICRO), y.split(MICRO)):
        eng.backward(mse(eng, micro_batch))
        if not after_step:
            out.append(measure(eng))
        eng.step()
        if after_step:
            out.append(measure(eng))
    return out


# -- held bytes ---------------------------------------------------------------------------------
def held_after_each_backward(rank, world, stage, defer, unit=10**8, backend="torch"):
    eng = make_engine(world, stage, defer, unit, backend)
    batch = window(world, torch.float64 if backend == "torch" else torch.float32)
    eng.train_batch(batch, mse)  # AdamW state exists from here on
    held = per_micro_step(eng, batch, lambda e: held_bytes(e.strategy))
    eng.close()
    return held


def memory_scenarios(world):
    scenarios = {}
    for stage in (2, 3):
        for defer in (False, True):
            for unit in (LAYER_PARAMS, 10**8):  # one unit per layer, or the whole model in one
                scenarios[(stage, defer, unit)] = functools.partial(held_after_each_backward, stage=stage,
                                                                    defer=defer, unit=unit)
    return scenarios


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_held_bytes_are_zero_theory(world):
    """AdamW in float64: sharded parameters, gradients and two moments are 4P/W. Stage 2 holds
    the gathered parameters besides (P + 4P/W); stage 3 nothing more. Deferring holds gathered
    parameters and the full-size gradient instead of its shard (2P + 3P/W) until the window's
    last backward, after which all hold 4P/W."""
    results = run_scenarios(memory_scenarios(world), world_size=world, timeout=240)
    sharded = 4 * P / world
    for (stage, defer, unit), per_rank in results.items():
        for held in per_rank:
            inside, last = held[:-1], held[-1]
            expected = 2 * P + 3 * P / world if defer else P + sharded if stage == 2 else sharded
            assert inside == [pytest.approx(expected, rel=0.02)] * (ACCUMULATION - 1), (stage, defer, unit, held)
            assert last == pytest.approx(sharded, rel=0.02), (stage, defer, unit, held)


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_defaults_hold_zero_memory():
    """DeepSpeed's own ZeRO by default: stage 2 holds P + 4P/W (fp32); stage 3 holds 5P/W, as
    DeepSpeed keeps an fp32 master partition beside each parameter partition. Deferring holds
    the full-size gradient besides."""
    scenarios = {(stage, defer): functools.partial(held_after_each_backward, stage=stage, defer=defer,
                                                   backend="deepspeed")
                 for stage in (2, 3) for defer in (False, True)}
    results = run_scenarios(scenarios, world_size=2, timeout=240, env=DEEPSPEED_ENV)
    p32, sharded = P / 2, 4 * P / 2 / 2
    for held in results[(2, False)]:
        assert max(held) == pytest.approx(p32 + sharded, rel=0.02), held
    for held in results[(3, False)]:
        assert max(held) == pytest.approx(sharded * 5 / 4, rel=0.02), held
    for stage in (2, 3):
        for deferred, native in zip(results[(stage, True)], results[(stage, False)]):
            assert max(deferred) >= max(native) + p32 / 2  # at least the gradient partitions became full-size


# -- collectives ----------------------------------------------------------------------------------
def collectives_per_window(rank, world, stage, defer, unit):
    """What each micro-step of a manual-loop window sends, and what a whole train_batch window
    sends, without and with clipping (counted after a first window: optimizer state exists)."""
    def counted_windows(clip):
        eng = make_engine(world, stage, defer, unit, gradient_clipping=clip)
        batch = window(world)
        eng.train_batch(batch, mse)
        with CommCounter() as comm:
            if stage < 2:
                comm.watch_ddp(eng.strategy.forward_module)

            def counted(e):
                calls = dict(comm.calls)
                comm.reset()
                return calls

            comm.reset()
            manual = per_micro_step(eng, batch, counted, after_step=True)
            eng.train_batch(batch, mse)
            return manual, dict(comm.calls)

    manual, train_batch = counted_windows(0.0)
    manual_clipped, train_batch_clipped = counted_windows(1.0)
    return {"manual": manual, "train_batch": train_batch, "manual clipped": manual_clipped,
            "train_batch clipped": train_batch_clipped}


def expected_collectives(stage, defer, units):
    """What one manual-loop window of ACCUMULATION micro-steps sends, micro-step by micro-step
    (2 ranks, gloo: the reduce-scatter is an all-to-all; no clipping, no monitor). At ZeRO-2/3
    the boundary adds one small reduction of the squared gradient norm (an all-gather of one
    number, ``collectives.small_sum``), the non-finite check over the sharded gradient (clipping
    reuses it)."""
    steps = _micro_step_collectives(stage, defer, units)
    if stage < 2:
        return steps
    return steps[:-1] + [{**steps[-1], "small all_gather": steps[-1].get("small all_gather", 0) + 1}]


def _micro_step_collectives(stage, defer, units):
    quiet = [{}] * (ACCUMULATION - 1)
    if stage == 0:
        return quiet + [{"all_reduce": 1}]
    if stage == 1:
        return quiet + [{"all_reduce": 1, "broadcast": 2}]  # each rank broadcasts what it owns
    # Stage 2 gathers once per window, right after its step: the module holds whole parameters
    # between windows (module.state_dict() on one rank), so the window's gather ends it.
    if defer and stage == 2:  # gathered once, reduced once
        return [{}] * (ACCUMULATION - 1) + [{"all_to_all": units, "all_gather": units}]
    if defer:  # stage 3: gathered once at the window's start, reduced once
        return [{"all_gather": units}] + [{}] * (ACCUMULATION - 2) + [{"all_to_all": units}]
    if stage == 2:  # gathered once, reduced every micro-step
        return [{"all_to_all": units}] * (ACCUMULATION - 1) + [{"all_to_all": units, "all_gather": units}]
    # stage 3: every unit gathered in each forward, gathered again in the backward unless it is
    # the root unit (kept from its forward to its backward), reduced every micro-step
    root_holds = units == 1
    again = units - 1 if root_holds else units
    return [{"all_gather": units + again, "all_to_all": units}] * ACCUMULATION


def expected_train_batch_window(stage, defer, units):
    """One whole train_batch window: the micro-steps' collectives summed, plus one small reduction
    of the window's real sample and loss totals (an all-gather of a few numbers,
    ``collectives.small_sum``), which carries the squared gradient norm of sharded gradients too
    (clipped or not): no reduction of its own."""
    total: dict = {"small all_gather": 1}
    for step in _micro_step_collectives(stage, defer, units):
        for kind, count in step.items():
            total[kind] = total.get(kind, 0) + count
    return total


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_collectives_per_micro_step_are_pinned():
    """Every stage and defer setting, manual loop and train_batch, with and without clipping.
    A window of the manual loop sends nothing before its last micro-step at stages 0/1
    ("one gradient all-reduce per window") and when deferring."""
    cases = [(0, False, 10**8), (1, False, 10**8)] + [(stage, defer, unit) for stage in (2, 3)
                                                      for defer in (False, True) for unit in (LAYER_PARAMS, 10**8)]
    scenarios = {case: functools.partial(collectives_per_window, stage=case[0], defer=case[1], unit=case[2])
                 for case in cases}
    results = run_scenarios(scenarios, world_size=2, timeout=200)
    for (stage, defer, unit), per_rank in results.items():
        units = LAYERS if unit == LAYER_PARAMS else 1
        manual = expected_collectives(stage, defer, units)
        clipped_boundary = manual[-1]  # the norm is computed anyway
        for got in per_rank:
            case = (stage, defer, unit, got)
            assert got["manual"] == manual, case
            assert got["manual clipped"] == manual[:-1] + [clipped_boundary], case
            assert got["train_batch"] == expected_train_batch_window(stage, defer, units), case
            assert got["train_batch clipped"] == expected_train_batch_window(stage, defer, units), case


def test_shard_units_group_consecutive_layers_by_size():
    from engine.strategies.fsdp import shard_units

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4),
                              torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
    groups = shard_units(net, 40)  # each Linear holds 20 parameters
    assert [[type(m).__name__ for m in group] for group in groups] == [["Linear", "GELU", "Linear"],
                                                                       ["Linear", "Linear"]]
    assert shard_units(net, 10**6) == []  # everything in one unit: the root's
    assert len(shard_units(net, 1)) == 4


# -- defer_reduction: auto ---------------------------------------------------------------------------
def auto_deferral(rank, world, limit):
    extra = {} if limit is None else {"auto_memory_limit": float(limit)}
    eng = make_engine(world, 2, "auto", **extra)
    batch = window(world)
    decisions = []
    for _ in range(4):
        decisions.append(eng.strategy.deferral.deferring)
        eng.train_batch(batch, mse)
    with CommCounter() as comm:
        eng.train_batch(batch, mse)
    return {"decisions": decisions, "reductions": comm.calls["all_to_all"]}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_defer_reduction_auto_defers_only_when_it_fits():
    """Stage 2, 2 ranks: per micro-step the held bytes are P + 4P/W; deferring needs P more.
    A limit above that defers from the third window on (the first is not used: AdamW creates
    its state at its end); one below keeps reducing every micro-step; no limit on CPU keeps
    ZeRO memory."""
    roomy, tight = 2 * P + 2 * P + P // 2, P + 2 * P + P // 2
    scenarios = {"roomy": functools.partial(auto_deferral, limit=roomy),
                 "tight": functools.partial(auto_deferral, limit=tight),
                 "no limit": functools.partial(auto_deferral, limit=None)}
    results = run_scenarios(scenarios, world_size=2, timeout=100)
    for result in results["roomy"]:
        assert result["decisions"] == [False, False, True, True] and result["reductions"] == 1, result
    for name in ("tight", "no limit"):
        for result in results[name]:
            assert result["decisions"] == [False] * 4 and result["reductions"] == ACCUMULATION, (name, result)


def test_defer_reduction_values_are_checked():
    with pytest.raises(engine.ConfigError, match="expected true, false or 'auto', got 'sometimes'"):
        engine.load_config({"zero_optimization": {"stage": 2, "defer_reduction": "sometimes"}})
    with pytest.raises(engine.ConfigError, match="reduce_every_micro_step: replaced by defer_reduction"):
        engine.load_config({"zero_optimization": {"stage": 2, "reduce_every_micro_step": True}})




# -- an evaluation forward between windows ------------------------------------------------------------
def held_after_evaluation(rank, world, defer):
    eng = make_engine(world, 3, defer)
    batch = window(world)
    eng.train_batch(batch, mse)
    after_step = held_bytes(eng.strategy)
    with torch.no_grad():
        eng(batch[0][:MICRO])
    after_forward = held_bytes(eng.strategy)
    eng.eval_batch(batch, mse)
    return {"after_step": after_step, "after_forward": after_forward, "after_eval": held_bytes(eng.strategy)}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_evaluation_forward_after_a_deferred_window_leaves_zero3_sharded():
    """ZeRO-3 with defer_reduction keeps what a window's forwards gather until its step; a
    forward without gradients between windows has no step to free it: it reshards itself."""
    results = run_scenarios({f"defer={defer}": functools.partial(held_after_evaluation, defer=defer)
                             for defer in (False, True)}, world_size=2)
    for name, ranks in results.items():
        for held in ranks:
            assert held["after_forward"] == held["after_eval"] == held["after_step"], (name, held)
