"""Where the fault checks wait, 2 ranks: the engine as it is against the same engine with the
third round's placement of its checks (a position check at every window's start, the non-finite
check's gradient norm computed in the step: its own pass, host sync and, at ZeRO-2/3, all-reduce)
and against the hand-written loops of bench/distributed.py, all interleaved in one run.

    python -m launch --nproc-per-node 2 bench/check_placement.py [--rounds 16] [--steps 3]

Workload and hand loops: bench/distributed.py's (accumulation 4, global batch 64, AdamW, fp32,
gloo; DDP with ``no_sync`` at ZeRO-0/1, FSDP2 with the engine's reduce-scatter at ZeRO-2/3).
On a machine shared with other jobs the load drifts during a run, so besides each variant's
median time (and the ratio of medians, as bench/distributed.py reports) every ratio is also
taken round by round — the variants of one round run seconds apart — with its median and
quartiles over the rounds; "now / third round" compares the two engines directly that way.
Results: bench/results/check_placement_w<W>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy
import statistics

import torch

import engine
from bench.common import GLOBAL_BATCH, adamw, mse, rotating_rounds, save, start_ranks, wall_seconds
from bench.distributed import ACCUMULATION, engine_config, hand_ddp, hand_fsdp
from engine.window.positions import WINDOW_START


def third_round_checks(eng):
    """The engine with its checks where the third round put them: the position check at every
    window's start and the gradient norm computed by the step, not carried in the window's
    statistics. Benchmark only."""
    windows = eng.windows
    start_window = windows.start

    def checked_start():
        if not windows.capabilities.communicates_before_closing_backward():  # where the engine skips it now
            windows.agree(WINDOW_START)
        start_window()

    windows.start = checked_start
    eng.strategy.grad_squares_share = lambda: None
    return eng


def unchecked(eng):
    """The engine with no position check at all (what the checks cost in all; unsafe). Benchmark only."""
    eng.windows.agree = lambda point: None
    return eng


def rows(model, data):
    """name -> (baseline name or None, build)."""
    def engine_rows(stage, defer, baseline):
        label = f"engine stage {stage}" + (", defer_reduction: true" if defer else "")

        def build(m, change):
            eng = change(engine.initialize(m, engine_config(stage, defer=defer), optimizer=adamw))
            return lambda: eng.train_batch(data, mse)

        built = {label: (baseline, lambda m: build(m, lambda e: e)),
                 f"{label}, third round's checks": (baseline, lambda m: build(m, third_round_checks))}
        if stage == 0 or defer:  # where the one check left mid-window is most of the engine's waits
            built[f"{label}, no position check"] = (baseline, lambda m: build(m, unchecked))
        return built

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


def timed_rounds(runs: dict, rounds: int, steps: int) -> dict[str, list[float]]:
    """Seconds per step of each variant in every round (slowest rank), the variants in a rotating
    order (as bench.common.interleaved, which keeps only the medians), after one warm-up call."""
    for run in runs.values():
        run()
    return rotating_rounds(runs, rounds, wall_seconds(steps, distributed=True))


def per_round(samples: dict, name: str, baseline: str) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) over the rounds of ``name``'s time / ``baseline``'s."""
    ratios = [a / b for a, b in zip(samples[name], samples[baseline])]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return q1, median, q3


def main(argv=None):
    args, info, model, data = start_ranks(__doc__.splitlines()[0], rounds=16, argv=argv)
    table = rows(model, data)
    runs = {name: build(copy.deepcopy(model)) for name, (_, build) in table.items()}
    samples = timed_rounds(runs, args.rounds, args.steps)
    if info.rank != 0:
        return
    times = {name: statistics.median(values) for name, values in samples.items()}
    print(f"{'variant':62s} {'ms/step':>8s} {'vs':>6s}  {'round by round (quartiles)':>26s}")
    result = {}
    for name, (baseline, _) in table.items():
        entry = {"ms_per_step": times[name] * 1e3, "baseline": baseline}
        line = f"{name:62s} {times[name] * 1e3:8.1f}"
        if baseline:
            entry["ratio"] = times[name] / times[baseline]
            entry["ratio_per_round"] = q1, median, q3 = per_round(samples, name, baseline)
            line += f" {entry['ratio']:6.3f}  {median:6.3f} ({q1:.3f}-{q3:.3f})"
        result[name] = entry
        print(line)
    print("\nnow / third round's checks, round by round: median (quartiles)")
    for name in table:
        if name.endswith(", third round's checks"):  # and "no position check" rows stay against the hand loop
            now = name.removesuffix(", third round's checks")
            q1, median, q3 = per_round(samples, now, name)
            result[name]["now_over_this_per_round"] = (q1, median, q3)
            print(f"  {now:60s} {median:6.3f} ({q1:.3f}-{q3:.3f})")
    save(f"check_placement_w{info.world_size}", {
        "workload": f"MLP 4.2M params, global batch {GLOBAL_BATCH}, accumulation {ACCUMULATION}, AdamW fp32, "
                    f"{info.world_size} ranks gloo, {args.rounds} rounds x {args.steps} steps, median, slowest rank",
        "variants": result}, record=args.record)


if __name__ == "__main__":
    main()
