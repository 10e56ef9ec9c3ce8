"""A loss_fn written for the other call, or returning something that is not a loss, is named
with what was expected and the fix (engine.window.loss_checks) before it fails inside the engine or
torch. The two-rank pipeline case is in tests/distributed/test_pipeline.py's misuse scenario, the engine's
train_batch cases in tests/support/scenarios.py's MISUSES."""

import pytest
import torch
import torch.nn.functional as F

import engine
from engine.errors import EngineUsageError
from engine.accounting import checked_count, unrecognised_loss
from engine.window.loss_checks import (check_loss_signature, model_call_refused,
                                       written_for_model)
from tests.support.reference import mlp, mse, regression_batches


def outputs_loss(outputs, labels):
    return F.mse_loss(outputs, labels)


@pytest.mark.parametrize("loss_fn, on_outputs, message", [
    (outputs_loss, False, r"without a pipeline the engine calls loss_fn\(model, micro_batch\); yours takes "
                          r"\(outputs, labels\)"),
    (torch.nn.MSELoss(), False, r"yours takes \(input, target\), a model's outputs"),  # torch's own losses
    (F.cross_entropy, False, r"yours takes \(input, target, weight, "),
    (lambda batch: batch, False, r"the engine calls loss_fn\(model, micro_batch\) \(two arguments\); yours takes "
                                 r"\(batch\)"),
    (lambda a, b, c: a, True, r"the engine calls loss_fn\(outputs, labels\) \(two arguments\); yours takes \(a, b, c\)"),
])
def test_a_loss_fn_written_for_the_other_call_is_named_with_its_fix(loss_fn, on_outputs, message):
    with pytest.raises(EngineUsageError, match=message):
        check_loss_signature(loss_fn, on_outputs)


@pytest.mark.parametrize("loss_fn, on_outputs", [
    (mse, False), (outputs_loss, True), (engine.loss_on_outputs(outputs_loss), False),
    (engine.loss_on_outputs(outputs_loss), True), (torch.nn.MSELoss(), True), (F.cross_entropy, True),
    (lambda *args: args[0], False),
    (mse, True),  # under a pipeline: the last stage applies the model's own loss for mapping batches
])
def test_what_fits_its_call_passes(loss_fn, on_outputs):
    check_loss_signature(loss_fn, on_outputs)


def test_a_model_call_under_a_pipeline_with_pair_batches_is_named_with_its_fixes():
    assert written_for_model(mse) and not written_for_model(outputs_loss)
    assert not written_for_model(engine.loss_on_outputs(outputs_loss))
    message = str(model_call_refused(mse))
    assert "under a pipeline the last stage calls loss_fn(outputs, labels)" in message and "(model, batch)" in message
    assert "mapping batch with 'input_ids' and 'labels'" in message and "@engine.loss_on_outputs" in message


def test_returns_that_are_not_a_loss_say_what_came_back():
    loss = torch.tensor(1.0)
    assert checked_count((loss, 7), 7) == 7
    with pytest.raises(EngineUsageError, match=r"got a tuple of 2: \(a tensor of shape \[\], a tensor of shape "
                                               r"\[4, 11\]\): a pair is read as \(loss_sum, num_items\)"):
        checked_count((loss, torch.zeros(4, 11)), torch.zeros(4, 11))
    assert "return output['loss']" in str(unrecognised_loss({"loss": loss, "logits": loss}))
    assert "got a tuple of 3" in str(unrecognised_loss((loss, loss, loss)))


def test_eval_batch_checks_the_loss_fn_too():
    eng = engine.initialize(mlp(), {"train_batch_size": 4}, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(EngineUsageError, match=r"yours takes \(outputs, labels\)"):
        eng.eval_batch(regression_batches(1, 4)[0], outputs_loss)
    with pytest.raises(EngineUsageError, match=r"is not a count. Returning \(loss, logits\)"):
        eng.eval_batch(regression_batches(1, 4)[0], lambda model, batch: (mse(model, batch), model(batch[0])))
