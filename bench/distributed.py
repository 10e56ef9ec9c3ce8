"""Data parallelism and ZeRO on 2 ranks: time per optimizer step against the same training
written by hand, bytes sent per step as accumulation grows, and memory held per mode.

    python -m launch --nproc-per-node 2 bench/distributed.py [--rounds 8] [--steps 3]

Workload: the 4.2M-parameter MLP of bench/common.py, global batch 64, AdamW, fp32, gloo.
Every variant trains its own copy; variants alternate round by round and the slowest
rank's time counts. Results: bench/results/distributed.json (rank 0 prints a table).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy
import re

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import engine
from bench.common import GLOBAL_BATCH, adamw, interleaved, mse, save, start_ranks
from bench.comm_count import CommCounter

# -- hand-written baselines -------------------------------------------------------------------
def hand_ddp(model, data, accumulation):
    ddp = DistributedDataParallel(model)
    optimizer = adamw(model.parameters())
    micro_batches = list(zip(data[0].chunk(accumulation), data[1].chunk(accumulation)))

    def step():
        for i, micro_batch in enumerate(micro_batches):
            if i < accumulation - 1:
                with ddp.no_sync():
                    (mse(ddp, micro_batch) / accumulation).backward()
            else:
                (mse(ddp, micro_batch) / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def hand_fsdp(model, data, accumulation, stage):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=stage == 3)
    fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
    optimizer = adamw(model.parameters())
    micro_batches = list(zip(data[0].chunk(accumulation), data[1].chunk(accumulation)))

    def step():
        for i, micro_batch in enumerate(micro_batches):
            last = i == accumulation - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            (mse(model, micro_batch) / accumulation).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# -- the engine ---------------------------------------------------------------------------------
def engine_config(stage, accumulation, micro="fixed", reduce_every=False):
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    return {"train_batch_size": GLOBAL_BATCH,
            "train_micro_batch_size_per_gpu": micro if micro != "fixed" else per_rank // accumulation,
            "zero_optimization": {"stage": stage, "reduce_every_micro_step": reduce_every}}


def engine_train_batch(model, data, config):
    eng = engine.initialize(model, config, optimizer=adamw)
    return lambda: eng.train_batch(data, mse)


def engine_manual_loop(model, data, config):
    eng = engine.initialize(model, config, optimizer=adamw)
    micro_batches = list(zip(*(t.split(list(eng.plan.micro_batch_sizes)) for t in data)))

    def step():
        for micro_batch in micro_batches:
            eng.backward(mse(eng, micro_batch))
            eng.step()

    return step


def variants(model, data, accumulation=4):
    def make(build, *args):
        return build(copy.deepcopy(model), data, *args)

    return {
        "hand DDP + no_sync": make(hand_ddp, accumulation),
        "hand DDP + no_sync, second copy (noise floor)": make(hand_ddp, accumulation),
        "engine stage 0 (train_batch)": make(engine_train_batch, engine_config(0, accumulation)),
        "engine stage 0 (manual loop)": make(engine_manual_loop, engine_config(0, accumulation)),
        "engine stage 0, auto (guarded)": make(engine_train_batch, engine_config(0, accumulation, micro="auto")),
        "engine stage 1": make(engine_train_batch, engine_config(1, accumulation)),
        "hand FSDP2 stage 2, deferred": make(hand_fsdp, accumulation, 2),
        "engine stage 2": make(engine_train_batch, engine_config(2, accumulation)),
        "engine stage 2, reduce every micro-step": make(engine_train_batch, engine_config(2, accumulation, reduce_every=True)),
        "hand FSDP2 stage 3, deferred": make(hand_fsdp, accumulation, 3),
        "engine stage 3": make(engine_train_batch, engine_config(3, accumulation)),
        "engine stage 3, reduce every micro-step": make(engine_train_batch, engine_config(3, accumulation, reduce_every=True)),
    }


# -- traffic and memory --------------------------------------------------------------------------
def held_bytes(eng) -> int:
    """Bytes of parameters, gradients (FSDP's unsharded ones included) and optimizer state
    this rank holds, counted once per storage (DDP's internal buckets are not visible)."""
    storages = {}

    def add(t):
        if t is None:
            return
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for p in eng.module.parameters():
        add(p)
        add(p.grad)
    for unit in eng.module.modules():
        state = getattr(unit, "_get_fsdp_state", None)
        for group in (state()._fsdp_param_groups if state else []):
            for fsdp_param in group.fsdp_params:
                add(fsdp_param.sharded_param)  # not among module.parameters() while gathered
                add(fsdp_param.sharded_param.grad)
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    add(unsharded)
                    add(unsharded.grad)
                add(fsdp_param.unsharded_accumulated_grad)
    for values in eng.optimizer.state.values():
        for value in values.values():
            if torch.is_tensor(value):
                add(value)
    return sum(storages.values())


def traffic_and_memory(model, data):
    rows = []
    modes = [(0, False), (1, False), (2, False), (2, True), (3, False), (3, True)]
    for stage, reduce_every in modes:
        for accumulation in (1, 2, 4, 8):
            eng = engine.initialize(copy.deepcopy(model), engine_config(stage, accumulation, reduce_every=reduce_every),
                                    optimizer=adamw)
            eng.train_batch(data, mse)  # optimizer state exists from here on
            window_peak = 0
            with CommCounter() as comm:
                if stage < 2:
                    comm.watch_ddp(eng.strategy.forward_module)
                for micro_batch, size in eng._split_for_window(data):
                    eng._backward(mse(eng, micro_batch), size, exact_counts=True)
                    window_peak = max(window_peak, held_bytes(eng))
                eng._close_window()
            rows.append({"stage": stage, "reduce_every_micro_step": reduce_every, "accumulation": accumulation,
                         "sent_MB_per_step": comm.sent_bytes / 1e6, "calls": dict(comm.calls),
                         "held_MB_peak": window_peak / 1e6})
    return rows


def main(argv=None):
    args, info, model, data = start_ranks(__doc__.splitlines()[0], rounds=8, argv=argv)

    traffic = traffic_and_memory(model, data)
    times = interleaved(variants(model, data), args.rounds, args.steps, warmup=1, distributed=True)
    if info.rank != 0:
        return
    baselines = {"0": "hand DDP + no_sync", "1": "hand DDP + no_sync", "2": "hand FSDP2 stage 2, deferred",
                 "3": "hand FSDP2 stage 3, deferred"}
    print(f"{'variant':48s} {'ms/step':>8s} {'vs hand':>8s}")
    ratios = {}
    for name, seconds in times.items():
        stage = re.search(r"stage (\d)", name)
        ratios[name] = seconds / times[baselines[stage[1] if stage else "0"]]
        print(f"{name:48s} {seconds * 1e3:8.1f} {ratios[name]:8.3f}")
    print(f"\n{'stage':>5s} {'reduce every':>12s} {'accum':>5s} {'sent MB/step':>12s} {'held MB':>8s}  calls   (held: after each micro-step's backward, max)")
    for row in traffic:
        print(f"{row['stage']:5d} {str(row['reduce_every_micro_step']):>12s} {row['accumulation']:5d} "
              f"{row['sent_MB_per_step']:12.1f} {row['held_MB_peak']:8.1f}  {row['calls']}")
    save("distributed", {"workload": f"MLP 4.2M params, global batch {GLOBAL_BATCH}, AdamW fp32, "
                                     f"{info.world_size} ranks gloo, accumulation 4 for timings",
                         "ms_per_step": {k: v * 1e3 for k, v in times.items()}, "ratio_vs_hand": ratios,
                         "traffic_and_memory": traffic})


if __name__ == "__main__":
    main()
