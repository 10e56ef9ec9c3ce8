"""A DeepSpeed training script, trained by Microstep after a one-line change (the import).

    python -m launch --nproc-per-node 2 examples/deepspeed_style.py --deepspeed \\
        --deepspeed_config configs/deepspeed_style.json --save_dir runs/ds_ckpt
    python -m launch --nproc-per-node 2 --launcher deepspeed examples/deepspeed_style.py --deepspeed

Everything below the import is DeepSpeed's API as its tutorials use it: command-line flags,
``init_distributed``, ``initialize`` with ``training_data`` (the loader yields this rank's
micro-batches), ``backward`` / ``step`` per micro-batch, checkpoints with client state.
The data is synthetic: 4 classes a fixed random linear map of 16 features decides.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import engine.compat.deepspeed as deepspeed  # was: import deepspeed

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "deepspeed_style.json"
FEATURES, CLASSES = 16, 4


def synthetic_dataset(samples: int = 512, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=g)
    labels = (inputs @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    return TensorDataset(inputs, labels)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(FEATURES, 64)
        self.out = torch.nn.Linear(64, CLASSES)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save_dir", default=None, help="save a checkpoint there at the end, then load it back")
    parser = deepspeed.add_config_arguments(parser)
    parser.set_defaults(deepspeed_config=str(DEFAULT_CONFIG))
    args = parser.parse_args(argv)

    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    model_engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=synthetic_dataset())
    rank = model_engine.global_rank

    epoch_losses = []
    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for inputs, labels in trainloader:
            inputs, labels = inputs.to(model_engine.device), labels.to(model_engine.device)
            loss = F.cross_entropy(model_engine(inputs), labels)
            model_engine.backward(loss)
            model_engine.step()
            total, count = total + loss.item(), count + 1
        epoch_losses.append(total / count)
        if rank == 0:
            print(f"epoch {epoch}: mean micro-batch loss {epoch_losses[-1]:.4f}, lr {model_engine.get_lr()[0]:.4g}, "
                  f"global step {model_engine.global_steps}, samples {model_engine.global_samples}, "
                  f"grad norm {model_engine.get_global_grad_norm():.3f}\n", end="", flush=True)

    summary = {"epoch_losses": epoch_losses, "global_steps": model_engine.global_steps,
               "train_batch_size": model_engine.train_batch_size()}
    if args.save_dir:
        model_engine.save_checkpoint(args.save_dir, client_state={"epoch": args.epochs - 1})
        path, client_state = model_engine.load_checkpoint(args.save_dir)
        summary["resumed"] = {"path": path, "client_state": client_state}
        if rank == 0:
            print(f"saved and loaded {path}: client state {client_state}\n", end="", flush=True)
    model_engine.destroy()
    return summary


if __name__ == "__main__":
    main()
