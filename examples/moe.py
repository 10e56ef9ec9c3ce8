"""A Hugging Face mixture-of-experts model trained with its own ``.loss``, load-balancing term
included, as one step on the whole global batch.

    python examples/moe.py                                   # accumulation 8, one process
    python -m launch --nproc-per-node 2 examples/moe.py      # data 2 x accumulation 4
    python -m launch --nproc-per-node 2 examples/moe.py --set expert_parallel.size=2   # 4 experts per rank
    python examples/moe.py --set moe.load_balance=micro_batch

A tiny Mixtral (random init, float64, output_router_logits, router_aux_loss_coef 0.02) and
random token rows with uneven padding. The script is what a Hugging Face user writes:
``eng.train_batch(batch, lambda m, b: m(**b).loss)`` (``own_loss`` below). Each step prints the loss, the load of the
8 experts over the whole window (every micro-batch and rank) and its imbalance; at the end the
weights are compared with one plain PyTorch step per global batch in one process (``.loss`` of
the whole batch), to transformers' float32 rounding of the router under ``global`` (1e-9), about 1e-4
off under ``micro_batch``.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

import engine
from engine.cli import add_override_argument
from engine.distributed.process_group import strip_local_rank_arg

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 12, 16, 3


def mixtral() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)  # the same initial model on every rank
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=SEQ,
        output_router_logits=True, router_aux_loss_coef=0.02, experts_implementation="eager",
        attn_implementation="sdpa")
    return transformers.MixtralForCausalLM(config).double()


def global_batches() -> list[dict]:
    """The same global batches on every rank: right-padded rows of 3..SEQ tokens."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
        lengths = torch.randint(3, SEQ + 1, (GLOBAL_BATCH,), generator=g)
        mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches


def own_loss(model, batch):
    """What a Hugging Face user writes: the model's own loss, load-balancing term included (the engine
    reads it as a sum over the micro-batch's real tokens and keeps the global batch's term once)."""
    return model(**batch).loss


def full_batch_reference(model, batches, lr: float):
    """One plain PyTorch SGD step per global batch, the whole batch's ``.loss`` in float64."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    coef = model.config.router_aux_loss_coef
    for batch in batches:
        optimizer.zero_grad()
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        labels = batch["labels"][:, 1:]
        loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels.flatten()) + coef * out.aux_loss
        loss.backward()
        optimizer.step()
    return model.state_dict()


def main(argv=None) -> dict:
    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_override_argument(parser)
    args = parser.parse_args(argv)
    model, batches = mixtral(), global_batches()
    lr = 0.1
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "SGD", "params": {"lr": lr}},
              "monitor": {"enabled": True, "progress": False}}
    eng = engine.initialize(copy.deepcopy(model), config, overrides=args.overrides)
    plan = eng.plan
    start = sum(plan.per_device_batch_sizes[:plan.rank])
    for batch in batches:
        mine = {key: value[start:start + plan.per_device_batch_size] for key, value in batch.items()}
        eng.train_batch(mine, own_loss)
        if eng.rank == 0:
            record = eng.monitor.history[-1]
            load = " ".join(f"{n:.0f}" for n in record["expert_load"])
            print(f"step {record['step']}: loss {record['loss']:.4f} | expert load {load} | "
                  f"imbalance {record['expert_imbalance']:.2f}", flush=True)
    trained = eng.full_state_dict()
    expected = full_batch_reference(model, batches, lr)
    difference = max((trained[name] - expected[name]).abs().max().item() for name in expected)
    if eng.rank == 0:
        experts = f", experts split over {eng.config.expert_parallel.size}" if eng.config.expert_parallel.size > 1 else ""
        print(f"moe.load_balance: {eng.config.moe.load_balance} on {plan.world_size} data rank(s) x accumulation "
              f"{plan.gradient_accumulation_steps}{experts}: max |weight - full-batch weight| = {difference:.1e}",
              flush=True)
    eng.close()
    return {"difference": difference, "records": eng.monitor.history}


if __name__ == "__main__":
    main()
