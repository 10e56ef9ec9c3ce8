"""``import engine.compat.deepspeed as deepspeed``: the same DeepSpeed script and JSON train
the same model as DeepSpeed itself (stages 0 and 2, clipping by the config and by
DeepSpeed's default, WarmupLR, a checkpoint round trip), and equal the float64 full-batch
reference. Clipping at every step would hide a constant factor in the weighting, so a second
script runs without clipping, with unequal and short micro-batches: exact against the
reference, DeepSpeed's 1/A where DeepSpeed weights so, and broken facades miss. Two gloo ranks;
DeepSpeed runs on its CPU accelerator (fp32: it refuses float64)."""

import argparse
import functools
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import engine
import engine.compat.deepspeed as compat_deepspeed
from engine.batching.plan import plan_from_config
from tests.support import broken
from tests.support.dist_utils import run_scenarios
from tests.support.reference import mlp, reference_train, regression_batches, sgd

REPO = Path(__file__).resolve().parents[2]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
F32 = torch.float32
TOL = 1e-6  # fp32 runs against each other and against the float64 reference

BASE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05,
                                                     "warmup_num_steps": 3}}}
CONFIGS = {
    "stage0": {**BASE, "gradient_clipping": 0.5, "zero_optimization": {"stage": 0}},
    # no gradient_clipping: DeepSpeed's 1.0; DeepSpeed wants the switch for SGD at ZeRO-2
    "stage2": {**BASE, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True},
}
CLIP = {"stage0": 0.5, "stage2": 1.0}
# The same JSON with Microstep's DeepSpeed backend underneath the facade.
CONFIGS["stage2-backend-deepspeed"] = {**CONFIGS["stage2"], "backend": "deepspeed"}
CLIP["stage2-backend-deepspeed"] = CLIP["stage2"]


def batches():
    """Four global batches; targets scaled so that the gradient norm exceeds the clip."""
    return [(x, 4 * y) for x, y in regression_batches(4, 8, dtype=F32)]


def flat(state_dict) -> torch.Tensor:
    return torch.cat([v.detach().flatten().double().cpu() for v in state_dict.values()])


def training_script(deepspeed, config, save_dir):
    """A DeepSpeed training script as users write it, for whichever ``deepspeed`` it is given:
    forward / backward / step per micro-batch, a checkpoint with client state, a resume."""
    model = mlp(dtype=F32)
    model_engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config)
    rank, world = model_engine.global_rank, model_engine.world_size
    accumulation, micro = model_engine.gradient_accumulation_steps(), model_engine.train_micro_batch_size_per_gpu()
    record = {"lr": [], "norm": [], "boundary": []}

    def train(steps):
        for x, y in steps:
            share = len(x) // world
            x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
            for k in range(accumulation):
                part = slice(k * micro, (k + 1) * micro)
                loss = F.mse_loss(model_engine(x[part].to(model_engine.device)), y[part].to(model_engine.device))
                model_engine.backward(loss)
                record["boundary"].append(model_engine.is_gradient_accumulation_boundary())
                if record["boundary"][-1]:
                    record["lr"].append(model_engine.get_lr()[0])
                model_engine.step()
            record["norm"].append(model_engine.get_global_grad_norm())

    data = batches()
    train(data[:2])
    model_engine.save_checkpoint(save_dir, client_state={"seen": 2})
    train(data[2:4])
    first = flat(model_engine.module_state_dict())
    counters = (model_engine.global_steps, model_engine.global_samples)
    path, client_state = model_engine.load_checkpoint(save_dir)
    resumed_counters = (model_engine.global_steps, model_engine.global_samples)
    train(data[2:4])
    again = flat(model_engine.module_state_dict())
    with open(os.path.join(save_dir, "latest")) as f:
        latest = f.read().strip()
    sizes = (model_engine.train_batch_size(), micro, accumulation)
    model_engine.destroy()
    return {**record, "first": first, "again": again, "counters": counters, "resumed": resumed_counters,
            "latest": latest, "tag": os.path.relpath(path, save_dir).split(os.sep)[0],
            "client": client_state.get("seen"), "sizes": sizes}


def real_deepspeed(rank, world_size, name, root):
    from engine.adapters.deepspeed_internals import import_deepspeed

    return training_script(import_deepspeed(), CONFIGS[name], os.path.join(root, f"ds-{name}"))


