"""The torch backend and the DeepSpeed backend against DeepSpeed driven by hand: time per
optimizer step and bytes sent per step, ZeRO stages 0-3, at equal memory.

    python -m launch --nproc-per-node 2 bench/deepspeed_compare.py [--rounds 6] [--steps 3]

Workload: the 4.2M-parameter MLP of bench/common.py, global batch 64, accumulation 4
(micro-batch 8 per rank on 2 ranks), fp32, a torch AdamW instance, no clipping, gloo.
Variants:

* ``torch``: Microstep's torch backend (DDP, ZeRO-1, FSDP2), ``train_batch``, defaults
  (ZeRO memory: stages 2/3 reduce into shards after every micro-step);
* ``deepspeed``: ``backend: deepspeed``, ``train_batch``, defaults (stage 1: one coalesced
  reduction per window; stages 2/3: DeepSpeed's own per-micro-step reduction);
* ``DeepSpeed by hand``: ``deepspeed.initialize`` with the batch keys and
  ``gradient_clipping: 0``, the standard loop ``loss = f(eng(x)); eng.backward(loss);
  eng.step()`` per micro-batch (DeepSpeed's GAS: stages 2/3 reduce every micro-batch).
  ``memory_efficient_linear: false`` at stage 3, so that ZeRO-3 does not patch
  ``torch.nn.functional.linear`` for every other variant in the process;
* at stage 0 two more rows place the engine between the two hand loops: ``torch, manual
  loop`` (the engine without ``train_batch``'s window agreement, one small all-reduce) and
  ``hand DDP`` (bench/distributed.py's DDP + ``no_sync`` loop; its bytes are not counted:
  the same DDP all-reduce as the torch row);
* ``defer`` rows (memory traded for traffic, not at equal memory): ``defer_reduction: true``
  on either backend.

Every variant trains its own copy; all variants alternate round by round and the slowest
rank's time counts (median over rounds). Bytes: one optimizer step per variant counted by
``bench.comm_count.CommCounter`` (torch.distributed calls, DDP's hook) plus
``CommCounter.watch_deepspeed`` (DeepSpeed's comm backend, which
binds some torch functions at start-up): every collective is counted once, as the bytes
one rank puts on the wire with ring algorithms. Results: bench/results/deepspeed_compare_w<W>.json.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist

import engine
from bench.common import GLOBAL_BATCH, adamw, interleaved, mse, save, start_ranks
from bench.comm_count import CommCounter
from bench.distributed import engine_config, engine_manual_loop, hand_ddp
from engine.adapters.deepspeed_internals import import_deepspeed

ACCUMULATION = 4


def microstep(model, data, stage, backend, defer=False):
    micro = GLOBAL_BATCH // dist.get_world_size() // ACCUMULATION
    config = {"backend": backend, "train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
              "zero_optimization": {"stage": stage, "defer_reduction": defer}}
    eng = engine.initialize(model, config, optimizer=adamw)
    return lambda: eng.train_batch(data, mse), eng


def by_hand(model, data, stage):
    deepspeed = import_deepspeed()
    micro = GLOBAL_BATCH // dist.get_world_size() // ACCUMULATION
    zero = {"stage": stage}
    if stage == 3:
        zero["memory_efficient_linear"] = False
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": ACCUMULATION, "gradient_clipping": 0.0, "zero_optimization": zero}
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its comm op's loading
        eng, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=config,
                                       dist_init_required=False)
    micro_batches = list(zip(data[0].split(micro), data[1].split(micro)))

    def step():
        for micro_batch in micro_batches:
            eng.backward(mse(eng, micro_batch))
            eng.step()

    return step, eng


def variants(model, data):
    rows = {}
    for stage in range(4):
        def add(name, build, *args, stage=stage):
            rows[name] = (stage,) + build(copy.deepcopy(model), data, stage, *args)

        add(f"stage {stage} torch", microstep, "torch")
        add(f"stage {stage} deepspeed", microstep, "deepspeed")
        add(f"stage {stage} DeepSpeed by hand", by_hand)
        if stage == 0:
            add("stage 0 torch, manual loop", lambda m, d, s: (engine_manual_loop(m, d, engine_config(s)), None))
            add("stage 0 hand DDP", lambda m, d, s: (hand_ddp(m, d), None))
        if stage >= 2:
            add(f"stage {stage} torch, defer", microstep, "torch", True)
            add(f"stage {stage} deepspeed, defer", microstep, "deepspeed", True)
    return rows


def bytes_per_step(run, handle) -> tuple[float | None, dict]:
    """(MB one rank sends in one optimizer step, calls by kind), on a variant used for nothing
    else; (None, {}) for a hand loop whose DDP reducer the counter cannot reach."""
    if handle is None:
        return None, {}
    with CommCounter() as comm:
        unwatch = comm.watch_deepspeed()  # harmless for torch variants: DeepSpeed is idle
        ddp = getattr(getattr(handle, "strategy", None), "forward_module", None)
        if hasattr(ddp, "register_comm_hook"):  # DDP's reducer bypasses torch.distributed's Python functions
            comm.watch_ddp(ddp)
        try:
            run()  # optimizer state exists from here on
            comm.reset()
            run()
        finally:
            unwatch()
    return comm.sent_bytes / 1e6, dict(comm.calls)


def close(rows) -> None:
    for _, _, handle in rows.values():
        if handle is not None:
            (handle.close if hasattr(handle, "close") else handle.destroy)()


def main(argv=None):
    args, info, model, data = start_ranks(__doc__.splitlines()[0], rounds=6, argv=argv)
    load_before = os.getloadavg()

    counted = variants(model, data)
    traffic = {name: bytes_per_step(run, handle) for name, (_, run, handle) in counted.items()}
    close(counted)
    rows = variants(model, data)  # timed without any counting hook
    began = time.perf_counter()
    times = interleaved({name: run for name, (_, run, _) in rows.items()}, args.rounds, args.steps,
                        warmup=1, distributed=True)
    load_after = os.getloadavg()
    close(rows)
    if info.rank != 0:
        return
    print(f"{'variant':38s} {'ms/step':>8s} {'vs DS hand':>10s} {'sent MB':>8s}  calls per step")
    result = {}
    for name, (stage, _, _) in rows.items():
        base = times[f"stage {stage} DeepSpeed by hand"]
        mb, calls = traffic[name]
        result[name] = {"stage": stage, "ms_per_step": times[name] * 1e3,
                        "ratio_vs_deepspeed_by_hand": times[name] / base,
                        "memory": "deferred (more)" if name.endswith("defer") else "ZeRO",
                        "sent_MB_per_step": mb, "calls_per_step": calls}
        sent = "-" if mb is None else f"{mb:.1f}"
        print(f"{name:38s} {times[name] * 1e3:8.1f} {times[name] / base:10.3f} {sent:>8s}  {calls}")
    print(f"load average before / after: {load_before[0]:.2f} / {load_after[0]:.2f} "
          f"(timing took {time.perf_counter() - began:.0f} s)")
    save(f"deepspeed_compare_w{info.world_size}", {
        "workload": f"MLP 4.2M params, global batch {GLOBAL_BATCH}, accumulation {ACCUMULATION}, "
                    "AdamW (torch instance), "
                    f"fp32, no clipping, {info.world_size} ranks gloo, {args.rounds} rounds x {args.steps} steps, "
                    "median, slowest rank",
        "bytes": "CommCounter (torch.distributed + DDP hook) + CommCounter.watch_deepspeed (DeepSpeed's comm backend), "
                 "each collective once, ring-model bytes one rank sends",
        "load_average_1min": {"before": load_before[0], "after": load_after[0], "cores": os.cpu_count()},
        "variants": result}, record=args.record)


if __name__ == "__main__":
    main()
