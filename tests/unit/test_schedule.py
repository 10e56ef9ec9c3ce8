"""A window as a schedule (engine.schedule) run by one executor (engine.window.executor): the generators'
actions, and a dense model's windows asking no hook of the experts' code."""

from __future__ import annotations

import copy

import pytest
import torch

import engine
from engine.experts import window as experts_window
from engine.schedule import (BACKWARD, COUNT, EVALUATE, EXCHANGE, FORWARD, WINDOW, counted_first, forwards_only,
                             held_forwards, one_after_another)
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
