"""Schedules: DeepSpeed's formulas, torch's indexing (the lr used by optimizer step t)."""

import inspect
import math

import pytest
import torch

from engine.config.optim import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_optimizer


def lrs(scheduler, steps):
    values = []
    for _ in range(steps):
        values.append(scheduler.optimizer.param_groups[0]["lr"])
        scheduler.optimizer.step()
        scheduler.step()
    return values


def optimizer(lr=0.5):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_warmup_lr_linear_and_log():
    assert lrs(WarmupLR(optimizer(), 0.1, 0.5, 4, "linear"), 6) == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.5])
    log_values = lrs(WarmupLR(optimizer(), 0.0, 1.0, 10, "log"), 11)
    assert log_values == pytest.approx([math.log(t + 1) / math.log(10) for t in range(10)] + [1.0])


def test_warmup_lr_defaults_to_the_optimizer_lr():
    assert lrs(WarmupLR(optimizer(0.4), warmup_num_steps=2, warmup_type="linear"), 3) == pytest.approx([0.0, 0.2, 0.4])


def test_warmup_decay_reaches_min_at_total_steps():
    values = lrs(WarmupDecayLR(optimizer(), total_num_steps=6, warmup_min_lr=0.0, warmup_max_lr=1.0,
                               warmup_num_steps=2, warmup_type="linear"), 8)
    assert values == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def test_warmup_cosine():
    values = lrs(WarmupCosineLR(optimizer(1.0), total_num_steps=6, warmup_num_steps=2, cos_min_ratio=0.0,
                                warmup_type="linear"), 7)
    cosine = [(1 + math.cos(math.pi * min(1.0, (t - 1) / 4))) / 2 for t in range(2, 7)]
    assert values == pytest.approx([0.0, 0.5] + cosine)
    assert values[-1] == pytest.approx(0.0)


def test_bad_warmup_arguments():
    with pytest.raises(ValueError, match="warmup_type"):
        WarmupLR(optimizer(), warmup_type="cubic")
    with pytest.raises(ValueError, match="warmup_num_steps"):
        WarmupLR(optimizer(), warmup_num_steps=0)


def test_deepspeed_adam_means_adamw_when_adam_w_mode():
    class Section:
        type = "Adam"
        params = {"lr": 1e-3, "betas": [0.9, 0.95], "adam_w_mode": True, "torch_adam": True}

    opt = build_optimizer(Section, [torch.nn.Parameter(torch.zeros(1))])
    assert type(opt) is torch.optim.AdamW and opt.defaults["betas"] == (0.9, 0.95)


@pytest.mark.parametrize("params,expected", [({}, torch.optim.AdamW), ({"adam_w_mode": False}, torch.optim.Adam)])
def test_deepspeed_adam_defaults_to_adamw(params, expected):
    class Section:
        type = "Adam"

    Section.params = {"lr": 1e-3, **params}
    assert type(build_optimizer(Section, [torch.nn.Parameter(torch.zeros(1))])) is expected


def _section(type_name, params):
    class Section:
        type = type_name

    Section.params = params
    return Section


@pytest.mark.parametrize("type_name", ["Adam", "AdamW"])
def test_deepspeed_adam_types_default_to_no_weight_decay(type_name):
    """DeepSpeed builds Adam / AdamW without weight decay unless the config sets it: one step
    with a zero gradient leaves the weights where they were (torch's AdamW would shrink them)."""
    weight = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer(_section(type_name, {"lr": 1e-1}), [weight])
    weight.grad = torch.zeros(3)
    opt.step()
    assert torch.equal(weight.detach(), torch.ones(3))
    assert opt.defaults["weight_decay"] == 0.0


def test_torch_adam_keeps_torchs_defaults():
    opt = build_optimizer(_section("AdamW", {"lr": 1e-3, "torch_adam": True}), [torch.nn.Parameter(torch.zeros(1))])
    assert opt.defaults["weight_decay"] == torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).defaults[
        "weight_decay"]


@pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("type_name", ["Adam", "AdamW"])
def test_adam_defaults_equal_deepspeeds_fused_adam(type_name):
    """lr, betas, eps and weight decay of a section that sets none of them: DeepSpeed's FusedAdam's."""
    from deepspeed.ops.adam.fused_adam import FusedAdam  # importing builds nothing

    theirs = {name: p.default for name, p in inspect.signature(FusedAdam).parameters.items()}
    ours = build_optimizer(_section(type_name, {}), [torch.nn.Parameter(torch.zeros(1))]).defaults
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert ours[key] == theirs[key], key
