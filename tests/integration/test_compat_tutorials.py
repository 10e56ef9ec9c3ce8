"""The official tutorials' patterns with only their imports rewritten to ``engine.compat``,
trimmed to tiny models and synthetic data (no downloads), on two ranks, without DeepSpeed or
Colossal-AI doing anything:

* DeepSpeedExamples ``training/cifar/cifar10_deepspeed.py``: ``deepspeed.accelerator``,
  ``deepspeed.moe.utils``, ``deepspeed.comm``, ``training_data``, bf16 inputs;
* ``training/HelloDeepSpeed/train_bert_ds.py``: its config as written (bf16, ZeRO-1,
  ``offload_optimizer: cpu``, ``Adam`` lr 1e-4), a model returning its own loss with an unused
  pooler, ``save_checkpoint`` with client state, ``log_dist``;
* ColossalAI-Examples ``features/gradient_accumulation`` and ``features/gradient_clipping``:
  ``colossalai.logging``, ``colossalai.core``, ``colossalai.utils.get_dataloader``,
  ``colossalai.nn.lr_scheduler.CosineAnnealingLR``, stepping the scheduler every iteration.

The imports are module-level below, exactly as a rewritten script has them."""
from __future__ import annotations

import argparse
import functools
import logging
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine.compat.colossalai as colossalai
import engine.compat.deepspeed as deepspeed
import engine.compat.deepspeed.comm as dist
from engine.compat.colossalai.context import ParallelMode
from engine.compat.colossalai.core import global_context as gpc
from engine.compat.colossalai.logging import disable_existing_loggers, get_dist_logger
from engine.compat.colossalai.nn.lr_scheduler import CosineAnnealingLR
from engine.compat.colossalai.utils import get_current_device, get_dataloader, print_rank_0
from engine.compat.deepspeed.accelerator import get_accelerator
from engine.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from engine.compat.deepspeed.utils import RepeatingLoader, log_dist
from tests.support.dist_utils import run_scenarios


# -- DeepSpeedExamples: cifar10_deepspeed.py -------------------------------------------------------
class Net(nn.Module):  # the tutorial's network, for 3x12x12 images
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(6 * 5 * 5, 32)
        self.fc3 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = x.view(-1, 6 * 5 * 5)
        return self.fc3(F.relu(self.fc1(x)))


