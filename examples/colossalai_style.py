"""Colossal-AI's legacy gradient-accumulation tutorial, trained by Microstep after its two
colossalai imports change. With ``gradient_accumulation = 4`` the parameters change only
at iterations 3 and 7.

    python -m launch --nproc-per-node 2 examples/colossalai_style.py

The tutorial's config (configs/colossalai_grad_accum.py) gives ``BATCH_SIZE = 128``, the
data loader's batch per process, and ``gradient_accumulation = 4``: a data-defined plan.
The tutorial trains ResNet-18 on CIFAR-10; here a small MLP on synthetic data stands in.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import engine.compat.colossalai as colossalai  # was: import colossalai
from engine.compat.colossalai.core import global_context as gpc  # was: from colossalai.core import ...

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "colossalai_grad_accum.py"
FEATURES, CLASSES = 32, 10


def synthetic_dataset(samples: int = 2048, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=g)
    labels = (inputs @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    return TensorDataset(inputs, labels)


def main(argv=None) -> list[int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    args = parser.parse_args(argv)

    colossalai.launch_from_torch(config=args.config)

    # build the model, the data loader (each process its share), criterion and optimizer
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
    dataset = synthetic_dataset()
    sampler = DistributedSampler(dataset, num_replicas=gpc.get_world_size(), rank=gpc.get_global_rank(), seed=0)
    train_dataloader = DataLoader(dataset, batch_size=gpc.config.BATCH_SIZE, sampler=sampler)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)

    engine, train_dataloader, _, _ = colossalai.initialize(model, optimizer, criterion, train_dataloader)
    rank = gpc.get_global_rank()

    engine.train()
    updated, previous = [], engine.model[0].weight.detach().clone()
    for idx, (img, label) in enumerate(train_dataloader):
        engine.zero_grad()
        output = engine(img)
        train_loss = engine.criterion(output, label)
        engine.backward(train_loss)
        engine.step()
        current = engine.model[0].weight.detach().clone()
        if not torch.equal(current, previous):
            updated.append(idx)
        previous = current
        if rank == 0:
            print(f"iteration {idx}, loss: {train_loss.item():.4f}, first 10 elements of param: "
                  f"{current.flatten()[:10].tolist()}\n", end="", flush=True)
        if idx == 7:
            break
    print(f"rank {rank}: parameter updated at iterations {updated} "
          f"(gradient_accumulation = {gpc.config.gradient_accumulation})\n", end="", flush=True)
    engine.engine.close()
    return updated


if __name__ == "__main__":
    main()
