"""Tensor parallelism composed with data parallelism: time per optimizer step of the engine
against the same 2-D parallelism written by hand, bytes sent and memory held per rank.

    python -m launch --nproc-per-node 4 bench/tensor_parallel.py [--rounds 8] [--steps 3]

The mesh is tensor 2 × data W/2. Workload: the 4.2M-parameter MLP of bench/common.py
(Megatron's split: layers 0 and 2, 4 and 6 paired column → row, which is what
``tensor_parallel.plan: auto`` finds), global batch 64, accumulation 4, AdamW, fp32, gloo.
The hand loops do what the engine does, written directly against PyTorch:

* ZeRO 0: ``parallelize_module`` on the tensor sub-mesh, ``(loss / 4).backward()`` per
  micro-batch, one flat all-reduce of the gradient pieces over the data group per window;
* ZeRO 3: ``parallelize_module``, then ``fully_shard(mesh=mesh["data"])`` over the whole
  model (this MLP is one shard unit for the engine too), gradients reduce-scattered every
  micro-step, parameters freed after every forward and backward, the engine's gloo
  reduce-scatter (``fsdp_comms``) so that only the engine's own overhead is in the ratio.

Bytes: what one rank sends per optimizer step with ring algorithms (an all-reduce of n bytes
over g ranks sends 2n(g−1)/g; an all-gather or reduce-scatter n(g−1)/g), counted by patching
``torch.distributed`` (the data group's collectives) and the functional collectives DTensor
issues (the tensor group's). Memory: the bytes of parameters, optimizer state (and any
gathered copies) the fullest rank keeps between optimizer steps (``engine.memory``'s count
of distinct storages).

Time per step is wall-clock (the slowest rank, median over rounds, variants interleaved); as
this machine is often shared, CPU time per step (mean over ranks) is measured as well: what
each variant itself computes, without waiting for a core.

Results: bench/results/tensor_parallel_w<W>.json (rank 0 prints a table).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy
import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import engine
from bench.common import GLOBAL_BATCH, adamw, add_record_argument, batch, cpu_interleaved, interleaved, mlp, mse, save
from engine.adapters.torch_internals import fsdp_comms, fsdp_held_tensors
from engine.distributed.collectives import all_reduce_mean_
from engine.memory import held_bytes, storage_bytes

ACCUMULATION = 4
TENSOR = 2
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(), "6": RowwiseParallel()}


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


# -- hand-written 2-D parallelism -------------------------------------------------------------
def hand_mesh():
    data = dist.get_world_size() // TENSOR
    return init_device_mesh("cpu", (data, TENSOR), mesh_dim_names=("data", "tensor"))


def hand_tp_zero0(model, data):
    mesh = hand_mesh()
    parallelize_module(model, mesh["tensor"], PLAN)
    optimizer = adamw(model.parameters())
    group, size = mesh["data"].get_group(), mesh["data"].size()
    micro_batches = list(zip(data[0].chunk(ACCUMULATION), data[1].chunk(ACCUMULATION)))

    def step():
        for micro_batch in micro_batches:
            (mse(model, micro_batch) / ACCUMULATION).backward()
        if size > 1:
            all_reduce_mean_([local(p.grad) for p in model.parameters()], size, group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.held = lambda: storage_bytes(_model_state(model, optimizer))
    return step


def hand_tp_zero3(model, data):
    mesh = hand_mesh()
    parallelize_module(model, mesh["tensor"], PLAN)
    fully_shard(model, mesh=mesh["data"], reshard_after_forward=None)
    all_gather, reduce_scatter = fsdp_comms(all_to_all_reduce_scatter=True)
    model.set_custom_all_gather(all_gather)
    model.set_custom_reduce_scatter(reduce_scatter)
    optimizer = adamw(model.parameters())
    micro_batches = list(zip(data[0].chunk(ACCUMULATION), data[1].chunk(ACCUMULATION)))

    def step():
        for micro_batch in micro_batches:
            (mse(model, micro_batch) / ACCUMULATION).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.held = lambda: storage_bytes(_model_state(model, optimizer) + list(fsdp_held_tensors([model])))
    return step


def _model_state(model, optimizer):
    params = list(model.parameters())
    return params + [p.grad for p in params] + [v for s in optimizer.state.values() for v in s.values()
                                                if torch.is_tensor(v)]


# -- the engine ---------------------------------------------------------------------------------
def engine_step(model, data, stage):
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (
        dist.get_world_size() // TENSOR) // ACCUMULATION, "zero_optimization": {"stage": stage},
        "tensor_parallel": {"size": TENSOR}}
    eng = engine.initialize(model, config, optimizer=adamw)
    step = functools.partial(eng.train_batch, data, mse)
    step.held = lambda: held_bytes(eng.strategy)
    return step


# -- counting -------------------------------------------------------------------------------------
class SentBytes:
    """Bytes this rank sends (ring algorithms), data-group collectives (torch.distributed) and
    tensor-group ones (the functional collectives DTensor issues) apart."""

    def __init__(self):
        self.sent = {"data": 0.0, "tensor": 0.0}
        self._patched = []

    def _patch(self, module, name, where, factor, size_of):
        original = getattr(module, name)

        def counted(*args, **kwargs):
            tensor = args[0] if args else next(iter(kwargs.values()))
            group = size_of(args, kwargs)
            self.sent[where] += factor * tensor.numel() * tensor.element_size() * (group - 1) / group
            return original(*args, **kwargs)

        setattr(module, name, counted)
        self._patched.append((module, name, original))

    def __enter__(self):
        def group_size(args, kwargs):
            return dist.get_world_size(kwargs.get("group"))

        tensor_group = lambda args, kwargs: TENSOR  # noqa: E731 - DTensor's collectives here are the tensor group's
        self._patch(dist, "all_reduce", "data", 2.0, group_size)
        self._patch(dist, "all_to_all_single", "data", 1.0, lambda a, k: dist.get_world_size(k.get("group")))
        for name in ("all_gather_into_tensor", "all_gather_single"):  # FSDP2's, by torch version
            if hasattr(dist, name):
                self._patch(dist, name, "data", 1.0, group_size)
        self._patch(funcol, "all_reduce", "tensor", 2.0, tensor_group)
        self._patch(funcol, "all_gather_tensor", "tensor", TENSOR, tensor_group)  # its input is one piece
        self._patch(funcol, "reduce_scatter_tensor", "tensor", 1.0, tensor_group)
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)


def measure(run) -> dict:
    """Bytes sent in one optimizer step, and the bytes held once it is done (what a rank keeps
    between steps: gradients are freed by then)."""
    with SentBytes() as counter:
        run()
    held = torch.tensor(float(run.held()))
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return {"sent_mb_data": counter.sent["data"] / 1e6, "sent_mb_tensor": counter.sent["tensor"] / 1e6,
            "held_mb": float(held) / 1e6}


def main(argv=None):
    import argparse

    from engine.distributed.process_group import init_distributed, strip_local_rank_arg

    strip_local_rank_arg(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    add_record_argument(parser)
    args = parser.parse_args(argv)
    info = init_distributed()
    torch.set_num_threads(1)
    data_ranks = info.world_size // TENSOR
    x, y = batch(GLOBAL_BATCH)
    share, data_rank = GLOBAL_BATCH // data_ranks, info.rank // TENSOR
    data = x[data_rank * share:(data_rank + 1) * share], y[data_rank * share:(data_rank + 1) * share]
    model = mlp()
    rows = {  # name -> (baseline, build)
        "hand TP + DP, ZeRO 0": (None, lambda m: hand_tp_zero0(m, data)),
        "hand TP + DP, ZeRO 0, second copy (noise floor)": ("hand TP + DP, ZeRO 0", lambda m: hand_tp_zero0(m, data)),
        "engine tensor 2, stage 0": ("hand TP + DP, ZeRO 0", lambda m: engine_step(m, data, 0)),
        "hand TP + FSDP2, ZeRO 3": (None, lambda m: hand_tp_zero3(m, data)),
        "hand TP + FSDP2, ZeRO 3, second copy (noise floor)": ("hand TP + FSDP2, ZeRO 3",
                                                               lambda m: hand_tp_zero3(m, data)),
        "engine tensor 2, stage 3": ("hand TP + FSDP2, ZeRO 3", lambda m: engine_step(m, data, 3)),
    }
    runs = {name: build(copy.deepcopy(model)) for name, (_, build) in rows.items()}
    counted = {name: measure(run) for name, run in runs.items()}  # also the runs' warm-up
    times = interleaved(runs, args.rounds, args.steps, warmup=1, distributed=True)
    cpu = cpu_interleaved(runs, args.rounds, args.steps)
    if info.rank != 0:
        return
    mesh = f"tensor {TENSOR} x data {data_ranks}"
    print(f"mesh: {mesh}")
    print(f"{'variant':52s} {'ms/step':>8s} {'vs':>6s} {'cpu ms':>7s} {'vs':>6s} {'sent MB data':>12s} {'tensor':>7s} "
          f"{'held MB':>8s}")
    result = {}
    for name, (baseline, _) in rows.items():
        ratio = times[name] / times[baseline] if baseline else None
        cpu_ratio = cpu[name] / cpu[baseline] if baseline else None
        result[name] = {"ms_per_step": times[name] * 1e3, "baseline": baseline, "ratio": ratio,
                        "cpu_ms_per_step": cpu[name] * 1e3, "cpu_ratio": cpu_ratio, **counted[name]}
        c = counted[name]
        print(f"{name:52s} {times[name] * 1e3:8.1f} {'' if ratio is None else f'{ratio:6.3f}':>6s} "
              f"{cpu[name] * 1e3:7.1f} {'' if cpu_ratio is None else f'{cpu_ratio:6.3f}':>6s} "
              f"{c['sent_mb_data']:12.1f} {c['sent_mb_tensor']:7.1f} {c['held_mb']:8.1f}")
    save(f"tensor_parallel_w{info.world_size}", {
        "workload": f"MLP 4.2M params, {mesh}, global batch {GLOBAL_BATCH}, accumulation {ACCUMULATION}, AdamW fp32, "
                    f"gloo, {args.rounds} rounds x {args.steps} steps, median, slowest rank",
        "variants": result}, record=args.record)


if __name__ == "__main__":
    main()
