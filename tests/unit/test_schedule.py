"""A window as a schedule (engine.schedule) run by one executor (engine.window.executor): the generators'
actions, and a dense model's windows asking no hook of the experts' code."""

from __future__ import annotations

import copy

import pytest
import torch

import engine
from engine.experts import window as experts_window
from engine.adapters.pipelining import forward_actions, torch_order
from engine.schedule import (BACKWARD, COUNT, EVALUATE, EXCHANGE, FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT, WINDOW,
                             StageAction, counted_first, forwards_first, forwards_only, gpipe, held_forwards,
                             interleaved, one_after_another, one_f_one_b, splits_backward, zero_bubble_v)
from engine.strategies.stage_schedules import SCHEDULES, ScheduleRules
from tests.support.reference import mlp, mse, regression_batches, sgd


def test_the_generators_say_each_micro_batch_once_in_its_order():
    assert one_after_another(2) == [(FORWARD, 0), (BACKWARD, 0), (FORWARD, 1), (BACKWARD, 1)]
    assert counted_first(2) == [(COUNT, 0), (COUNT, 1), (EXCHANGE, WINDOW), (FORWARD, 0), (BACKWARD, 0),
                                (FORWARD, 1), (BACKWARD, 1)]
    assert held_forwards(2) == [(FORWARD, 0), (FORWARD, 1), (EXCHANGE, WINDOW), (BACKWARD, 0), (BACKWARD, 1)]
    assert forwards_only(2) == [(EVALUATE, 0), (EVALUATE, 1)]


def test_a_dense_model_touches_no_experts_code(monkeypatch):
    """Every function and method of engine.experts.window raises: a dense model's training window, its
    evaluation and the manual loop still run (its windows have no hooks), and its loss is the window's."""
    def refuse(*args, **kwargs):
        raise AssertionError("a dense model's window called the experts' code")

    for name, value in list(vars(experts_window.ExpertBalance).items()):
        if callable(value) and not name.startswith("__"):
            monkeypatch.setattr(experts_window.ExpertBalance, name, refuse)
    model = mlp()
    batch = regression_batches(1, 8)[0]
    with torch.no_grad():
        whole_batch_loss = float(mse(copy.deepcopy(model), batch))
    eng = engine.initialize(model, {"train_batch_size": 8, "gradient_accumulation_steps": 2}, optimizer=sgd)
    assert eng.window_hooks is None
    assert eng.eval_batch(batch, mse) == pytest.approx(whole_batch_loss, rel=1e-12)
    assert eng.train_batch(batch, mse) == pytest.approx(whole_batch_loss, rel=1e-12)
    assert eng.global_steps == 1
    for k in range(2):
        x, y = batch[0][4 * k:4 * k + 4], batch[1][4 * k:4 * k + 4]
        eng.backward(torch.nn.functional.mse_loss(eng(x), y))
        eng.step()
    assert eng.global_steps == 2
    assert (eng.experts.last_load, eng.experts.routing_differences) == (None, 0)


# -- a pipeline's schedules ------------------------------------------------------------------------------
def runs(name: str, ranks: int, micro_batches: int) -> bool:
    """Whether the engine runs schedule ``name`` with ``micro_batches`` (engine.strategies.stage_schedules)."""
    return ScheduleRules(name, ranks).runs(micro_batches)


