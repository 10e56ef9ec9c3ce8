"""``import engine.compat.colossalai as colossalai``: the legacy Colossal-AI tutorial's
gradient-accumulation loop runs with its import changed (parameters change only at
iterations 3 and 7), equals the float64 full-batch reference on 2 ranks whose data loaders
give unequal batches, and real Colossal-AI config shapes load, read and train."""

import functools
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import engine
import engine.compat.colossalai as colossalai
from engine.compat.colossalai import gpc
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, mlp, reference_train, state

TOL = 1e-10
TUTORIAL_CONFIG = """
BATCH_SIZE = 4
NUM_EPOCHS = 200
gradient_accumulation = 4
"""
DATASET_SIZES = {0: 29, 1: 32}  # per rank: rank 0's last batch holds 1 sample, rank 1's all hold 4


def rank_data(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    n = DATASET_SIZES[rank]
    return torch.randn(n, 8, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)


def tutorial(rank, world_size, config_path):
    """The legacy tutorial's script (gradient_accumulation), its import changed."""
    colossalai.launch_from_torch(config=config_path)
    model = mlp()
    x, y = rank_data(rank)
    train_dataloader = DataLoader(TensorDataset(x, y), batch_size=gpc.config.BATCH_SIZE)
    criterion = torch.nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine_, train_dataloader, _, lr_scheduler = colossalai.initialize(model, optimizer, criterion,
                                                                       train_dataloader, lr_scheduler=lr_scheduler)
    engine_.train()
    changed, previous = [], [p.detach().clone() for p in engine_.model.parameters()]
    for idx, (img, label) in enumerate(train_dataloader):
        engine_.zero_grad()
        output = engine_(img)
        train_loss = engine_.criterion(output, label)
        engine_.backward(train_loss)
        engine_.step()
        lr_scheduler.step()
        current = [p.detach().clone() for p in engine_.model.parameters()]
        if any(not torch.equal(a, b) for a, b in zip(previous, current)):
            changed.append(idx)
        previous = current
    result = {"changed": changed, "state": engine_.engine.full_state_dict(), "iterations": idx + 1,
              "samples": engine_.engine.global_samples, "lr": lr_scheduler.get_last_lr()[0],
              "constants": (gpc.config.BATCH_SIZE, gpc.config.NUM_EPOCHS, gpc.config.gradient_accumulation),
              "plan": engine_.engine.plan.describe()}
    engine_.engine.close()
    return result


@pytest.fixture(scope="module")
def tutorial_runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("colossal") / "config.py"
    path.write_text(TUTORIAL_CONFIG)
    return run_scenarios({"tutorial": functools.partial(tutorial, config_path=str(path))},
                         world_size=2, timeout=120)["tutorial"]


def reference():
    """Plain float64 PyTorch on each window's samples of both ranks, lr halved per window."""
    data = {rank: rank_data(rank) for rank in DATASET_SIZES}
    windows = []
    for w in range(2):
        start, stop = 16 * w, 16 * (w + 1)
        windows.append(tuple(torch.cat([data[r][i][start:stop] for r in sorted(data)]) for i in range(2)))
    return state(reference_train(
        mlp(), windows, lambda model, batch: F.mse_loss(model(batch[0]), batch[1]),
        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        scheduler_factory=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)))


def test_the_tutorial_updates_at_iterations_3_and_7_and_equals_the_reference(tutorial_runs):
    expected = reference()
    for result in tutorial_runs:
        assert result["changed"] == [3, 7] and result["iterations"] == 8
        assert result["constants"] == (4, 200, 4)
        assert "defined by the data" in result["plan"]
        assert result["samples"] == 29 + 32
        assert result["lr"] == pytest.approx(0.025)  # stepped once per window: 0.1 → 0.05 → 0.025
        assert max_param_diff(result["state"], expected) < TOL


def test_one_over_a_weighting_misses_the_tolerance():
    """Colossal-AI's own 1/A weighting (each rank's micro-batch means averaged) on the same
    data: the short batch of rank 0 makes it differ."""
    data = {rank: rank_data(rank) for rank in DATASET_SIZES}
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for w in range(2):
        optimizer.zero_grad()
        loss = sum(F.mse_loss(model(x[i:i + 4]), y[i:i + 4]) for x, y in data.values()
                   for i in range(16 * w, 16 * (w + 1), 4))
        (loss / 8).backward()
        optimizer.step()
        scheduler.step()
    assert max_param_diff(state(model), reference()) > 1000 * TOL


