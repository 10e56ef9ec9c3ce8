"""Single-process engine against the full-batch reference (float64)."""

import copy
import logging

import pytest
import torch

import engine
from engine.batching.microbatch import split_batch
from tests.support.broken import clipped_each_micro_step, gradient_doubled, intact, keeps_failed_windows, weighted_one_over_a
from tests.support.reference import (
    TinyLM, adamw, max_param_diff, mlp, mse, reference_train, regression_batches, sgd, state,
    token_batches, token_loss_mean, token_loss_sum,
)
from tests.support.scenarios import assert_misuse_errors, misuse_errors, train_batch_failing_at

TOL = 1e-10

# (global batch, micro batch, split): strict shapes and balanced ones with unequal micro-batches
SHAPES = [
    (8, 8, "strict"),
    (8, 4, "strict"),
    (8, 2, "strict"),
    (8, 1, "strict"),
    (12, 3, "strict"),
    (10, 4, "balanced"),  # micro-batches 4, 3, 3
    (7, 2, "balanced"),  # 2, 2, 2, 1
]


def make_engine(model, global_batch, micro, split="strict", optimizer=sgd, **extra):
    config = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
              "batch_split": split, **extra}
    return engine.initialize(model, config, optimizer=optimizer)


def manual_loop(eng, batches, loss_fn):
    """DeepSpeed-style loop: one forward / backward / step per micro-batch."""
    for batch in batches:
        for micro_batch in split_batch(batch, eng.plan.micro_batch_sizes):
            eng.backward(loss_fn(eng, micro_batch))
            eng.step()


@pytest.mark.parametrize("global_batch,micro,split", SHAPES)
@pytest.mark.parametrize("optimizer", [sgd, adamw], ids=["sgd", "adamw"])
def test_manual_loop_equals_full_batch(global_batch, micro, split, optimizer):
    model, batches = mlp(), regression_batches(3, global_batch)
    expected = reference_train(model, batches, mse, optimizer)
    eng = make_engine(copy.deepcopy(model), global_batch, micro, split, optimizer)
    manual_loop(eng, batches, mse)
    assert max_param_diff(state(eng.module), state(expected)) < TOL
    assert eng.global_steps == 3
    assert eng.global_samples == 3 * global_batch
    assert eng.micro_steps == 3 * eng.plan.gradient_accumulation_steps


@pytest.mark.parametrize("global_batch,micro,split", SHAPES)
@pytest.mark.parametrize("optimizer", [sgd, adamw], ids=["sgd", "adamw"])
def test_train_batch_equals_full_batch(global_batch, micro, split, optimizer):
    model, batches = mlp(), regression_batches(3, global_batch)
    expected = reference_train(model, batches, mse, optimizer)
    eng = make_engine(copy.deepcopy(model), global_batch, micro, split, optimizer)
    for batch in batches:
        eng.train_batch(batch, mse)
    assert max_param_diff(state(eng.module), state(expected)) < TOL


def test_train_batch_returns_the_global_batch_loss():
    model, (batch,) = mlp(), regression_batches(1, 10)
    expected = mse(model, batch).item()
    eng = make_engine(copy.deepcopy(model), 10, 4, "balanced")
    assert eng.train_batch(batch, mse) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("micro", [6, 3, 2, 1])
def test_token_weighted_loss_equals_full_batch(micro):
    model, batches = TinyLM(), token_batches(3, 6)
    expected = reference_train(model, batches, token_loss_mean, sgd)
    eng = make_engine(copy.deepcopy(model), 6, micro)
    losses = [eng.train_batch(batch, token_loss_sum) for batch in batches]
    assert max_param_diff(state(eng.module), state(expected)) < TOL
    # the returned loss is the mean over the window's valid tokens, as the gradient
    assert losses[0] == pytest.approx(token_loss_mean(model, batches[0]).item(), rel=1e-12)


def test_token_weighted_manual_loop_equals_full_batch():
    model, batches = TinyLM(), token_batches(2, 6)
    expected = reference_train(model, batches, token_loss_mean, sgd)
    eng = make_engine(copy.deepcopy(model), 6, 2)
    manual_loop(eng, batches, token_loss_sum)
    assert max_param_diff(state(eng.module), state(expected)) < TOL