def microstep(rank, world_size, name, root):
    return training_script(compat_deepspeed, CONFIGS[name], os.path.join(root, f"ms-{name}"))


# -- no clipping: the weighting itself, with unequal and short micro-batches -----------------------
# Clipping at every step (above) rescales each update to the clip norm, which hides a constant
# factor in the gradient (a 2x or 1/A weighting moves the result by ~1e-8 there). Without it,
# with SGD + momentum, the weighting shows directly.
NO_CLIP = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
           "zero_allow_untested_optimizer": True}
# window -> rank -> its micro-batch sizes: equal; unequal within and between ranks; a short last one
UNEQUAL = [[(2, 2), (2, 2)], [(3, 1), (1, 3)], [(2, 1), (2, 1)]]


def unequal_windows():
    """Every window's micro-batches, per rank (fp32; targets scaled as in batches())."""
    g = torch.Generator().manual_seed(5)
    return [[[(torch.randn(n, 8, generator=g), 4 * torch.randn(n, 3, generator=g)) for n in sizes]
             for sizes in window] for window in UNEQUAL]


def unequal_script(deepspeed, config, breaks=None):
    """The model after each window of UNEQUAL, run by ``deepspeed`` (either one); ``breaks``: a
    tests.support.broken variant applied to the facade's engine."""
    model = mlp(dtype=F32)
    model_engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if breaks is not None:
        breaks(model_engine.engine)
    states = []
    for window in unequal_windows():
        for x, y in window[model_engine.global_rank]:
            model_engine.backward(F.mse_loss(model_engine(x.to(model_engine.device)), y.to(model_engine.device)))
            model_engine.step()
        states.append(flat(model_engine.module_state_dict()))
    model_engine.destroy()
    return states


def unequal_real_deepspeed(rank, world_size, stage):
    from engine.adapters.deepspeed_internals import import_deepspeed

    return unequal_script(import_deepspeed(), {**NO_CLIP, "zero_optimization": {"stage": stage}})


def unequal_microstep(rank, world_size, stage, breaks=None):
    return unequal_script(compat_deepspeed, {**NO_CLIP, "zero_optimization": {"stage": stage}}, breaks)


def unequal_reference(weight):
    """Float64 SGD + momentum on every window's micro-batches at once, each micro-batch's mean
    loss weighted by ``weight(samples, window_samples)``; the model after each window."""
    model = mlp(dtype=F32).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    states = []
    for window in unequal_windows():
        parts = [(x.double(), y.double()) for rank in window for x, y in rank]
        total = sum(len(x) for x, _ in parts)
        optimizer.zero_grad()
        sum(weight(len(x), total) * F.mse_loss(model(x), y) for x, y in parts).backward()
        optimizer.step()
        states.append(flat(model.state_dict()))
    return states


BUGS = (broken.weighted_one_over_a, broken.gradient_doubled)  # facades that got the weighting wrong


def exact_weights(samples, total):
    return samples / total  # the mean over the window's samples


def one_over_a_weights(samples, total):
    return 1 / (NO_CLIP["gradient_accumulation_steps"] * 2)  # every micro-batch 1/A, every rank 1/W


def latest_as_rank_0_reads_it(rank, world_size, root):
    """Ranks whose views of ``latest`` differ (rank 1's lags, as on a file system that syncs late):
    every rank loads the checkpoint rank 0 reads, instead of some loading another or none."""
    save_dir = os.path.join(root, "latest")
    model_engine, *_ = compat_deepspeed.initialize(model=mlp(dtype=F32), config=CONFIGS["stage0"])
    x, y = batches()[0]
    for tag in ("first", "second"):
        for k in range(2):
            part = slice(4 * rank + 2 * k, 4 * rank + 2 * k + 2)
            model_engine.backward(F.mse_loss(model_engine(x[part]), y[part]))
            model_engine.step()
        model_engine.save_checkpoint(save_dir, tag=tag)
    if rank == 1:
        time.sleep(1.0)  # rank 0 has read latest by now
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write("first")
    try:
        path, _ = model_engine.load_checkpoint(save_dir)
        outcome = os.path.basename(path)
    except engine.MicrostepError as error:
        outcome = f"{type(error).__name__}: {error}"
    model_engine.destroy()
    return outcome


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("compat_ds"))
    scenarios = {}
    for name in CONFIGS:
        if HAS_DEEPSPEED or "backend" not in CONFIGS[name]:
            scenarios[f"microstep-{name}"] = functools.partial(microstep, name=name, root=root)
        if HAS_DEEPSPEED and "backend" not in CONFIGS[name]:
            scenarios[f"deepspeed-{name}"] = functools.partial(real_deepspeed, name=name, root=root)
    scenarios["latest"] = functools.partial(latest_as_rank_0_reads_it, root=root)
    for stage in (0, 2):
        scenarios[f"microstep-noclip-stage{stage}"] = functools.partial(unequal_microstep, stage=stage)
    for bug in BUGS:
        scenarios[f"microstep-noclip-{bug.__name__}"] = functools.partial(unequal_microstep, stage=2, breaks=bug)
    if HAS_DEEPSPEED:
        scenarios["deepspeed-noclip-stage2"] = functools.partial(unequal_real_deepspeed, stage=2)
    return run_scenarios(scenarios, world_size=2, timeout=300, env=ENV)


