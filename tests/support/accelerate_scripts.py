"""An accelerate user's training script, run with accelerate's own ``Accelerator`` (the control) or
Microstep's (``engine.compat.accelerate``), and the float64 full-batch reference both are held to.

The script is the loop every accelerate example writes (``accumulate``, the model's own ``.loss``,
``optimizer.step()`` / ``lr_scheduler.step()`` / ``optimizer.zero_grad()`` every batch) on a tiny
Llama (float64) and padded rows of 2 to 12 real tokens. Global batch k holds the data loader's
rows ``[k·G, (k+1)·G)`` whatever the number of processes: accelerate gives process r the loader's
batches r, r + n, ... of each micro-step."""

from __future__ import annotations

import functools

import torch
from torch.utils.data import DataLoader

from tests.support.hf_models import VOCAB, llama

SEQ = 12
ACCUMULATION = 4
GLOBAL_BATCH = 8  # rows per optimizer step: batch_size x processes x ACCUMULATION
LR, MOMENTUM = 0.1, 0.9


def decay(step: int) -> float:
    """The script's schedule (a LambdaLR factor of the scheduler's step count)."""
    return 1.0 / (1.0 + 0.25 * step)


def padded_rows(count: int, seed: int = 5) -> list[dict]:
    """Rows of SEQ tokens, of which 2..SEQ are real (right padding: mask 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)
    lengths = torch.randint(2, SEQ + 1, (count,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(count)]


def accelerator_class(door: bool):
    """Microstep's Accelerator, or accelerate's told ``cpu=True`` (without it accelerate leaves CPU processes
    apart, each training alone on the whole data)."""
    if door:
        from engine.compat.accelerate import Accelerator

        return Accelerator
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # accelerate's singletons: each run starts anew
    GradientState._reset_state()
    return functools.partial(Accelerator, cpu=True)


def build(door: bool, rows: list[dict], processes: int, *, seed: int = 0, **accelerator_kwargs):
    """The script's set-up: (accelerator, model, optimizer, train_dataloader, lr_scheduler), prepared."""
    accelerator = accelerator_class(door)(gradient_accumulation_steps=ACCUMULATION, **accelerator_kwargs)
    model = llama(layers=2, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = DataLoader(rows, batch_size=GLOBAL_BATCH // (processes * ACCUMULATION), shuffle=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    return (accelerator, *accelerator.prepare(model, optimizer, loader, scheduler))


def train_epoch(accelerator, model, optimizer, loader, scheduler=None) -> list[float]:
    """The user's loop, unchanged (its scheduler where it has one); returns the losses it saw."""
    losses = []
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def run_script(door: bool, rows: list[dict], processes: int, **accelerator_kwargs) -> dict:
    """One epoch of the script; the trained weights (CPU), the scheduler's count and last lr."""
    accelerator, model, optimizer, loader, scheduler = build(door, rows, processes, **accelerator_kwargs)
    train_epoch(accelerator, model, optimizer, loader, scheduler)
    state = {name: value.detach().cpu().clone() for name, value in accelerator.get_state_dict(model).items()}
    return {"state": state, "scheduler_steps": scheduler.scheduler._step_count, "last_lr": scheduler.get_last_lr()[0]}


def reference(rows: list[dict], processes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Plain PyTorch, float64, each whole global batch at once: the mean loss over its real target tokens;
    the learning rate of update k is the schedule's after k·processes scheduler steps (accelerate's count)."""
    model = llama(layers=2, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for k, start in enumerate(range(0, len(rows) - GLOBAL_BATCH + 1, GLOBAL_BATCH)):
        batch = {key: torch.stack([row[key] for row in rows[start:start + GLOBAL_BATCH]]) for key in rows[0]}
        for group in optimizer.param_groups:
            group["lr"] = LR * decay(k * processes)
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def distance(trained: dict, expected: dict) -> float:
    """The largest parameter difference relative to the largest reference value."""
    worst = max(float((trained[name].double() - expected[name].double()).abs().max()) for name in expected)
    scale = max(float(value.double().abs().max()) for value in expected.values())
    return worst / scale


def clm_reference(max_lines: int, processes: int, *, batch: int = 2, accumulation: int = 4, seed: int = 0,
                  lr: float = 3e-3, weight_decay: float = 0.01, clip: float = 1.0) -> dict[str, torch.Tensor]:
    """examples/accelerate_clm.py's one epoch (``--float64``), in plain PyTorch on each whole global batch:
    ``batch`` x ``processes`` x ``accumulation`` consecutive training rows (the last window: what is left),
    the mean loss over their real target tokens, the whole gradient clipped, AdamW; its linear schedule built
    as the script builds it and stepped ``processes`` times per update, as accelerate steps it."""
    import math

    from transformers import LlamaForCausalLM, get_scheduler
    from transformers.trainer_utils import set_seed

    from examples import accelerate_clm as clm

    rows = clm.read_rows(str(clm.CORPUS), 48, max_lines)
    train = rows[len(rows) * 10 // 100:]
    set_seed(seed)
    model = LlamaForCausalLM(clm.model_config()).double()
    no_decay = ["bias", "norm.weight"]
    groups = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
               "weight_decay": weight_decay},
              {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
               "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    updates = math.ceil(math.ceil(len(train) / batch) / accumulation)  # the script's count, before sharding
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=updates)
    global_batch = batch * processes * accumulation
    for start in range(0, len(train), global_batch):
        optimizer.zero_grad()
        model(**clm.collate(train[start:start + global_batch])).loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        for _ in range(processes):
            scheduler.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def regression_rows(count: int = 10, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 8, generator=g, dtype=torch.float64)
    y = torch.randn(count, 3, generator=g, dtype=torch.float64)
    return [(x[i], y[i]) for i in range(count)]


def run_mean_loss_script(door: bool, rows: list, batch_size: int = 3, accumulation: int = 2) -> dict:
    """A script whose loss is its own mean (``F.mse_loss``) over each micro-batch, one process: the data
    ends inside the last window (the data loader's last batch syncs, as accelerate does)."""
    from tests.support.reference import mlp

    accelerator = accelerator_class(door)(gradient_accumulation_steps=accumulation)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(rows, batch_size=batch_size))
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return {name: value.detach().clone() for name, value in accelerator.get_state_dict(model).items()}


def mean_loss_reference(rows: list, window_rows: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: the mean squared error over each whole window of ``window_rows`` rows (the last: what is left)."""
    from tests.support.reference import mlp

    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, len(rows), window_rows):
        inputs = torch.stack([x for x, _ in rows[start:start + window_rows]])
        targets = torch.stack([y for _, y in rows[start:start + window_rows]])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


ROUTER_COEF = 0.05


def moe_rows(count: int, seed: int = 3) -> list[dict]:
    """Padded rows (2 to 6 real tokens) for the Mixtral, one dict per row."""
    from tests.support.moe_models import lm_batches

    batch = lm_batches(1, count, padded=True, seed=seed)[0]
    return [{key: value[i] for key, value in batch.items()} for i in range(count)]


def run_moe_script(door: bool, rows: list[dict], processes: int, **accelerator_kwargs) -> dict[str, torch.Tensor]:
    """The same loop on a Mixtral whose ``.loss`` adds its router term (``output_router_logits``), SGD with
    momentum; the term computed in float64 (``float64_term``) as in the reference."""
    from tests.support.moe_models import float64_term, hf_moe

    accelerator = accelerator_class(door)(gradient_accumulation_steps=ACCUMULATION, **accelerator_kwargs)
    model = hf_moe(coef=ROUTER_COEF)
    in_float64 = float64_term(model)  # of the model's own class (ZeRO 3 makes another)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = DataLoader(rows, batch_size=GLOBAL_BATCH // (processes * ACCUMULATION), shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with in_float64:
        train_epoch(accelerator, model, optimizer, loader)
    return {name: value.detach().cpu().clone() for name, value in accelerator.get_state_dict(model).items()}


def moe_reference(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Plain PyTorch on each whole global batch: the mean over its real target tokens plus the coefficient
    times the whole batch's load-balancing term, in float64."""
    from tests.support.moe_models import float64_term, full_batch_loss, hf_moe

    model = hf_moe(coef=ROUTER_COEF)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = full_batch_loss(ROUTER_COEF)
    with float64_term(model):
        for start in range(0, len(rows) - GLOBAL_BATCH + 1, GLOBAL_BATCH):
            batch = {key: torch.stack([row[key] for row in rows[start:start + GLOBAL_BATCH]]) for key in rows[0]}
            optimizer.zero_grad()
            loss_fn(model, batch).backward()
            optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}
