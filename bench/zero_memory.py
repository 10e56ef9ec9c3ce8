"""Memory held and bytes sent per optimizer step, for every ZeRO stage and reduction mode,
on both backends and for DeepSpeed driven by hand, against ZeRO theory.

    python -m launch --nproc-per-node 2 bench/zero_memory.py
    python -m launch --nproc-per-node 4 bench/zero_memory.py

Workload: the 4.2M-parameter MLP of bench/common.py (P = 16.8 MB of fp32 parameters), AdamW,
global batch 64, accumulation 1, 2, 4 and 8. "Held" is the most bytes of parameters,
gradients, optimizer state and a framework's gathered copies one rank holds after any
micro-step's backward (``engine.memory.held_bytes``: distinct tensor storages, counted, not
timed; DeepSpeed's through its ZeRO optimizer's attributes). "Sent" is what one rank puts on
the wire for one optimizer step (bench/comm_count.py, ring-algorithm bytes). ZeRO theory per
rank, AdamW in fp32: stage 0 holds 4P, stage 1 2P + 2P/W, stage 2 P + 4P/W (gathered
parameters + sharded parameters, gradient and moments), stage 3 4P/W. On CUDA the peak
allocation is reported too. Results: bench/results/zero_memory_w<W>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy
import importlib.util

import torch
import torch.distributed as dist

import engine
from bench.comm_count import CommCounter
from bench.common import GLOBAL_BATCH, adamw, mse, save, start_ranks
from engine.adapters import deepspeed_internals
from engine.memory import held_bytes, storage_bytes

ACCUMULATIONS = (1, 2, 4, 8)
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def theory(stage: int, P: int, world: int) -> float:
    return {0: 4 * P, 1: 2 * P + 2 * P / world, 2: P + 4 * P / world, 3: 4 * P / world}[stage]


def modes():
    """(name, backend, stage, defer_reduction)."""
    rows = [("stage 0", "torch", 0, False), ("stage 1", "torch", 1, False)]
    for stage in (2, 3):
        rows += [(f"stage {stage}", "torch", stage, False),
                 (f"stage {stage}, defer_reduction: true", "torch", stage, True)]
    if HAS_DEEPSPEED:
        for stage in (1, 2, 3):
            rows.append((f"stage {stage} deepspeed backend", "deepspeed", stage, False))
        for stage in (2, 3):
            rows.append((f"stage {stage} deepspeed backend, defer_reduction: true", "deepspeed", stage, True))
    return rows


def engine_window(model, data, backend, stage, defer, accumulation):
    """(held bytes max, MB sent, calls) of one manual-loop window after a warm-up window."""
    micro = GLOBAL_BATCH // dist.get_world_size() // accumulation
    eng = engine.initialize(model, {"backend": backend, "train_batch_size": GLOBAL_BATCH,
                                    "train_micro_batch_size_per_gpu": micro,
                                    "zero_optimization": {"stage": stage, "defer_reduction": defer}}, optimizer=adamw)
    eng.train_batch(data, mse)  # optimizer state exists from here on
    held = 0
    if eng.strategy.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with CommCounter() as comm:
        unwatch = comm.watch_deepspeed() if backend == "deepspeed" else (lambda: None)
        if stage < 2 and backend == "torch":
            comm.watch_ddp(eng.strategy.forward_module)
        try:
            for micro_batch in zip(*(t.split(micro) for t in data)):
                eng.backward(mse(eng, micro_batch))
                held = max(held, held_bytes(eng.strategy))
                eng.step()
        finally:
            unwatch()
    peak = torch.cuda.max_memory_allocated() if eng.strategy.device.type == "cuda" else None
    eng.close()
    return held, comm.sent_bytes / 1e6, dict(comm.calls), peak


def deepspeed_by_hand_window(model, data, stage, accumulation):
    deepspeed = deepspeed_internals.import_deepspeed()
    micro = GLOBAL_BATCH // dist.get_world_size() // accumulation
    zero = {"stage": stage, **({"memory_efficient_linear": False} if stage == 3 else {})}
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), dist_init_required=False,
                                         config={"train_batch_size": GLOBAL_BATCH,
                                                 "train_micro_batch_size_per_gpu": micro,
                                                 "gradient_accumulation_steps": accumulation,
                                                 "gradient_clipping": 0.0, "zero_optimization": zero})
    micro_batches = list(zip(*(t.split(micro) for t in data)))

    def run(measure):
        for micro_batch in micro_batches:
            ds_engine.backward(mse(ds_engine, micro_batch))
            measure()
            ds_engine.step()

    run(lambda: None)
    held = [0]
    with CommCounter() as comm:
        unwatch = comm.watch_deepspeed()
        try:
            run(lambda: held.__setitem__(0, max(held[0], storage_bytes(deepspeed_internals.held_tensors(ds_engine)))))
        finally:
            unwatch()
    ds_engine.destroy()
    return held[0], comm.sent_bytes / 1e6, dict(comm.calls), None


def main(argv=None):
    args, info, model, data = start_ranks(__doc__.splitlines()[0], rounds=1, argv=argv)
    P = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    cases = [(name, backend, stage, defer) for name, backend, stage, defer in modes()]
    if HAS_DEEPSPEED:
        cases += [(f"stage {stage} DeepSpeed by hand", "by hand", stage, False) for stage in (2, 3)]
    for name, backend, stage, defer in cases:
        row = {"mode": name, "backend": backend, "stage": stage, "defer_reduction": defer,
               "theory_MB": theory(stage, P, info.world_size) / 1e6, "by_accumulation": {}}
        for accumulation in ACCUMULATIONS:
            if backend == "by hand":
                held, sent, calls, peak = deepspeed_by_hand_window(copy.deepcopy(model), data, stage, accumulation)
            else:
                held, sent, calls, peak = engine_window(copy.deepcopy(model), data, backend, stage, defer, accumulation)
            row["by_accumulation"][accumulation] = {"held_MB": held / 1e6, "sent_MB": sent, "calls": calls,
                                                    "cuda_peak_MB": None if peak is None else peak / 1e6}
        rows.append(row)
    if info.rank != 0:
        return
    print(f"P = {P / 1e6:.1f} MB, {info.world_size} ranks")
    print(f"{'mode':52s} {'theory':>7s} {'held':>7s}  sent MB at A=1,2,4,8")
    for row in rows:
        by = row["by_accumulation"]
        held = max(by[a]["held_MB"] for a in ACCUMULATIONS if a > 1)
        print(f"{row['mode']:52s} {row['theory_MB']:7.1f} {held:7.1f}  "
              + " ".join(f"{by[a]['sent_MB']:6.1f}" for a in ACCUMULATIONS))
    save(f"zero_memory_w{info.world_size}", {
        "workload": f"MLP 4.2M params (P = {P / 1e6:.1f} MB fp32), AdamW, global batch {GLOBAL_BATCH}, "
                    f"{info.world_size} ranks gloo; held = max over the backwards of a window (A >= 2 shown in docs)",
        "rows": rows}, record=args.record)


if __name__ == "__main__":
    main()
