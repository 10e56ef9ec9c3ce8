"""The precision policy: parameters gathered and computed in bf16 / fp16 from fp32 masters,
gradients reduced and accumulated in fp32 (``data_types.grad_accum_dtype`` may ask for bf16),
autocast over fp32 parameters on request (``torch_autocast``). Exactness at every stage against
the float64 reference is tests/distributed/test_precision.py's scenario test, which runs this policy."""

import copy
import functools
import warnings

import pytest
import torch

import engine
from bench.precision_policy import PRECISIONS, accumulation_errors, gathered_bytes
from engine.config.checks import check_without_model
from engine.config.deepspeed import deepspeed_config
from engine.config.schema import load_config
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, mlp, regression_batches, state


def test_fp32_accumulation_stays_flat_as_the_window_grows_and_bf16_accumulation_does_not():
    """One window over a fixed batch of 64 split into A = 1 … 64 micro-steps: the applied
    gradient's error to the float64 full-batch gradient (docs/benchmarks.md has the table)."""
    errors = accumulation_errors((1, 4, 16, 64))
    fp32, bf16 = errors["bf16, fp32 accumulation"], errors["bf16, bf16 accumulation"]
    assert max(fp32.values()) < 1.1 * min(fp32.values()), fp32  # measured 4.65e-3 .. 4.75e-3
    assert fp32[1] == bf16[1]  # one micro-step: nothing accumulated
    assert bf16[1] < bf16[4] < bf16[16] < bf16[64], bf16  # measured 4.7e-3 → 1.05e-2
    assert bf16[64] > 2 * fp32[64], (bf16, fp32)
    assert max(errors["fp32 training"].values()) < 1e-6  # the measurement itself is exact


def test_bf16_parameters_compute_in_bf16_with_fp32_masters_optimizer_state_and_gradients():
    model = mlp(dtype=torch.float32)
    eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 8, "gradient_accumulation_steps": 2,
                                                   "bf16": {"enabled": True}},
                            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    seen = []
    eng.module[2].register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, m.weight.dtype)))
    gradients = []
    eng.module[0].weight.register_hook(lambda g: gradients.append(g.dtype))  # the master: never computed on
    x, y = regression_batches(1, 8, dtype=torch.float32)[0]
    output = eng(x[:4])
    assert output.dtype == torch.float32  # the loss is computed in fp32
    eng.backward(torch.nn.functional.mse_loss(output, y[:4]))
    eng.step()
    assert seen == [(torch.bfloat16, torch.bfloat16)] and gradients == []
    assert all(p.grad.dtype == torch.float32 for p in eng.module.parameters())  # accumulated in fp32
    eng.backward(torch.nn.functional.mse_loss(eng(x[4:]), y[4:]))
    eng.step()
    assert eng.global_steps == 1
    assert all(p.dtype == torch.float32 for p in eng.module.parameters())
    assert all(v.dtype == torch.float32 for s in eng.optimizer.state.values() for v in s.values() if v.dim())
    # the compute copy follows the masters: the next forward uses the updated weights in bf16
    with torch.no_grad():
        expected = torch.nn.functional.linear(x[:1].bfloat16(), eng.module[0].weight.bfloat16(),
                                              eng.module[0].bias.bfloat16())
        got = []
        eng.module[0].register_forward_hook(lambda m, i, o: got.append(o))
        eng(x[:1])
    assert torch.equal(got[-1], expected)


def test_torch_autocast_keeps_fp32_parameters_under_autocast():
    eng = engine.initialize(mlp(dtype=torch.float32), {"train_batch_size": 4, "bf16": {"enabled": True},
                                                       "torch_autocast": {"enabled": True}},
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    seen = []
    eng.module[2].register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, m.weight.dtype)))
    x, y = regression_batches(1, 4, dtype=torch.float32)[0]
    eng.train_batch((x, y), lambda model, batch: torch.nn.functional.mse_loss(model(batch[0]), batch[1]))
    assert seen == [(torch.bfloat16, torch.float32)]  # autocast casts per op; the weight stays fp32


# -- bytes ------------------------------------------------------------------------------------
def gathered(rank, world, stage):
    return {name: gathered_bytes(rank, world, stage, precision) for name, precision in PRECISIONS.items()}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_bf16_parameters_halve_the_bytes_gathered_per_step_at_zero_2_and_3():
    results = run_scenarios({stage: functools.partial(gathered, stage=stage) for stage in (2, 3)},
                            world_size=2, timeout=100)
    for stage, per_rank in results.items():
        for counts in per_rank:
            autocast, low = counts.values()
            assert autocast > 0 and low * 2 == autocast, (stage, counts)


# -- config ------------------------------------------------------------------------------------
def loaded(config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        return load_config(config), [str(w.message) for w in caught]


def test_the_sections_read_on_the_torch_backend_are_not_called_unused():
    config, notes = loaded({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"},
                            "torch_autocast": {"enabled": False}, "steps_per_print": 10})
    assert len(notes) == 1 and "steps_per_print" in notes[0] and "data_types" not in notes[0], notes
    _, notes = loaded({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["x"]}})
    assert any("lower_precision_safe_modules" in note for note in notes), notes


@pytest.mark.parametrize("section, message", [
    ({"data_types": {"grad_accum_dtype": "int8"}}, "data_types.grad_accum_dtype: expected fp32, bf16 or fp16"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "needs bf16.enabled"),
    ({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True, "dtype": "float16"}}, "contradicts bf16.enabled"),
    ({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}},
     "under torch_autocast gradients accumulate"),
])
def test_precision_sections_that_cannot_run_are_refused(section, message):
    config, _ = loaded({"train_batch_size": 4, **section})
    problems = check_without_model(config)
    assert any(message in problem for problem in problems), problems
    with pytest.raises(engine.ConfigError, match=message.split(":")[0]):
        engine.initialize(mlp(), config, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_deepspeed_backend_gets_its_sections_without_microsteps_keys():
    config, _ = loaded({"backend": "deepspeed", "data_types": {"grad_accum_dtype": "fp32"},
                        "compile": {"enabled": True, "mode": "default", "deepcompile": False},
                        "activation_checkpointing": {"enabled": True, "partition_activations": False}})
    ds = deepspeed_config(config, 1)
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["compile"] == {"deepcompile": False}
    assert ds["activation_checkpointing"] == {"partition_activations": False}


def test_a_checkpoint_of_bf16_training_resumes_into_the_compute_copy(tmp_path):
    """The fp32 masters are saved; after a load the half-precision copy computes with them."""
    config = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "bf16": {"enabled": True}}
    batches = [tuple(t.float() for t in b) for b in regression_batches(3, 8, dtype=torch.float32)]

    def loss_fn(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    def started():
        return engine.initialize(mlp(dtype=torch.float32), config,
                                 optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))

    through = started()
    for batch in batches:
        through.train_batch(batch, loss_fn)
    first = started()
    first.train_batch(batches[0], loss_fn)
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = started()
    resumed.load_checkpoint(tmp_path / "ckpt")
    for batch in batches[1:]:
        resumed.train_batch(batch, loss_fn)
    assert max_param_diff(state(resumed.module), state(through.module)) == 0