@pytest.mark.parametrize("stage", [0, 2])
def test_without_clipping_unequal_and_short_micro_batches_equal_the_reference(runs, stage):
    exact, one_over_a = unequal_reference(exact_weights), unequal_reference(one_over_a_weights)
    for states in runs[f"microstep-noclip-stage{stage}"]:
        assert all((ours - expected).abs().max() < TOL for ours, expected in zip(states, exact))
    # the 1/A weighting agrees on the equal window, then misses by far more than the tolerance
    assert (one_over_a[0] - exact[0]).abs().max() < TOL
    assert all((wrong - expected).abs().max() > 1000 * TOL for wrong, expected in zip(one_over_a[1:], exact[1:]))


@pytest.mark.parametrize("bug", BUGS, ids=lambda bug: bug.__name__)
def test_without_clipping_a_weighting_bug_misses_the_reference(runs, bug):
    exact = unequal_reference(exact_weights)
    for states in runs[f"microstep-noclip-{bug.__name__}"]:
        assert (states[-1] - exact[-1]).abs().max() > 1000 * TOL


@needs_deepspeed
def test_without_clipping_deepspeed_weights_by_one_over_a_where_the_facade_is_exact(runs):
    """DeepSpeed's own semantics: equal micro-batches give the facade's model; unequal or short
    ones are weighted 1/A by DeepSpeed (its result is the 1/A reference), exactly by the facade."""
    one_over_a = unequal_reference(one_over_a_weights)
    for ours, theirs in zip(runs["microstep-noclip-stage2"], runs["deepspeed-noclip-stage2"]):
        assert (ours[0] - theirs[0]).abs().max() < TOL
        assert all((state - wrong).abs().max() < TOL for state, wrong in zip(theirs, one_over_a))
        assert (ours[-1] - theirs[-1]).abs().max() > 1000 * TOL


def test_every_rank_loads_the_checkpoint_rank_0_finds_in_latest(runs):
    first, second = runs["latest"]
    assert first == second and first in ("first", "second"), (first, second)


def reference(lrs, clip):
    """Plain float64 PyTorch on each whole global batch, with the learning rates DeepSpeed used."""
    model = mlp(dtype=F32).double()
    data = [(x.double(), y.double()) for x, y in batches()]
    trained = reference_train(
        model, data, lambda m, b: F.mse_loss(m(b[0]), b[1]),
        lambda params: torch.optim.SGD(params, lr=1.0, momentum=0.9), clip=clip,
        scheduler_factory=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lrs[t]))
    return flat(trained.state_dict())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_script_trains_the_reference_model(runs, name):
    if f"microstep-{name}" not in runs:
        pytest.skip("deepspeed is not installed")
    for result in runs[f"microstep-{name}"]:
        assert result["sizes"] == (8, 2, 2)
        assert result["boundary"] == [False, True] * 6
        # DeepSpeed's WarmupLR from warmup_min_lr (the first two steps), then log warm-up
        assert result["lr"][:4] == pytest.approx([0.01, 0.01, 0.01 + 0.04 * 0.6309297535714574, 0.05])
        assert all(norm > CLIP[name] for norm in result["norm"])  # clipping engaged at every step
        assert (result["first"] - reference(result["lr"], CLIP[name])).abs().max() < TOL
        assert torch.equal(result["first"], result["again"])  # resuming reproduces the run
        assert result["counters"] == (4, 32) and result["resumed"] == (2, 16)
        assert (result["latest"], result["tag"], result["client"]) == ("global_step2", "global_step2", 2)


