"""Data parallelism and ZeRO: time per optimizer step of the engine against the same training
written by hand, at equal memory.

    python -m launch --nproc-per-node 2 bench/distributed.py [--rounds 8] [--steps 3] [--stage-0]

Workload: the 4.2M-parameter MLP of bench/common.py, global batch 64, accumulation 4,
AdamW, fp32, gloo. Every variant trains its own copy; variants alternate round by round and
the slowest rank's time counts. Rows by memory profile:

* ZeRO memory (the engine's defaults): stage 0 against DDP with ``no_sync``; stage 1 against
  the same with PyTorch's ZeRO-1, ``ZeroRedundancyOptimizer`` (the optimizer state sharded, the
  updated parameters broadcast from their owners); stages 2 and 3 against FSDP2 loops that hold the
  same memory — gradients reduce-scattered every micro-step; parameters gathered for the
  window at stage 2, freed after every forward and backward at stage 3. The hand loops shard
  the model as the engine does (its default ``shard_unit_size`` makes this MLP one unit) and
  come twice: with FSDP2's own collectives, and with the engine's gloo reduce-scatter
  (all-to-all), which leaves only the engine's own overhead in the ratio.
* Deferred reduction (``defer_reduction: true``: memory traded for traffic): against FSDP2
  with gradient sync and resharding deferred to the window's last micro-step.

Results: bench/results/distributed_w<W>.json (rank 0 prints a table). Held memory and traffic:
bench/zero_memory.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import engine
from bench.common import ADAMW, GLOBAL_BATCH, adamw, interleaved, mse, save, start_ranks
from engine.adapters.torch_internals import fsdp_comms

ACCUMULATION = 4


# -- hand-written baselines -------------------------------------------------------------------
def _micro_batches(data):
    return list(zip(data[0].chunk(ACCUMULATION), data[1].chunk(ACCUMULATION)))


def sharded_adamw(params):
    """PyTorch's ZeRO-1: AdamW whose state each rank keeps for its share of the parameters."""
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **ADAMW)


def hand_ddp(model, data, optimizer_of=adamw):
    ddp = DistributedDataParallel(model)
    optimizer = optimizer_of(model.parameters())
    micro_batches = _micro_batches(data)

    def step():
        for i, micro_batch in enumerate(micro_batches):
            if i < ACCUMULATION - 1:
                with ddp.no_sync():
                    (mse(ddp, micro_batch) / ACCUMULATION).backward()
            else:
                (mse(ddp, micro_batch) / ACCUMULATION).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def hand_fsdp(model, data, stage, *, defer, engine_comms):
    """FSDP2 over the whole model as one unit (the engine's default units for this MLP)."""
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                reshard_after_forward=None if stage == 3 else False)
    if engine_comms:
        all_gather, reduce_scatter = fsdp_comms(all_to_all_reduce_scatter=True)
        model.set_custom_all_gather(all_gather)
        model.set_custom_reduce_scatter(reduce_scatter)
    optimizer = adamw(model.parameters())
    micro_batches = _micro_batches(data)

    def step():
        for i, micro_batch in enumerate(micro_batches):
            last = i == ACCUMULATION - 1
            model.set_requires_gradient_sync(last or not defer)
            model.set_reshard_after_backward(last or (stage == 3 and not defer))
            (mse(model, micro_batch) / ACCUMULATION).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


# -- the engine ---------------------------------------------------------------------------------
def engine_config(stage, micro="fixed", defer=False):
    """``micro="auto"``: capped (``auto_max``) at the fixed size, so that it runs the same
    accumulation and the row measures the failure guard's cost alone."""
    fixed = GLOBAL_BATCH // dist.get_world_size() // ACCUMULATION
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": fixed,
              "zero_optimization": {"stage": stage, "defer_reduction": defer}}
    if micro == "auto":
        config.update(train_micro_batch_size_per_gpu="auto", auto_max=fixed)
    return config


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


