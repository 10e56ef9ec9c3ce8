"""Where the fault checks wait, 2 ranks: the engine as it is against the same engine with the
third round's placement of its checks (a position check at every window's start, the non-finite
check's gradient norm computed in the step: its own pass, host sync and, at ZeRO-2/3, all-reduce)
and against the hand-written loops of bench/distributed.py, all interleaved in one run.

    python -m launch --nproc-per-node 2 bench/check_placement.py [--rounds 16] [--steps 3]

Workload and hand loops: bench/distributed.py's (accumulation 4, global batch 64, AdamW, fp32,
gloo; DDP with ``no_sync`` at ZeRO-0/1, FSDP2 with the engine's reduce-scatter at ZeRO-2/3).
Results: bench/results/check_placement_w<W>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import engine
from bench.common import GLOBAL_BATCH, adamw, interleaved, mse, save, start_ranks
from bench.distributed import ACCUMULATION, engine_config, hand_ddp, hand_fsdp
from engine.engine import WINDOW_START


def third_round_checks(eng):
    """The engine with its checks where the third round put them: the position check at every
    window's start and the gradient norm computed by the step, not carried in the window's
    statistics. Benchmark only."""
    start_window = eng.start_window

    def checked_start():
        if not eng.strategy.communicates_before_closing_backward:  # where the engine skips it now
            eng._agree_on_position(WINDOW_START)
        start_window()

    eng.start_window = checked_start
    eng.strategy.grad_squares_share = lambda: None
    return eng


def rows(model, data):
    """name -> (baseline name or None, build)."""
    def engine_rows(stage, defer, baseline):
        label = f"engine stage {stage}" + (", defer_reduction: true" if defer else "")

        def build(m, previous):
            eng = engine.initialize(m, engine_config(stage, defer=defer), optimizer=adamw)
            if previous:
                third_round_checks(eng)
            return lambda: eng.train_batch(data, mse)

        return {label: (baseline, lambda m: build(m, False)),
                f"{label}, third round's checks": (baseline, lambda m: build(m, True))}

    table = {"hand DDP + no_sync": (None, lambda m: hand_ddp(m, data)),
             "hand DDP + no_sync, second copy (noise floor)": ("hand DDP + no_sync", lambda m: hand_ddp(m, data))}
    table.update(engine_rows(0, False, "hand DDP + no_sync"))
    table.update(engine_rows(1, False, "hand DDP + no_sync"))
    for stage in (2, 3):
        hand = f"hand FSDP2 stage {stage} + engine's gloo reduce-scatter"
        table[hand] = (None, lambda m, s=stage: hand_fsdp(m, data, s, defer=False, engine_comms=True))
        table.update(engine_rows(stage, False, hand))
        deferred = f"hand FSDP2 stage {stage}, deferred"
        table[deferred] = (None, lambda m, s=stage: hand_fsdp(m, data, s, defer=True, engine_comms=True))
        table.update(engine_rows(stage, True, deferred))
    return table


def main(argv=None):
    args, info, model, data = start_ranks(__doc__.splitlines()[0], rounds=16, argv=argv)
    table = rows(model, data)
    runs = {name: build(copy.deepcopy(model)) for name, (_, build) in table.items()}
    times = interleaved(runs, args.rounds, args.steps, warmup=1, distributed=True)
    if info.rank != 0:
        return
    print(f"{'variant':58s} {'ms/step':>8s} {'vs':>6s}  baseline")
    result = {}
    for name, (baseline, _) in table.items():
        ratio = times[name] / times[baseline] if baseline else None
        result[name] = {"ms_per_step": times[name] * 1e3, "baseline": baseline, "ratio": ratio}
        print(f"{name:58s} {times[name] * 1e3:8.1f} {'' if ratio is None else f'{ratio:6.3f}':>6s}  {baseline or ''}")
    save(f"check_placement_w{info.world_size}", {
        "workload": f"MLP 4.2M params, global batch {GLOBAL_BATCH}, accumulation {ACCUMULATION}, AdamW fp32, "
                    f"{info.world_size} ranks gloo, {args.rounds} rounds x {args.steps} steps, median, slowest rank",
        "variants": result})


if __name__ == "__main__":
    main()