@needs_deepspeed
@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_script_trains_what_deepspeed_trains(runs, name):
    theirs_name = name.removesuffix("-backend-deepspeed")
    for ours, theirs in zip(runs[f"microstep-{name}"], runs[f"deepspeed-{theirs_name}"]):
        assert (ours["first"] - theirs["first"]).abs().max() < TOL
        assert (ours["again"] - theirs["again"]).abs().max() < TOL
        assert ours["lr"] == pytest.approx(theirs["lr"])
        # DeepSpeed 0.19 reports no norm at stage 0 (None); the facade reports it at every stage
        reported = [(mine, float(norm)) for mine, norm in zip(ours["norm"], theirs["norm"]) if norm is not None]
        assert len(reported) == (0 if theirs_name == "stage0" else len(ours["norm"]))
        assert all(mine == pytest.approx(norm, rel=1e-5) for mine, norm in reported)
        assert ours["boundary"] == theirs["boundary"]
        for key in ("counters", "resumed", "latest", "tag", "client", "sizes"):
            assert ours[key] == theirs[key], key


def test_the_comparison_tells_clipping_and_schedules_apart(runs):
    """What a facade could get wrong misses the tolerance: no default clipping, or torch's
    scheduler indexing (every learning rate one step earlier)."""
    result = runs["microstep-stage2"][0]
    assert (result["first"] - reference(result["lr"], 0.0)).abs().max() > 1000 * TOL
    earlier = result["lr"][1:4] + [result["lr"][3]] * 2  # torch's: f(t), warm after 3 steps
    assert (result["first"] - reference(earlier, CLIP["stage2"])).abs().max() > 1000 * TOL


# -- single process: the facade's surface ----------------------------------------------------------
def test_add_config_arguments_reads_deepspeeds_flags(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}')
    parser = compat_deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    model = mlp(dtype=F32)
    model.note = "the model's own attribute"
    model_engine, optimizer, loader, scheduler = compat_deepspeed.initialize(args=args, model=model)
    assert loader is None and scheduler is None and isinstance(optimizer, torch.optim.SGD)
    assert model_engine.gradient_clipping() == 1.0  # DeepSpeed's default
    assert model_engine.train_batch_size() == 4 and model_engine.gradient_accumulation_steps() == 1
    assert model_engine.local_rank == 0 and model_engine.device.type == "cpu"
    assert model_engine.training and model_engine.eval() is model_engine and not model_engine.module.training
    assert model_engine.note == "the model's own attribute"  # passed through to the model, as DeepSpeed does
    with pytest.raises(engine.EngineUsageError, match="both from --deepspeed_config and from initialize"):
        compat_deepspeed.initialize(args=args, model=model, config={"train_batch_size": 4})
    with pytest.raises(engine.EngineUsageError, match="needs a config"):
        compat_deepspeed.initialize(args=argparse.Namespace(), model=model)
    model_engine.destroy()


def test_what_the_facade_cannot_do_is_refused(tmp_path):
    model_engine, *_ = compat_deepspeed.initialize(
        model=mlp(dtype=F32), config={**BASE, "train_batch_size": 4, "gradient_clipping": 0.0})
    assert model_engine.gradient_clipping() == 0.0
    x, y = regression_batches(1, 2, dtype=F32)[0]
    with pytest.raises(engine.EngineUsageError, match="retain_graph"):
        model_engine.backward(F.mse_loss(model_engine(x), y), retain_graph=True)
    with pytest.raises(engine.EngineUsageError, match="scale_wrt_gas"):
        model_engine.backward(F.mse_loss(model_engine(x), y), scale_wrt_gas=False)
    with pytest.raises(engine.EngineUsageError, match=r"step\(\) called without a backward\(\) since the last "
                                                      r"step\(\): each micro-step is model_engine\(batch\), "
                                                      r"model_engine.backward\(loss\), model_engine.step\(\)") as no:
        model_engine.step()
    assert "eng." not in str(no.value)  # the facade's names, not the engine's
    assert model_engine.load_checkpoint(str(tmp_path)) == (None, None)  # no latest file, as DeepSpeed
    with pytest.raises(engine.EngineUsageError, match="load_optimizer_states=False"):
        model_engine.load_checkpoint(str(tmp_path), load_optimizer_states=False)
    model_engine.destroy()
    with pytest.raises(engine.ConfigError, match="no optimizer given.*or pass optimizer= to initialize"):
        compat_deepspeed.initialize(model=mlp(dtype=F32), config={"train_batch_size": 4})