def test_naive_average_of_micro_batch_means_differs():
    """What the engine avoids: averaging per-micro-batch token means with a fixed 1/A."""
    model, (batch,) = TinyLM(), token_batches(1, 6)
    expected = reference_train(model, [batch], token_loss_mean, sgd)
    naive = copy.deepcopy(model)
    optimizer = sgd(naive.parameters())
    for micro_batch in split_batch(batch, (2, 2, 2)):
        (token_loss_mean(naive, micro_batch) / 3).backward()
    optimizer.step()
    assert max_param_diff(state(naive), state(expected)) > 1e-4


def test_short_last_window_manual_flush():
    model, batches = mlp(), regression_batches(2, 8)
    short = (batches[1][0][:4], batches[1][1][:4])  # 2 of the 4 planned micro-batches
    expected = reference_train(model, [batches[0], short], mse)
    eng = make_engine(copy.deepcopy(model), 8, 2)
    manual_loop(eng, [batches[0]], mse)
    for micro_batch in split_batch(short, (2, 2)):
        eng.backward(mse(eng, micro_batch))
        assert eng.step() is False
    assert eng.step(flush=True) is True
    assert max_param_diff(state(eng.module), state(expected)) < TOL
    assert (eng.global_steps, eng.global_samples) == (2, 12)
    assert eng.step(flush=True) is False  # nothing left to flush


@pytest.mark.parametrize("short_size", [5, 4])
def test_short_last_batch_in_train_batch(short_size):
    model, batches = mlp(), regression_batches(2, 8)
    short = (batches[1][0][:short_size], batches[1][1][:short_size])
    expected = reference_train(model, [batches[0], short], mse, sgd)
    eng = make_engine(copy.deepcopy(model), 8, 2)
    eng.train_batch(batches[0], mse)
    eng.train_batch(short, mse)
    assert max_param_diff(state(eng.module), state(expected)) < TOL
    assert eng.global_samples == 8 + short_size


def test_parameters_change_only_at_boundaries():
    model, batches = mlp(), regression_batches(2, 8)
    eng = make_engine(copy.deepcopy(model), 8, 2, optimizer=adamw, scheduler={"type": "StepLR", "params": {"step_size": 1, "gamma": 0.5}})
    before, lr_before = state(eng.module), eng.optimizer.param_groups[0]["lr"]
    updates = []
    for batch in batches:
        for micro_batch in split_batch(batch, eng.plan.micro_batch_sizes):
            eng.backward(mse(eng, micro_batch))
            boundary = eng.is_gradient_accumulation_boundary()
            stepped = eng.step()
            assert stepped == boundary
            after = state(eng.module)
            changed = max_param_diff(after, before) > 0
            assert changed == stepped
            if not stepped:
                assert eng.optimizer.param_groups[0]["lr"] == lr_before
            updates.append(stepped)
            before, lr_before = after, eng.optimizer.param_groups[0]["lr"]
    assert updates == [False, False, False, True] * 2


def test_optimizer_state_untouched_inside_a_window():
    eng = make_engine(mlp(), 8, 2, optimizer=adamw)
    (batch,) = regression_batches(1, 8)
    for micro_batch in split_batch(batch, (2, 2, 2, 2))[:3]:
        eng.backward(mse(eng, micro_batch))
        eng.step()
        assert eng.optimizer.state == {}


def test_is_gradient_accumulation_boundary_matches_deepspeed_semantics():
    eng = make_engine(mlp(), 4, 2)
    (batch,) = regression_batches(1, 4)
    first, second = split_batch(batch, (2, 2))
    assert not eng.is_gradient_accumulation_boundary()
    eng.backward(mse(eng, first))
    assert not eng.is_gradient_accumulation_boundary()
    eng.step()
    assert eng.is_gradient_accumulation_boundary()  # the micro-step now starting closes the window
    eng.backward(mse(eng, second))
    assert eng.is_gradient_accumulation_boundary()
    assert eng.step()


def test_clipping_sees_the_whole_window_gradient():
    model, batches = mlp(), regression_batches(3, 8)
    big_sgd = lambda p: torch.optim.SGD(p, lr=1.0)  # noqa: E731
    expected = reference_train(model, batches, mse, big_sgd, clip=0.05)
    eng = make_engine(copy.deepcopy(model), 8, 2, optimizer=big_sgd, gradient_clipping=0.05)
    manual_loop(eng, batches, mse)
    assert max_param_diff(state(eng.module), state(expected)) < TOL
    assert eng.last_window.step.grad_norm.item() > 0.05  # clipping really acted