def simulated(order: dict[int, list[StageAction]], stages: int) -> tuple[int, dict[int, int]]:
    """Run ``order`` on every rank in lockstep, one action per rank per tick, each action waiting for what
    it needs (a forward for the stage before's forward, a backward for its own forward and the stage after's
    backward, a weight gradient for its input gradient). Returns the ticks taken and, per rank, the most
    micro-batches whose activations it held at once; fails on a deadlock or an action run twice or never."""
    done: set = set()
    position = dict.fromkeys(order, 0)
    held = dict.fromkeys(order, 0)
    peak = dict.fromkeys(order, 0)
    backward_kinds = (BACKWARD, INPUT_GRADIENT)

    def ready(action: StageAction) -> bool:
        stage, kind, k = action
        if kind == FORWARD:
            return stage == 0 or (stage - 1, FORWARD, k) in done
        if kind == WEIGHT_GRADIENT:
            return (stage, INPUT_GRADIENT, k) in done
        after = stage == stages - 1 or any((stage + 1, b, k) in done for b in backward_kinds)
        return (stage, FORWARD, k) in done and after

    ticks = 0
    while any(position[rank] < len(actions) for rank, actions in order.items()):
        ran = [(rank, order[rank][position[rank]]) for rank in order
               if position[rank] < len(order[rank]) and ready(order[rank][position[rank]])]
        assert ran, f"deadlock at tick {ticks}: {[order[r][position[r]] for r in order if position[r] < len(order[r])]}"
        for rank, action in ran:
            assert tuple(action) not in done, f"{action} run twice"
            done.add(tuple(action))
            position[rank] += 1
            held[rank] += {FORWARD: 1, BACKWARD: -1, INPUT_GRADIENT: -1}.get(action.kind, 0)
            peak[rank] = max(peak[rank], held[rank])
        ticks += 1
    return ticks, peak


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_pipeline_schedule_runs_each_micro_batch_once_per_stage_without_deadlock(name):
    for ranks in (2, 3, 4):
        for micro_batches in range(1, 13):
            if not runs(name, ranks, micro_batches):
                continue
            order = SCHEDULES[name](ranks, micro_batches)
            stages = len({action.stage for actions in order.values() for action in actions})
            ticks, peak = simulated(order, stages)
            kinds = (FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT) if splits_backward(order) else (FORWARD, BACKWARD)
            every = {(stage, kind, k) for stage in range(stages) for kind in kinds for k in range(micro_batches)}
            assert {tuple(a) for actions in order.values() for a in actions} == every
            assert sum(map(len, order.values())) == len(every)
            if name == "1f1b":  # rank r holds at most ranks - r micro-batches' activations (GPipe: all of them)
                assert all(peak[rank] <= ranks - rank for rank in order), (ranks, micro_batches, peak)
            if name == "gpipe":
                assert forwards_first(order) and max(peak.values()) == micro_batches
            else:
                assert not forwards_first(order) or micro_batches == 1