# name -> (memory profile, baseline row, build)
def variants(model, data):
    rows = {
        "hand DDP + no_sync": ("ZeRO", None, lambda m: hand_ddp(m, data)),
        "hand DDP + no_sync, second copy (noise floor)": ("ZeRO", "hand DDP + no_sync", lambda m: hand_ddp(m, data)),
        "engine stage 0 (train_batch)": ("ZeRO", "hand DDP + no_sync",
                                         lambda m: engine_train_batch(m, data, engine_config(0))),
        "engine stage 0 (manual loop)": ("ZeRO", "hand DDP + no_sync",
                                         lambda m: engine_manual_loop(m, data, engine_config(0))),
        "engine stage 0, auto (guarded)": ("ZeRO", "hand DDP + no_sync",
                                           lambda m: engine_train_batch(m, data, engine_config(0, micro="auto"))),
        "hand DDP + no_sync + ZeroRedundancyOptimizer": ("ZeRO", None, lambda m: hand_ddp(m, data, sharded_adamw)),
        "engine stage 1": ("ZeRO", "hand DDP + no_sync + ZeroRedundancyOptimizer",
                           lambda m: engine_train_batch(m, data, engine_config(1))),
    }
    for stage in (2, 3):
        hand, fast = f"hand FSDP2 stage {stage}", f"hand FSDP2 stage {stage} + engine's gloo reduce-scatter"
        rows[hand] = ("ZeRO", None, lambda m, s=stage: hand_fsdp(m, data, s, defer=False, engine_comms=False))
        rows[fast] = ("ZeRO", None, lambda m, s=stage: hand_fsdp(m, data, s, defer=False, engine_comms=True))
        rows[f"engine stage {stage}"] = ("ZeRO", fast, lambda m, s=stage: engine_train_batch(m, data, engine_config(s)))
        rows[f"engine stage {stage}, auto (guarded)"] = (
            "ZeRO", fast, lambda m, s=stage: engine_train_batch(m, data, engine_config(s, micro="auto")))
        deferred = f"hand FSDP2 stage {stage}, deferred"
        rows[deferred] = ("deferred", None, lambda m, s=stage: hand_fsdp(m, data, s, defer=True, engine_comms=True))
        rows[f"engine stage {stage}, defer_reduction: true"] = (
            "deferred", deferred, lambda m, s=stage: engine_train_batch(m, data, engine_config(s, defer=True)))
    return rows


STAGE_0 = ("hand DDP + no_sync", "hand DDP + no_sync, second copy (noise floor)", "engine stage 0 (train_batch)",
           "engine stage 0 (manual loop)")


def _stage_0_argument(parser) -> None:
    parser.add_argument("--stage-0", action="store_true",
                        help="only stage 0 against DDP with no_sync (its noise floor, train_batch, the manual loop)")


def main(argv=None):
    args, info, model, data = start_ranks(__doc__.splitlines()[0], rounds=8, argv=argv,
                                          add_arguments=_stage_0_argument)
    rows = variants(model, data)
    if args.stage_0:
        rows = {name: row for name, row in rows.items() if name in STAGE_0}
    runs = {name: build(copy.deepcopy(model)) for name, (_, _, build) in rows.items()}
    times = interleaved(runs, args.rounds, args.steps, warmup=1, distributed=True)
    if info.rank != 0:
        return
    print(f"{'variant':58s} {'memory':>8s} {'ms/step':>8s} {'vs':>6s}  baseline")
    result = {}
    for name, (memory, baseline, _) in rows.items():
        ratio = times[name] / times[baseline] if baseline else None
        result[name] = {"memory": memory, "ms_per_step": times[name] * 1e3, "baseline": baseline, "ratio": ratio}
        print(f"{name:58s} {memory:>8s} {times[name] * 1e3:8.1f} {'' if ratio is None else f'{ratio:6.3f}':>6s}  "
              f"{baseline or ''}")
    save(f"distributed_w{info.world_size}", {
        "workload": f"MLP 4.2M params, global batch {GLOBAL_BATCH}, accumulation {ACCUMULATION}, AdamW fp32, "
                    f"{info.world_size} ranks gloo, {args.rounds} rounds x {args.steps} steps, median, slowest rank",
        "variants": result}, record=args.record)


if __name__ == "__main__":
    main()