def test_scheduler_steps_once_per_optimizer_step():
    model, batches = mlp(), regression_batches(4, 8)
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1,
                                               "warmup_num_steps": 4, "warmup_type": "linear"}}
    eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 8, "gradient_accumulation_steps": 4,
                                                   "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                                   "scheduler": schedule})
    lrs = []
    for batch in batches:
        lrs.append(eng.optimizer.param_groups[0]["lr"])
        for micro_batch in split_batch(batch, eng.plan.micro_batch_sizes):
            eng.backward(mse(eng, micro_batch))
            eng.step()
    assert lrs == pytest.approx([0.0, 0.025, 0.05, 0.075])
    assert eng.lr_scheduler.last_epoch == eng.global_steps == 4
    expected = reference_train(
        model, batches, mse, lambda p: torch.optim.SGD(p, lr=0.1),
        scheduler_factory=lambda o: engine.config.optim.WarmupLR(o, 0.0, 0.1, 4, "linear"))
    assert max_param_diff(state(eng.module), state(expected)) < TOL


def test_zero_grad_cannot_wipe_a_window_in_progress():
    model, (batch,) = mlp(), regression_batches(1, 8)
    expected = reference_train(model, [batch], mse)
    eng = make_engine(copy.deepcopy(model), 8, 2)
    for micro_batch in split_batch(batch, eng.plan.micro_batch_sizes):
        eng.zero_grad()  # Colossal-style loops call this every iteration
        eng.backward(mse(eng, micro_batch))
        eng.step()
    assert max_param_diff(state(eng.module), state(expected)) < TOL


def test_eval_batch_is_the_mean_over_the_batch_and_changes_nothing():
    model, (batch,) = mlp(), regression_batches(1, 10)
    eng = make_engine(copy.deepcopy(model), 10, 4, "balanced")
    before = state(eng.module)
    assert eng.eval_batch(batch, mse) == pytest.approx(mse(model, batch).item(), rel=1e-12)
    assert max_param_diff(state(eng.module), before) == 0
    assert eng.module.training
    tokens = token_batches(1, 6)[0]
    lm = make_engine(TinyLM(), 6, 4, "balanced")
    assert lm.eval_batch(tokens, token_loss_sum) == pytest.approx(token_loss_mean(lm.module, tokens).item(), rel=1e-12)


# -- the same families, broken: each misses the tolerance the engine meets -----------------
def family_workload(loss, global_batch):
    """Model, three global batches, the engine's loss and the reference's loss for ``loss``."""
    if loss == "mse":
        return mlp(), regression_batches(3, global_batch), mse, mse
    return TinyLM(), token_batches(3, global_batch), token_loss_sum, token_loss_mean


def family_manual(global_batch, micro, split, loss="mse"):
    """Three windows of the manual loop (mean losses, or (sum, count) token losses)."""
    def run(breaks):
        model, batches, loss_fn, reference_loss = family_workload(loss, global_batch)
        expected = reference_train(model, batches, reference_loss, sgd)
        eng = breaks(make_engine(copy.deepcopy(model), global_batch, micro, split))
        manual_loop(eng, batches, loss_fn)
        return max_param_diff(state(eng.module), state(expected))
    return run


def family_train_batch(global_batch, micro, split, short=None, clip=0.0, loss="mse"):
    """Three windows of train_batch; ``short``: the last batch holds that many samples."""
    def run(breaks):
        model, batches, loss_fn, reference_loss = family_workload(loss, global_batch)
        if short:
            batches[-1] = tuple(t[:short] for t in batches[-1])
        expected = reference_train(model, batches, reference_loss, sgd, clip=clip)
        eng = breaks(make_engine(copy.deepcopy(model), global_batch, micro, split, gradient_clipping=clip))
        for batch in batches:
            eng.train_batch(batch, loss_fn)
        return max_param_diff(state(eng.module), state(expected))
    return run


def family_flush(breaks):
    """A full window, then a manual-loop window closed after 2 of its 4 micro-steps."""
    model, batches = mlp(), regression_batches(2, 8)
    short = (batches[1][0][:4], batches[1][1][:4])
    expected = reference_train(model, [batches[0], short], mse)
    eng = breaks(make_engine(copy.deepcopy(model), 8, 2))
    manual_loop(eng, [batches[0]], mse)
    for micro_batch in split_batch(short, (2, 2)):
        eng.backward(mse(eng, micro_batch))
        eng.step()
    eng.step(flush=True)
    return max_param_diff(state(eng.module), state(expected))