def test_the_pipeline_schedules_are_torchs_own_orders():
    """GPipe, interleaved 1F1B and zero-bubble V are the orders torch.distributed.pipelining's classes
    compute (the control: torch's own description of them, read from a schedule built without stages);
    1F1B is checked by simulation above (torch's description of its own 1F1B numbers the last rank's
    forwards from 1, where its runner starts from 0)."""
    from torch.distributed.pipelining import schedules

    letters = {"F": FORWARD, "B": BACKWARD, "I": INPUT_GRADIENT, "W": WEIGHT_GRADIENT}

    def torchs(cls, ranks: int, micro_batches: int, per_rank: int):
        described = object.__new__(cls)  # the order only: no stages, no process group
        described.pp_group_size, described._n_microbatches = ranks, micro_batches
        described.n_local_stages, described._num_stages = per_rank, ranks * per_rank
        described.num_stages = ranks * per_rank
        described.number_of_rounds = max(1, micro_batches // ranks)
        described.microbatches_per_round = micro_batches // described.number_of_rounds
        order = (described._get_pipeline_order() if per_rank == 1 else
                 {rank: described._calculate_single_rank_operations(rank) for rank in range(ranks)})
        return {rank: [StageAction(a.stage_index, letters[a.computation_type.value], a.microbatch_index)
                       for a in actions if a is not None and a.computation_type.value in letters]
                for rank, actions in order.items()}

    for ranks in (2, 3, 4):
        for micro_batches in range(1, 13):
            assert gpipe(ranks, micro_batches) == torchs(schedules.ScheduleGPipe, ranks, micro_batches, 1)
            assert zero_bubble_v(ranks, micro_batches) == torchs(schedules.ScheduleZBVZeroBubble, ranks,
                                                                 micro_batches, 2)
            if runs("interleaved", ranks, micro_batches):
                assert interleaved(ranks, micro_batches) == torchs(schedules.ScheduleInterleaved1F1B, ranks,
                                                                   micro_batches, 2)


def test_the_simulation_finds_an_order_that_cannot_run():
    """The control for the simulation above: the last rank asked for a backward before its forward waits forever."""
    broken = one_f_one_b(2, 4)
    broken[1][0], broken[1][1] = broken[1][1], broken[1][0]
    with pytest.raises(AssertionError, match="deadlock"):
        simulated(broken, 2)


def test_only_gpipe_runs_every_forward_first_for_any_window():
    """What lets a routed model hold its forwards under a pipeline (``WindowCapabilities.can_hold_forwards``
    of the pipeline holder): 1F1B's order is forwards-first for a window of one micro-batch, not for longer
    ones, so the rule asks every window."""
    assert forwards_first(one_f_one_b(2, 1)) and not forwards_first(one_f_one_b(2, 4))
    for ranks in (2, 3, 4):
        assert [name for name in SCHEDULES if ScheduleRules(name, ranks).forwards_first_in_any_window()] == ["gpipe"]


def test_an_evaluation_keeps_every_forward_and_its_messages():
    """An evaluation's schedule is the training order lowered by torch (its sends and receives added, FSDP's
    unshard and reshard), its backwards dropped (engine.adapters.pipelining.forward_actions): each stage's
    forwards are all there, nothing of a backward is left, every unshard is used by a forward before its
    reshard, and torch's own simulation of the messages runs it through without a deadlock."""
    from torch.distributed.pipelining import schedules as torch_schedules  # the lowering: torch's control

    kinds = torch_schedules._ComputationType
    for name in SCHEDULES:
        for ranks in (2, 3, 4):
            for micro_batches in range(1, 13):
                if not runs(name, ranks, micro_batches):
                    continue
                order = torch_order(ScheduleRules(name, ranks).order(micro_batches))
                stages = len({action.stage_index for actions in order.values() for action in actions})
                placed = torch_schedules._validate_schedule(order, ranks, stages, micro_batches)
                lowered = {rank: torch_schedules._add_reduce_grad(torch_schedules._add_unshard_reshard(actions),
                                                                  micro_batches) for rank, actions in order.items()}
                lowered = torch_schedules._add_send_recv(lowered, stage_to_rank=placed.__getitem__, num_stages=stages)
                forwards = forward_actions(lowered)
                computed = [(action.stage_index, action.microbatch_index) for actions in forwards.values()
                            for action in actions if action.computation_type == kinds.FORWARD]
                assert sorted(computed) == [(stage, k) for stage in range(stages) for k in range(micro_batches)]
                assert not any(action.computation_type in (kinds.FULL_BACKWARD, kinds.BACKWARD_INPUT,
                                                           kinds.BACKWARD_WEIGHT, kinds.SEND_B, kinds.RECV_B,
                                                           kinds.REDUCE_GRAD)
                               for actions in forwards.values() for action in actions)
                for actions in forwards.values():
                    unshard = set()
                    for action in actions:
                        if action.computation_type == kinds.UNSHARD:
                            unshard.add(action.stage_index)
                        elif action.computation_type == kinds.FORWARD:
                            unshard.discard(action.stage_index)
                        elif action.computation_type == kinds.RESHARD:
                            assert action.stage_index not in unshard, (name, ranks, micro_batches, action)
                computing = {rank: [action for action in actions
                                    if action.computation_type not in (kinds.UNSHARD, kinds.RESHARD)]
                             for rank, actions in forwards.items()}
                torch_schedules._simulate_comms_compute(computing, placed.__getitem__, stages)
