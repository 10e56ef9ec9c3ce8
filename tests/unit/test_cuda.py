"""On a CUDA device (``python -m bench.gpu`` runs these): host batches, as a DataLoader gives
them, train the model the engine put on the GPU exactly as the float64 reference on the host."""

import copy

import pytest
import torch
import torch.nn.functional as F

import engine
from tests.support.reference import max_param_diff, mlp, mse, reference_train, regression_batches, sgd, state

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (python -m bench.gpu)")]


def cpu_state(eng) -> dict:
    return {name: tensor.cpu() for name, tensor in state(eng.module).items()}


def test_train_batch_moves_a_host_batch_to_the_device_and_equals_the_reference():
    model, batches = mlp(), regression_batches(3, 8)
    expected = state(reference_train(model, batches, mse, sgd))
    eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2},
                            optimizer=sgd)
    assert eng.device.type == "cuda"
    for batch in batches:  # on the host
        eng.train_batch(batch, mse)
    assert max_param_diff(cpu_state(eng), expected) < 1e-10
    eng.close()


def test_a_manual_loop_with_host_inputs_runs_on_the_device():
    model, batches = mlp(), regression_batches(2, 8)
    expected = state(reference_train(model, batches, mse, sgd))
    eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4},
                            optimizer=sgd)
    for x, y in batches:
        for xs, ys in zip(x.split(4), y.split(4)):
            output = eng(xs)  # the engine copies the input over
            assert output.device.type == "cuda"
            eng.backward(F.mse_loss(output, ys.to(eng.device)))  # the loss is the script's: its labels too
            eng.step()
    assert max_param_diff(cpu_state(eng), expected) < 1e-10
    eng.close()
