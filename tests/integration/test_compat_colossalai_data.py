"""``colossalai.utils.get_dataloader`` through the facade trains on the data Colossal-AI's own
would give: its sampler shuffles with seed 0 + the epoch (advancing by itself each pass), every
data-loader worker seeds torch, NumPy and ``random`` with ``seed``, a single rank shuffles with
torch's global generator. The gradient-accumulation tutorial, run through the facade with a
worker drawing an augmentation, equals its plain-PyTorch rendition with those semantics (float64,
two ranks, two epochs); the facade's former loader (the sampler seeded with ``seed``, workers
unseeded) misses it."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import engine.compat.colossalai as colossalai
from engine.compat.colossalai import gpc
from engine.compat.colossalai.context import ParallelMode
from engine.compat.colossalai.utils import get_dataloader
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, mlp, reference_train, state

TOL = 1e-10
CONFIG = "BATCH_SIZE = 2\ngradient_accumulation = 4\n"
SAMPLES, WORKER_SEED, NOISE = 16, 1024, 0.5  # 16 samples, 2 ranks, batches of 2: one window per epoch


def samples():
    g = torch.Generator().manual_seed(3)
    return torch.randn(SAMPLES, 8, generator=g, dtype=torch.float64), torch.randn(SAMPLES, 3, generator=g,
                                                                                   dtype=torch.float64)


class Augmented(Dataset):
    """Each sample plus noise drawn from the loading process's torch generator (a data augmentation)."""

    def __init__(self):
        self.x, self.y = samples()

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        return self.x[index] + NOISE * torch.randn(8, dtype=torch.float64), self.y[index]


def former_facade_loader(dataset, batch_size):
    """The broken variant: the sampler seeded with ``seed`` (1024), its epoch never advanced, the
    workers' generators left to torch."""
    sampler = DistributedSampler(dataset, num_replicas=2, rank=gpc.get_local_rank(ParallelMode.DATA), shuffle=True,
                                 seed=WORKER_SEED)
    return DataLoader(dataset, sampler=sampler, batch_size=batch_size, num_workers=1)


def tutorial(rank, world, config_path, former=False):
    """The gradient-accumulation tutorial's loop through the facade, two epochs."""
    colossalai.launch_from_torch(config=config_path)
    model = mlp()
    loader = (former_facade_loader(Augmented(), gpc.config.BATCH_SIZE) if former else
              get_dataloader(Augmented(), shuffle=True, batch_size=gpc.config.BATCH_SIZE, num_workers=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eng, loader, _, _ = colossalai.initialize(model, optimizer, torch.nn.MSELoss(), loader)
    eng.train()
    states = []
    for _ in range(2):
        for x, y in loader:
            eng.zero_grad()
            eng.backward(eng.criterion(eng(x), y))
            eng.step()
        states.append(eng.engine.full_state_dict())
    eng.engine.close()
    return states


def colossal_rendition():
    """Plain PyTorch with Colossal-AI's data semantics, one process: in epoch e each rank's share
    is ``randperm(16, seed 0 + e)[rank::2]``, and its one worker (a fresh process each epoch,
    seeded with 1024) draws the noise sample after sample. One SGD step per epoch on the mean
    loss over both ranks' 8 samples."""
    x, y = samples()
    windows = []
    for epoch in range(2):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0 + epoch)).tolist()
        inputs, targets = [], []
        for rank in range(2):
            worker = torch.Generator().manual_seed(WORKER_SEED)
            for index in order[rank::2]:
                inputs.append(x[index] + NOISE * torch.randn(8, dtype=torch.float64, generator=worker))
                targets.append(y[index])
        windows.append((torch.stack(inputs), torch.stack(targets)))
    states, model = [], mlp()
    for end in (1, 2):  # the state after each epoch
        states.append(state(reference_train(model, windows[:end], lambda m, b: F.mse_loss(m(b[0]), b[1]),
                                            lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))))
    return states


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_tutorial_through_the_facade_trains_on_colossal_ai_s_data(tmp_path):
    path = tmp_path / "config.py"
    path.write_text(CONFIG)
    runs = run_scenarios({"facade": functools.partial(tutorial, config_path=str(path)),
                          "former": functools.partial(tutorial, config_path=str(path), former=True)},
                         world_size=2, timeout=160)
    expected = colossal_rendition()
    for per_epoch in runs["facade"]:
        assert [max_param_diff(got, want) for got, want in zip(per_epoch, expected)] == pytest.approx([0, 0], abs=TOL)
    for per_epoch in runs["former"]:
        assert max_param_diff(per_epoch[0], expected[0]) > 1e-3  # other samples, other noise


def test_one_rank_shuffles_with_torch_s_global_generator_not_with_seed():
    dataset = TensorDataset(torch.arange(32))
    torch.manual_seed(5)
    facade = [int(v) for (batch,) in get_dataloader(dataset, shuffle=True, seed=7, batch_size=4) for v in batch]
    torch.manual_seed(5)
    plain = [int(v) for (batch,) in DataLoader(dataset, shuffle=True, batch_size=4) for v in batch]
    assert facade == plain


def test_workers_are_seeded_with_seed_every_one_alike():
    class Draw(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return torch.rand(1)

    drawn = [float(batch) for batch in get_dataloader(Draw(), seed=11, batch_size=1, num_workers=2)]
    first = torch.Generator().manual_seed(11)
    expected = [float(torch.rand(1, generator=first)) for _ in range(2)]
    # batches alternate between the two workers; each worker's stream starts from seed 11
    assert drawn == pytest.approx([expected[0], expected[0], expected[1], expected[1]])
