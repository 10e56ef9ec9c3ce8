"""Start-up says what is on, once, on rank 0: the mesh, holder, batch and precision always; packing,
hybrid sharding (with the DeepSpeed key it came from), the context method, the experts' balance and
the model's own loss only when on."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

import engine
from engine.batching.mesh_plan import plan_for_mesh
from engine.config.schema import load_config
from engine.config.setup import resolve_setup
from engine.monitor.startup import startup_lines
from tests.support import own_loss as o
from tests.support.reference import mlp, sgd


def lines_for(config: dict, world: int, **known) -> list[str]:
    config = load_config(config)
    setup = resolve_setup(config, SimpleNamespace(world_size=world, rank=0, local_rank=0,
                                                  device=torch.device("cpu")))
    return startup_lines(config, setup, plan_for_mesh(config, setup.mesh, 0),
                         **{"own_loss_type": None, "routes": False, **known})


def test_hybrid_sharding_names_the_deepspeed_key_it_came_from():
    lines = lines_for({"train_batch_size": 8, "zero_optimization": {"stage": 3, "mics_shard_size": 2}}, 4)
    assert "hybrid sharding:    shard groups of 2 data ranks, 2 replicas across (from " \
           "zero_optimization.mics_shard_size)" in lines
    assert any(line.startswith("holder:             FSDP2 (sharded), ZeRO 3") for line in lines)


def test_what_is_off_is_not_said():
    lines = lines_for({"train_batch_size": 8, "gradient_accumulation_steps": 2}, 2)
    assert [line.split(":")[0] for line in lines] == ["mesh", "holder", "global batch", "precision"]
    assert "global batch:       8 = micro 2 × accumulation 2 × data ranks 2" in lines
    context = lines_for({"train_batch_size": 8, "context_parallel": {"size": 2, "method": "ring"}}, 2,
                        routes=True, own_loss_type="ForCausalLM")
    assert "context parallel:   2 ranks per sequence, method ring" in context
    assert any(line.startswith("experts:            load balance global") for line in context)


def test_initialize_says_it_once(caplog):
    with caplog.at_level(logging.INFO, logger="engine"):
        engine.initialize(o.model("causal"), {"train_batch_size": 8, "micro_batch_tokens": 16, "packing": True},
                          optimizer=sgd)
    blocks = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up:")]
    assert len(blocks) == 1
    assert "packing:            on" in blocks[0] and "loss type ForCausalLM" in blocks[0]
    assert "holder:             one process, ZeRO 0" in blocks[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine"):
        engine.initialize(mlp(), {"train_batch_size": 8}, optimizer=sgd)
    (block,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("start-up:")]
    assert "packing" not in block and "own loss" not in block