@pytest.mark.parametrize("settings, problem", [
    ({"train_micro_batch_size_per_gpu": "auto"},
     r"train_micro_batch_size_per_gpu: 'auto': give a number \('auto' in a DeepSpeed JSON written for the Hugging "
     r"Face Trainer is a placeholder.*the DeepSpeed-style loop forms its own micro-batches"),
    ({"train_micro_batch_size_per_gpu": "explore"}, r"'explore': give a number; the DeepSpeed-style loop"),
    ({"micro_batch_tokens": 64}, r"micro_batch_tokens: the DeepSpeed-style loop forms its own micro-batches"),
])
def test_what_only_train_batch_can_do_is_refused_at_initialize(tmp_path, settings, problem):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, **settings,
                                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}))
    with pytest.raises(engine.ConfigError, match=problem) as refused:
        compat_deepspeed.initialize(model=mlp(dtype=F32), config=str(path))
    assert str(refused.value).startswith(f"{path}:")  # where the key was written


def test_a_data_defined_plans_train_batch_size_is_the_last_windows():
    config = {"gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    model_engine, *_ = compat_deepspeed.initialize(model=mlp(dtype=F32), config=config)
    with pytest.raises(engine.EngineUsageError, match=r"train_batch_size\(\): the config gives only "
                       r"gradient_accumulation_steps.*known once a window has closed"):
        model_engine.train_batch_size()
    x, y = regression_batches(1, 4, dtype=F32)[0]
    for part in (slice(0, 1), slice(1, 4)):
        model_engine.backward(F.mse_loss(model_engine(x[part]), y[part]))
        model_engine.step()
    assert model_engine.train_batch_size() == 4 and model_engine.train_micro_batch_size_per_gpu() is None
    model_engine.destroy()


class SharedShift(torch.nn.Module):
    """A model given, beside the batch, a tensor the whole batch shares ([1, d], as position_ids
    [1, T] often are): the inputs have no one batch dimension."""

    def __init__(self):
        super().__init__()
        self.inner = mlp()

    def forward(self, x, shift):
        return self.inner(x + shift)


def test_inputs_without_one_batch_dimension_count_as_the_plans_micro_batches(caplog):
    """With train_micro_batch_size_per_gpu set, such inputs weigh as the plan's sizes (a warning,
    once) instead of failing at backward; equal to the float64 full-batch reference."""
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}
    model_engine, *_ = compat_deepspeed.initialize(model=SharedShift(), config=config)
    batches = regression_batches(2, 4)
    shift = torch.zeros(1, 8, dtype=torch.float64)
    for x, y in batches:
        for part in (slice(0, 2), slice(2, 4)):
            model_engine.backward(F.mse_loss(model_engine(x[part], shift), y[part]))
            model_engine.step()
    expected = reference_train(mlp(), batches, lambda m, b: F.mse_loss(m(b[0]), b[1]), sgd).state_dict()
    ours = model_engine.module_state_dict()
    assert max((ours[f"inner.{k}"] - v).abs().max().item() for k, v in expected.items()) < 1e-12
    warned = [r.getMessage() for r in caplog.records if "do not share a first (batch) dimension" in r.getMessage()]
    assert len(warned) == 1, warned
    assert "args[0]: 2, args[1]: 1" in warned[0] and "micro-batch of 2 samples" in warned[0], warned
    model_engine.destroy()


@pytest.mark.parametrize("drop_last, batches_", [(True, 4), (False, 5)])
def test_dataloader_drop_last_is_honoured_without_a_not_used_warning(recwarn, drop_last, batches_):
    config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "dataloader_drop_last": drop_last}
    model_engine, _, loader, _ = compat_deepspeed.initialize(model=mlp(dtype=F32), config=config,
                                                             training_data=TensorDataset(torch.randn(18, 8)))
    assert len(loader) == batches_  # 18 samples in micro-batches of 4
    assert not [w for w in recwarn if "dataloader_drop_last" in str(w.message)]
    model_engine.destroy()


