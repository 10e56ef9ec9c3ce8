"""Full-batch references: the same model trained by plain PyTorch on the whole global batch
in one process. Every correctness test compares the engine against these."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

DTYPE = torch.float64


def mlp(seed: int = 0, d_in: int = 8, hidden: int = 16, d_out: int = 3, dtype=DTYPE) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
        torch.nn.Linear(hidden, d_out),
    ).to(dtype)


def regression_batches(steps: int, global_batch: int, seed: int = 1, d_in: int = 8, d_out: int = 3,
                       dtype=DTYPE) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, d_in, generator=g, dtype=dtype),
             torch.randn(global_batch, d_out, generator=g, dtype=dtype)) for _ in range(steps)]


def mse(model, batch):
    """A mean loss: mean over the micro-batch's samples (each sample has d_out elements)."""
    x, y = batch
    return F.mse_loss(model(x), y)


class TinyLM(torch.nn.Module):
    """Embedding → MLP → vocabulary logits; enough to exercise token-weighted losses."""

    def __init__(self, vocab: int = 11, width: int = 8, seed: int = 0, dtype=DTYPE):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, width, dtype=dtype)
        self.hidden = torch.nn.Linear(width, width, dtype=dtype)
        self.head = torch.nn.Linear(width, vocab, dtype=dtype)

    def forward(self, tokens):
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def token_batches(steps: int, global_batch: int, seq: int = 6, vocab: int = 11, seed: int = 2, dense: bool = False):
    """Token batches whose samples hold very different numbers of valid labels (-100 = padding),
    or (``dense``) all valid: a mean over a micro-batch's tokens is then its mean over samples."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (global_batch, seq), generator=g)
        labels = torch.randint(0, vocab, (global_batch, seq), generator=g)
        lengths = torch.randint(1, seq + 1, (global_batch,), generator=g)
        if not dense:
            labels[torch.arange(seq)[None, :] >= lengths[:, None]] = -100
        batches.append({"tokens": tokens, "labels": labels})
    return batches


def token_loss_sum(model, batch):
    """An item-weighted loss: (sum over valid tokens, number of valid tokens)."""
    logits = model(batch["tokens"])
    labels = batch["labels"]
    loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum, (labels != -100).sum()


def token_loss_mean(model, batch):
    loss_sum, count = token_loss_sum(model, batch)
    return loss_sum / count


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def reference_train(model, batches, loss_fn, optimizer_factory=sgd, *, clip: float = 0.0,
                    scheduler_factory=None):
    """Train a copy of ``model`` one optimizer step per global batch; returns the copy."""
    model = copy.deepcopy(model)
    optimizer = optimizer_factory(model.parameters())
    scheduler = scheduler_factory(optimizer) if scheduler_factory else None
    for batch in batches:
        optimizer.zero_grad()
        loss_fn(model, batch).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return model


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rank_slice(batch, plan):
    """This rank's contiguous share of a global batch (what DistributedBatches hands out)."""
    sizes = plan.per_device_batch_sizes
    start = sum(sizes[:plan.rank])
    size = sizes[plan.rank]
    if isinstance(batch, dict):
        return {k: v[start:start + size] for k, v in batch.items()}
    return tuple(t[start:start + size] for t in batch)


def train_steps(eng, data, steps: int, loss_fn=mse) -> None:
    """``steps`` optimizer steps of ``train_batch`` on ``data`` (re-iterated across epochs)."""
    done = 0
    while done < steps:
        for batch in data:
            eng.train_batch(batch, loss_fn)
            done += 1
            if done == steps:
                return