# -- real config shapes, one process ----------------------------------------------------------------
CONFIG_SHAPES = {
    "tutorial": (TUTORIAL_CONFIG, {"BATCH_SIZE": 4, "gradient_accumulation": 4, "NUM_EPOCHS": 200},
                 dict(accumulation=4, data_defined=True, clip=0.0, fp16=False)),
    "amp_and_clip": ("""
        from colossalai.amp import AMP_TYPE
        BATCH_SIZE = 2
        NUM_EPOCHS = 2
        fp16 = dict(mode=AMP_TYPE.TORCH)
        clip_grad_norm = 1.0
        """, {"clip_grad_norm": 1.0, "gradient_clipping": 1.0},
        dict(accumulation=1, data_defined=True, clip=1.0, fp16=True)),
    "parallel_and_legacy_keys": ("""
        BATCH_SIZE = 2
        parallel = dict(pipeline=1, tensor=dict(size=1, mode=None))
        gradient_accumulation = 2
        num_epochs = 2
        logging = dict(root_path="./logs")
        """, {"num_epochs": 2, "logging": {"root_path": "./logs"}},
        dict(accumulation=2, data_defined=True, clip=0.0, fp16=False)),
    "zero_section": ("""
        from colossalai.zero.shard_utils import TensorShardStrategy
        BATCH_SIZE = 2
        zero = dict(model_config=dict(shard_strategy=TensorShardStrategy()),
                    optimizer_config=dict(initial_scale=2**5))
        gradient_accumulation = 2
        clip_grad_norm = 0.5
        """, {"clip_grad_norm": 0.5},
        dict(accumulation=2, data_defined=True, clip=0.5, fp16=False)),
    "planned_batch": ("""
        train_micro_batch_size_per_gpu = 2
        gradient_accumulation = 2
        """, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
        dict(accumulation=2, data_defined=False, clip=0.0, fp16=False)),
}


@pytest.mark.parametrize("name", list(CONFIG_SHAPES))
def test_real_config_shapes_load_read_and_train(tmp_path, name):
    text, readable, expected = CONFIG_SHAPES[name]
    path = tmp_path / "config.py"
    path.write_text(textwrap.dedent(text))
    with warnings.catch_warnings():  # legacy keys are named in a warning (tested in test_config.py)
        warnings.simplefilter("ignore")
        colossalai.launch_from_torch(config=str(path))
    for key, value in readable.items():
        assert gpc.config[key] == value and getattr(gpc.config, key) == value and key in gpc.config
    assert "not_in_the_file" not in gpc.config and gpc.config.get("not_in_the_file", 7) == 7
    model = mlp(dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine_, *_ = colossalai.initialize(model, optimizer, torch.nn.MSELoss())
    eng = engine_.engine
    assert eng.plan.gradient_accumulation_steps == expected["accumulation"]
    assert eng.plan.is_data_defined == expected["data_defined"]
    assert (eng.config.gradient_clipping, eng.config.fp16.enabled) == (expected["clip"], expected["fp16"])
    changed = []
    for idx in range(2 * expected["accumulation"]):
        before = [p.detach().clone() for p in engine_.model.parameters()]
        engine_.zero_grad()
        x = torch.randn(2, 8)
        engine_.backward(engine_.criterion(engine_(x), torch.randn(2, 3)))
        engine_.step()
        if any(not torch.equal(a, b) for a, b in zip(before, engine_.model.parameters())):
            changed.append(idx)
    a = expected["accumulation"]
    # parameters move at window ends only; an fp16 window that overflowed moves nothing (the
    # first one does here: torch AMP's initial scale 2**16 on fp16 CPU autocast)
    assert set(changed) <= {a - 1, 2 * a - 1} and len(changed) + eng.skipped_steps == 2
    assert eng.skipped_steps == (1 if expected["fp16"] else 0)
    eng.close()


def test_a_parallel_size_microstep_cannot_run_is_an_error(tmp_path):
    path = tmp_path / "config.py"
    path.write_text("parallel = dict(pipeline=1, tensor=dict(size=2, mode='2d'))\ngradient_accumulation = 2\n")
    with pytest.raises(engine.ConfigError, match="parallel.tensor: mode '2d'"):
        colossalai.launch_from_torch(config=str(path))


@pytest.mark.parametrize("text, problem", [
    ("train_batch_size = 8\ntrain_micro_batch_size_per_gpu = 'auto'\n",
     r"config.py:2: train_micro_batch_size_per_gpu: 'auto': give a number.*the Colossal-AI-style loop forms its own"),
    ("train_batch_size = 8\nmicro_batch_tokens = 64\n",
     r"micro_batch_tokens: the Colossal-AI-style loop forms its own"),
])
def test_what_only_train_batch_can_do_is_refused_at_initialize(tmp_path, text, problem):
    path = tmp_path / "config.py"
    path.write_text(text)
    colossalai.launch_from_torch(config=str(path))
    model = mlp(dtype=torch.float32)
    with pytest.raises(engine.ConfigError, match=problem):
        colossalai.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_train_loader_is_cut_to_whole_windows_and_the_scheduler_moves_per_window():
    loader = DataLoader(TensorDataset(torch.arange(36.0)), batch_size=4)  # 9 batches
    windows = colossalai.WholeWindows(loader, 4)
    assert len(windows) == 8 and len(list(windows)) == 8 and windows.batch_size == 4
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = colossalai.OncePerWindow(torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5), 4)
    lrs = []
    for _ in range(8):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.25]


def test_gpc_before_launch_says_what_to_call():
    context = colossalai.GlobalContext()
    with pytest.raises(engine.EngineUsageError, match="launch_from_torch"):
        context.config
    assert context.get_world_size() == 1 and context.get_world_size("TENSOR") == 1
