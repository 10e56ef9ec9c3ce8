"""``deepspeed.checkpointing`` through the facade, as Megatron-DeepSpeed models call it: a model
checkpointing its layers with ``deepspeed.checkpointing.checkpoint`` trains through
``deepspeed.initialize`` to the float64 full-batch reference; dropout draws the same masks in
the recomputation (the broken variant, RNG not restored, misses); ``configure`` reads the
config's ``activation_checkpointing`` section, its keywords win, ``cpu_checkpointing`` keeps the
inputs in host memory, and what it does not do is said."""

import copy

import pytest
import torch
import torch.nn.functional as F

import engine.compat.deepspeed as deepspeed
from engine.compat.deepspeed import checkpointing
from engine.errors import ConfigError
from tests.support.reference import max_param_diff, reference_train, regression_batches, sgd, state

TOL = 1e-12


class MegatronStyle(torch.nn.Module):
    """Layers run through deepspeed.checkpointing.checkpoint once it is configured (as
    Megatron-DeepSpeed's transformer does with --checkpoint-activations)."""

    def __init__(self, dropout=0.0):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                                              torch.nn.Dropout(dropout)) for _ in range(3))
        self.head = torch.nn.Linear(8, 3)
        self.double()

    def forward(self, x):
        for layer in self.layers:
            x = deepspeed.checkpointing.checkpoint(layer, x) if deepspeed.checkpointing.is_configured() else layer(x)
        return self.head(x)


@pytest.fixture(autouse=True)
def unconfigured(monkeypatch):
    monkeypatch.setattr(checkpointing, "_configured", None)


CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
          "activation_checkpointing": {"cpu_checkpointing": True, "partition_activations": False}}


def test_a_megatron_style_model_trains_through_the_facade_to_the_full_batch_reference():
    model, batches = MegatronStyle(), regression_batches(2, 8)
    expected = reference_train(model, batches, lambda m, b: F.mse_loss(m(b[0]), b[1]))  # not configured: no checkpoint
    assert not deepspeed.checkpointing.is_configured()
    deepspeed.checkpointing.configure(None, deepspeed_config=CONFIG)
    assert deepspeed.checkpointing.is_configured()
    eng, *_ = deepspeed.initialize(model=copy.deepcopy(model), optimizer=sgd, config=CONFIG)
    for x, y in batches:
        for k in range(2):
            eng.backward(F.mse_loss(eng(x[4 * k:4 * k + 4]), y[4 * k:4 * k + 4]))
            eng.step()
    assert max_param_diff(state(eng.module), state(expected)) < TOL


def gradients(model, x, *, checkpointed):
    model = copy.deepcopy(model)
    torch.manual_seed(7)  # the same dropout draws in every run
    if checkpointed:
        deepspeed.checkpointing.configure(None)
    else:
        checkpointing._configured = None
    model(x).square().sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_dropout_draws_the_same_masks_in_the_recomputation(monkeypatch):
    model, (x, _) = MegatronStyle(dropout=0.3), regression_batches(1, 8)[0]
    plain = gradients(model, x, checkpointed=False)
    assert max_param_diff(gradients(model, x, checkpointed=True), plain) < TOL
    original = torch.utils.checkpoint.checkpoint  # the broken variant: fresh masks when recomputing
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda fn, *args, **kwargs: original(fn, *args, **{**kwargs, "preserve_rng_state": False}))
    assert max_param_diff(gradients(model, x, checkpointed=True), plain) > 1e-3


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    packed = 0

    def __init__(self, pin_memory=False):
        super().__init__(pin_memory=pin_memory)
        pack = self.pack_hook

        def counting(tensor):
            CountingSaveOnCpu.packed += 1
            return pack(tensor)

        self.pack_hook = counting


@pytest.mark.parametrize("config, keywords, on_cpu", [
    (CONFIG, {}, True),                                     # the config's section
    (CONFIG, {"checkpoint_in_cpu": False}, False),          # a keyword wins over it, as in DeepSpeed
    ({"train_batch_size": 8}, {"checkpoint_in_cpu": True}, True),
    (None, {}, False),
])
def test_configure_reads_the_config_section_and_cpu_checkpointing_keeps_the_inputs_on_the_host(
        monkeypatch, config, keywords, on_cpu):
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    CountingSaveOnCpu.packed = 0
    deepspeed.checkpointing.configure(None, deepspeed_config=config, **keywords)
    model, (x, _) = MegatronStyle(), regression_batches(1, 8)[0]
    model(x).sum().backward()
    assert (CountingSaveOnCpu.packed == 3) == on_cpu and (CountingSaveOnCpu.packed == 0) != on_cpu  # one per layer


def test_what_configure_cannot_do_is_said_and_what_deepspeed_refuses_is_refused():
    with pytest.warns(UserWarning, match=r"synchronize_checkpoint_boundary, profile \(DeepSpeed's buffer layout and "
                                         r"timing aids\) are not done by Microstep; results are the same"):
        deepspeed.checkpointing.configure(None, synchronize=True, profile=True)
    with pytest.raises(ConfigError, match="contiguous_memory_optimization: needs partition_activations: true"):
        deepspeed.checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.raises(ConfigError, match="contiguous_memory_optimization: needs number_checkpoints"):
        deepspeed.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {
            "partition_activations": True, "contiguous_memory_optimization": True}})

    class TwoRanks:  # Megatron's mpu
        def get_model_parallel_world_size(self):
            return 2

    with pytest.warns(UserWarning, match="each of the 2 model-parallel ranks keeps the checkpointed inputs whole"):
        deepspeed.checkpointing.configure(TwoRanks(), partition_activations=True)