@pytest.mark.parametrize("epochs", [
    [None, None, None],  # no set_epoch: every pass in epoch 0's order, as DeepSpeed's sampler
    [0, 1, 2],           # the script calls loader.data_sampler.set_epoch(e) / loader.set_epoch(e)
])
def test_the_loader_gives_each_optimizer_step_deepspeeds_samples_in_every_epoch(epochs):
    """The samples of every optimizer step over all ranks are those DeepSpeed's
    DistributedSampler-based loader gives (the split between the ranks may differ)."""
    dataset = TensorDataset(torch.arange(40))
    config = engine.load_config(BASE)
    ours, theirs = {}, {}
    for rank in range(2):
        plan = plan_from_config(config, 2, rank)
        loader = compat_deepspeed.MicroBatchLoader(dataset, plan)
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, seed=0)  # DeepSpeed's loader
        assert len(loader) == 10
        for pass_, epoch in enumerate(epochs):
            if epoch is not None:
                loader.data_sampler.set_epoch(epoch)
                sampler.set_epoch(epoch)
            for i, (ids,) in enumerate(loader):
                assert len(ids) == 2
                ours.setdefault((pass_, i // 2), set()).update(ids.tolist())
            for i, (ids,) in enumerate(DataLoader(dataset, batch_size=2, sampler=sampler)):
                theirs.setdefault((pass_, i // 2), set()).update(ids.tolist())
    assert ours == theirs and all(len(ids) == 8 for ids in ours.values())
    assert (ours[(0, 0)] == ours[(1, 0)]) == (epochs[1] is None)


@needs_deepspeed
@pytest.mark.parametrize("name, params", [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05, "warmup_num_steps": 4}),
    ("WarmupLR", {"warmup_num_steps": 3, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 7, "warmup_min_lr": 0.01, "warmup_max_lr": 0.05, "warmup_num_steps": 3}),
    ("WarmupDecayLR", {"total_num_steps": 7, "warmup_num_steps": 3}),  # DeepSpeed's default peak: 0.001
    ("WarmupLR", {}),
    ("WarmupCosineLR", {"total_num_steps": 7}),
    ("LRRangeTest", {}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 0.5,
                     "lr_range_test_staircase": True}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3}),
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2, "cycle_second_step_size": 3,
                  "cycle_first_stair_count": 2, "decay_lr_rate": 0.5, "decay_step_size": 1}),
    ("WarmupCosineLR", {"total_num_steps": 7, "warmup_num_steps": 3, "warmup_min_ratio": 0.1}),
])
def test_deepspeed_schedules_step_as_deepspeeds_own(name, params):
    from engine.adapters.deepspeed_internals import import_deepspeed
    from engine.config.schema import SchedulerConfig
    from engine.config.optim import build_deepspeed_scheduler, build_scheduler

    schedules = import_deepspeed().runtime.lr_schedules

    def rates(make):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler, out = make(optimizer), []
        for _ in range(8):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    section = SchedulerConfig(type=name, params=params)
    theirs = rates(lambda optimizer: getattr(schedules, name)(optimizer, **params))
    assert rates(lambda optimizer: build_deepspeed_scheduler(section, optimizer)) == pytest.approx(theirs, abs=1e-15)
    # engine.initialize's own schedules use torch's indexing: one step earlier
    assert rates(lambda optimizer: build_scheduler(section, optimizer))[:-1] == pytest.approx(theirs[1:], abs=1e-15)


@needs_deepspeed
@pytest.mark.parametrize("params", [{}, {"decay_mom_rate": 0.1, "decay_step_size": 2, "cycle_first_stair_count": 1}])
def test_one_cycle_cycles_adams_beta1_as_deepspeeds_own(params):
    from engine.adapters.deepspeed_internals import import_deepspeed
    from engine.config.schema import SchedulerConfig
    from engine.config.optim import build_deepspeed_scheduler

    schedules = import_deepspeed().runtime.lr_schedules
    params = {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2, **params}

    def betas(make):
        optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler, out = make(optimizer), []
        for _ in range(8):
            out += [optimizer.param_groups[0]["lr"], *optimizer.param_groups[0]["betas"]]
            optimizer.step()
            scheduler.step()
        return out

    theirs = betas(lambda optimizer: schedules.OneCycle(optimizer, **params))
    section = SchedulerConfig(type="OneCycle", params=params)
    assert betas(lambda optimizer: build_deepspeed_scheduler(section, optimizer)) == pytest.approx(theirs, abs=1e-15)