def family_failed_batch(breaks):
    """A window whose loss function raises at its third micro-step, then the same batch again."""
    model, (batch,) = mlp(), regression_batches(1, 8)
    expected = reference_train(model, [batch], mse)
    eng = breaks(make_engine(copy.deepcopy(model), 8, 2))
    train_batch_failing_at(eng, batch)
    eng.train_batch(batch, mse)
    return max_param_diff(state(eng.module), state(expected))


FAMILIES = {  # name: (scenario, the bug it must catch)
    "manual strict": (family_manual(8, 2, "strict"), gradient_doubled),
    "manual balanced": (family_manual(7, 2, "balanced"), weighted_one_over_a),
    "manual tokens": (family_manual(6, 2, "strict", loss="tokens"), weighted_one_over_a),
    "train_batch strict": (family_train_batch(8, 2, "strict"), gradient_doubled),
    "train_batch balanced": (family_train_batch(10, 4, "balanced"), weighted_one_over_a),
    "train_batch tokens": (family_train_batch(6, 2, "strict", loss="tokens"), weighted_one_over_a),
    "train_batch short window": (family_train_batch(8, 2, "strict", short=5), weighted_one_over_a),
    "train_batch clipped": (family_train_batch(8, 2, "strict", clip=0.05), clipped_each_micro_step),
    "flush": (family_flush, weighted_one_over_a),
    "failed batch": (family_failed_batch, keeps_failed_windows),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_misses_the_tolerance_when_broken(family):
    scenario, bug = FAMILIES[family]
    assert scenario(intact) < TOL
    assert scenario(bug) > 1e-4, family  # measured: 1e-3 to 1e-1


def test_adamw_hides_what_sgd_shows():
    """Why the weighting tests train with SGD and momentum: a gradient twice too large moves
    SGD's parameters by 0.1 but AdamW's by 3e-7 (measured), inside the fp32 tests' 1e-6."""
    model, batches = mlp(), regression_batches(3, 8)
    for optimizer, bound in ((sgd, 1e-2), (adamw, 1e-6)):
        expected = reference_train(model, batches, mse, optimizer)
        eng = gradient_doubled(make_engine(copy.deepcopy(model), 8, 2, optimizer=optimizer))
        manual_loop(eng, batches, mse)
        diff = max_param_diff(state(eng.module), state(expected))
        assert (diff > bound) if optimizer is sgd else (diff < bound), (optimizer.__name__, diff)


# -- misuse -------------------------------------------------------------------------------
def test_misuse_errors_say_what_is_wrong_and_change_nothing():
    assert_misuse_errors(misuse_errors(lambda: make_engine(mlp(), 8, 2)), world_size=1)


def test_a_batch_smaller_than_its_window_is_an_error():
    eng = make_engine(mlp(), 8, 2)
    (batch,) = regression_batches(1, 3)  # 4 micro-steps cannot share 3 samples
    with pytest.raises(engine.EngineUsageError, match="pass exactly 8 samples"):
        eng.train_batch(batch, mse)
    assert eng.global_steps == 0


# -- construction -------------------------------------------------------------------------
def test_optimizer_from_config_factory_or_instance_agree():
    model, batches = mlp(), regression_batches(2, 8)
    results = []
    for kwargs, extra in [
        ({}, {"optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}}),
        ({"optimizer": adamw}, {}),
        ({"optimizer": "instance"}, {}),
    ]:
        m = copy.deepcopy(model)
        if kwargs.get("optimizer") == "instance":
            kwargs = {"optimizer": adamw(m.parameters())}
        eng = engine.initialize(m, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, **extra}, **kwargs)
        for batch in batches:
            eng.train_batch(batch, mse)
        results.append(state(eng.module))
    assert max_param_diff(results[0], results[1]) == 0
    assert max_param_diff(results[0], results[2]) == 0


def test_unknown_optimizer_type_lists_the_known_ones():
    with pytest.raises(engine.ConfigError, match=r"unknown optimizer type 'Adamm'.*AdamW.*SGD"):
        engine.initialize(mlp(), {"train_batch_size": 4, "optimizer": {"type": "Adamm"}})


def test_unknown_scheduler_type_lists_the_known_ones():
    with pytest.raises(engine.ConfigError, match=r"unknown scheduler type.*WarmupCosineLR"):
        engine.initialize(mlp(), {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                  "scheduler": {"type": "Warmup"}})


def test_bad_optimizer_params_name_the_problem():
    with pytest.raises(engine.ConfigError, match=r"optimizer.params: SGD.*momentum_typo"):
        engine.initialize(mlp(), {"train_batch_size": 4,
                                  "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum_typo": 1}}})