def cifar_like(rank, world, dtype):
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--epochs", default=2, type=int)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed"])
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)
    if dist.get_rank() != 0:
        dist.barrier()
    g = torch.Generator().manual_seed(0)
    trainset = torch.utils.data.TensorDataset(torch.randn(64, 3, 12, 12, generator=g),
                                              torch.randint(0, 10, (64,), generator=g))
    if dist.get_rank() == 0:
        dist.barrier()
    torch.manual_seed(0)
    net = Net()
    parameters = {"params": [p for p in net.parameters()], "name": "parameters"}
    parameters = split_params_into_different_moe_groups_for_optimizer(parameters)
    ds_config = {"train_batch_size": 16, "steps_per_print": 2000,
                 "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                          "weight_decay": 3e-7}},
                 "prescale_gradients": False, "bf16": {"enabled": dtype == "bf16"},
                 "fp16": {"enabled": False}, "wall_clock_breakdown": False,
                 "zero_optimization": {"stage": 0, "allgather_partitions": True, "reduce_scatter": True,
                                       "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False}}
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = torch.bfloat16 if model_engine.bfloat16_enabled() else None
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    model_engine.eval()
    with torch.no_grad():
        outputs = model_engine(trainset.tensors[0][:8].to(local_device))
    steps = model_engine.global_steps
    model_engine.destroy()
    return {"steps": steps, "first": sum(losses[:4]) / 4, "last": sum(losses[-4:]) / 4,
            "eval_shape": tuple(outputs.shape), "world": dist.get_world_size()}


# -- DeepSpeedExamples: HelloDeepSpeed/train_bert_ds.py --------------------------------------------
class TinyMaskedLM(nn.Module):
    """A masked-LM returning its loss from ``model(**batch)``, with a pooler the loss never
    uses (as RobertaModel's)."""

    def __init__(self, vocab=20, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.embeddings = nn.Embedding(vocab, width)
        self.layer = nn.Linear(width, width)
        self.pooler = nn.Linear(width, width)
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, src_tokens, tgt_tokens):
        hidden = torch.tanh(self.layer(self.embeddings(src_tokens)))
        logits = self.lm_head(hidden)
        return F.cross_entropy(logits.flatten(0, 1), tgt_tokens.flatten(), ignore_index=-100)


def hello_deepspeed(rank, world, save_dir):
    local_rank = int(os.environ.get("LOCAL_RANK", -1))
    device = (torch.device(get_accelerator().device_name(), local_rank) if (local_rank > -1)
              and get_accelerator().is_available() else torch.device("cpu"))
    log_dist("Creating Model", ranks=[0], level=logging.INFO)
    model = TinyMaskedLM()
    pooler_before = model.pooler.weight.detach().clone()
    ds_config = {"train_micro_batch_size_per_gpu": 4,
                 "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                 "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    g = torch.Generator().manual_seed(10 + rank)

    def batches():
        while True:
            tokens = torch.randint(0, 20, (4, 6), generator=g)
            labels = torch.where(torch.rand(4, 6, generator=g) < 0.3, tokens, torch.full_like(tokens, -100))
            labels[:, 0] = tokens[:, 0]  # at least one label per row
            yield {"src_tokens": tokens, "tgt_tokens": labels}

    data_iterator = iter(RepeatingLoader(list(zip(range(8), batches()))))
    model.train()
    losses = []
    for step in range(1, 9):
        _, batch = next(data_iterator)
        for key, value in batch.items():
            batch[key] = value.to(device)
        loss = model(**batch)
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        if step % 4 == 0:
            log_dist("Loss: {0:.4f}".format(sum(losses) / len(losses)), ranks=[0], level=logging.INFO)
            model.save_checkpoint(save_dir=save_dir, client_state={"checkpoint_step": step})
    _, client_state = model.load_checkpoint(save_dir)
    whole = model.module_state_dict()
    result = {"steps": model.global_steps, "client": client_state["checkpoint_step"],
              "pooler_unchanged": torch.equal(whole["pooler.weight"], pooler_before),
              "finite": all(torch.isfinite(v).all() for v in whole.values())}
    model.destroy()
    return result


# -- ColossalAI-Examples: features/gradient_accumulation, features/gradient_clipping ----------------
COLOSSAL_CONFIG = "BATCH_SIZE = 2\nNUM_EPOCHS = 8\ngradient_accumulation = 4\nclip_grad_norm = 1.0\n"


def colossal_tutorial(rank, world, config):
    parser = colossalai.get_default_parser()
    args = parser.parse_args(["--config", config])
    colossalai.launch_from_torch(config=args.config, backend=args.backend)
    disable_existing_loggers()
    logger = get_dist_logger()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 10))
    g = torch.Generator().manual_seed(0)
    train_dataset = torch.utils.data.TensorDataset(torch.randn(64, 3, 4, 4, generator=g),
                                                   torch.randint(0, 10, (64,), generator=g))
    train_dataloader = get_dataloader(dataset=train_dataset, shuffle=True, batch_size=gpc.config.BATCH_SIZE,
                                      pin_memory=True)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    lr_scheduler = CosineAnnealingLR(optimizer, total_steps=gpc.config.NUM_EPOCHS)
    engine, train_dataloader, _, _ = colossalai.initialize(model, optimizer, criterion, train_dataloader)
    engine.train()
    values, lrs = [], []
    for idx, (img, label) in enumerate(train_dataloader):
        img, label = img.to(get_current_device()), label.to(get_current_device())
        engine.zero_grad()
        output = engine(img)
        train_loss = engine.criterion(output, label)
        engine.backward(train_loss)
        engine.step()
        lr_scheduler.step()
        values.append(next(model.parameters()).flatten()[0].item())
        lrs.append(optimizer.param_groups[0]["lr"])
        logger.info(f"iteration {idx}, loss: {train_loss}, 1st element of parameters: {values[-1]}", ranks=[0])
        if idx == 7:
            break
    print_rank_0("done", logger)
    updated = [i for i in range(1, 8) if values[i] != values[i - 1]]
    engine.engine.close()
    return {"updated": updated, "data_world": gpc.get_world_size(ParallelMode.DATA),
            "tensor_world": gpc.get_world_size(ParallelMode.TENSOR), "batches": len(train_dataloader),
            "lrs": lrs}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_tutorials_with_their_imports_rewritten_run_on_two_ranks(tmp_path):
    scenarios = {"cifar fp32": functools.partial(cifar_like, dtype="fp32"),
                 "cifar bf16": functools.partial(cifar_like, dtype="bf16"),
                 "hello deepspeed": functools.partial(hello_deepspeed, save_dir=str(tmp_path / "hello")),
                 "colossal": functools.partial(colossal_tutorial, config=str(tmp_path / "config.py"))}
    (tmp_path / "config.py").write_text(COLOSSAL_CONFIG)
    results = run_scenarios(scenarios, world_size=2, timeout=280)
    for name in ("cifar fp32", "cifar bf16"):
        for result in results[name]:
            # 64 samples, global batch 16: 4 optimizer steps an epoch, 2 epochs
            assert result["steps"] == 8 and result["world"] == 2 and result["eval_shape"] == (8, 10), result
            assert result["last"] < result["first"], (name, result)
    for result in results["hello deepspeed"]:  # bf16, ZeRO-1, offload_optimizer: cpu, as written
        assert result["steps"] == 8 and result["client"] == 8 and result["finite"], result
        assert result["pooler_unchanged"], result  # unused in the loss: no gradient, no update
    for result in results["colossal"]:
        assert result["updated"] == [3, 7] and result["data_world"] == 2 and result["tensor_world"] == 1, result
        assert result["batches"] == 16, result  # 64 samples / 2 ranks / BATCH_SIZE 2
        # stepped by the script every iteration and not handed to initialize: it moves every
        # iteration, as in Colossal-AI (torch's cosine over total_steps)
        assert result["lrs"] == pytest.approx([0.05 * (1 + math.cos(math.pi * (i + 1) / 8)) for i in range(8)])