def test_missing_optimizer_says_how_to_add_one():
    with pytest.raises(engine.ConfigError, match="no optimizer given"):
        engine.initialize(mlp(), {"train_batch_size": 4})


def test_optimizer_on_other_parameters_is_refused():
    with pytest.raises(ValueError, match="not the model's"):
        engine.initialize(mlp(), {"train_batch_size": 4}, optimizer=sgd(mlp().parameters()))


def batchnorm_model():
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))


def test_batchnorm_with_accumulation_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="engine"):
        engine.initialize(batchnorm_model(), {"train_batch_size": 8, "gradient_accumulation_steps": 2}, optimizer=sgd)
    assert "statistics over the batch" in caplog.text and "GroupNorm" in caplog.text and "SyncBatchNorm" in caplog.text


def test_batchnorm_with_accumulation_can_be_an_error():
    with pytest.raises(engine.ConfigError, match="batch_statistics"):
        engine.initialize(batchnorm_model(), {"train_batch_size": 8, "gradient_accumulation_steps": 2,
                                              "batch_statistics": "error"}, optimizer=sgd)
    engine.initialize(batchnorm_model(), {"train_batch_size": 8, "batch_statistics": "error"}, optimizer=sgd)


def test_a_failing_loss_function_leaves_no_half_window():
    model, (batch,) = mlp(), regression_batches(1, 8)
    expected = reference_train(model, [batch], mse)
    eng = make_engine(copy.deepcopy(model), 8, 2)
    train_batch_failing_at(eng, batch)
    assert eng.micro_steps == 0 and all(p.grad is None for p in eng.module.parameters())
    eng.train_batch(batch, mse)  # the same batch again: as if the failure never happened
    assert max_param_diff(state(eng.module), state(expected)) < TOL


def test_a_window_without_items_is_skipped():
    eng = make_engine(TinyLM(), 6, 2)
    batch = token_batches(1, 6)[0]
    batch["labels"][:] = -100
    before = state(eng.module)
    eng.train_batch(batch, token_loss_sum)
    assert max_param_diff(state(eng.module), before) == 0
    assert (eng.global_steps, eng.skipped_steps) == (1, 1)


def test_loss_fn_may_return_a_model_output_with_a_loss():
    class Output:
        def __init__(self, loss):
            self.loss = loss

    model, (batch,) = mlp(), regression_batches(1, 8)
    expected = reference_train(model, [batch], mse)
    eng = make_engine(copy.deepcopy(model), 8, 4)
    eng.train_batch(batch, lambda m, b: Output(mse(m, b)))
    assert max_param_diff(state(eng.module), state(expected)) < TOL


def test_eval_loss_fn_gets_the_engine():
    eng = make_engine(mlp(), 8, 4)
    (batch,) = regression_batches(1, 8)
    assert eng.eval_batch(batch, lambda m, b: mse(m.module, b)) == pytest.approx(mse(eng.module, batch).item())


def test_short_batch_message_when_no_short_window_is_possible():
    eng = make_engine(mlp(), 4, 1)
    (batch,) = regression_batches(1, 3)
    with pytest.raises(engine.EngineUsageError) as error:
        eng.train_batch(batch, mse)
    assert "pass exactly 4 samples" in str(error.value) and "short window" not in str(error.value)


def test_model_without_trainable_parameters_is_refused():
    model = mlp().requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to train"):
        engine.initialize(model, {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})


def test_auto_placeholder_in_optimizer_params_is_refused():
    with pytest.raises(engine.ConfigError, match=r"optimizer.params.lr: 'auto' is a Hugging Face"):
        engine.initialize(mlp(), {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})


def test_manual_loop_warns_once_when_micro_batches_differ_from_the_plan(caplog):
    eng = make_engine(mlp(), 8, 2)
    (batch,) = regression_batches(1, 8)
    with caplog.at_level(logging.WARNING, logger="engine"):
        for micro_batch in split_batch(batch, (4, 4)):
            eng.backward(mse(eng, micro_batch))
            eng.step()
    assert caplog.text.count("got 4 samples but the plan expects 2") == 1
