"""Pipeline parallelism: the engine's schedules against the same ``torch.distributed.pipelining``
schedules driven by hand, at accumulation A = 8 (the schedule's micro-batches).

    python -m launch --nproc-per-node 2 bench/pipeline.py [--rounds 8] [--steps 3]

Workload: the 4.2M-parameter MLP of bench/common.py cut in two stages of two linear layers
each (ranks 0 and 1), global batch 64 in 8 micro-batches of 8, AdamW, fp32, gloo. The hand
loop builds the two stages from the same model, runs ``Schedule1F1B`` / ``ScheduleGPipe``
with torch's own averaging over micro-batches (``scale_grads``), steps the optimizer and
zeroes the gradients; the engine adds its weighting by real samples, the window statistics
(which carry the last stage's losses and the gradient's squares over both stages) and the
boundary (clipping off). The rows "hand, the engine's 1F1B / GPipe order" drive the engine's own orders
(``engine.schedule``) on torch's runtime as the engine does (``ActionSchedule``), by hand like the rows
above: their ratio to torch's own classes is what running the orders as data costs. Every variant
trains its own copy; variants alternate round by round
and the slowest rank's time counts.

The hand loop above synchronises its stages nowhere; the engine's window cannot skip that once:
no stage steps before every stage's gradient is known finite. A hand loop that clips by the
global gradient norm, as pipeline training loops do (torchtitan's ``clip_grad_norm_``), makes
that one synchronisation too: the rows "clipped at norm 1" compare the engine with
``gradient_clipping: 1.0`` against the hand schedule + ``clip_over_stages`` (each stage's
squared norm, one all-reduce over the stages, then ``clip_grads_with_norm_``).

Also reported: the bubble fraction — the share of a step the busiest stage spends idle,
measured as 1 - (that stage's own forward and backward of the 8 micro-batches and its
optimizer step, timed alone among the other variants) / (the engine's pipelined step), next
to the schedule's theory (S - 1) / (A + S - 1); and per stage the activation bytes sent per
step (forward activations, or their gradients) and the bytes the stage holds for training
(parameters, gradients, AdamW state: ``engine.memory.held_bytes``, after a step).

Results: bench/results/pipeline_w2.json (rank 0 prints the tables).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (e.g. under a launcher): make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import copy

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import engine
from bench.common import GLOBAL_BATCH, adamw, batch, interleaved, mlp, save, start_ranks
from engine.adapters.pipelining import ActionSchedule
from engine.memory import held_bytes
from engine.strategies.stage_schedules import ScheduleRules

ACCUMULATION = 8
SPLIT = 4  # the second stage starts at the model's part "4": two linear layers per stage
BUSY = "stage alone"
MAX_NORM = 1.0
CLIPPED = f"clipped at norm {MAX_NORM:g}"
ORDER_1F1B, ORDER_GPIPE = "hand, the engine's 1F1B order", "hand, the engine's GPipe order"


def loss_fn(outputs, labels):
    return torch.nn.functional.mse_loss(outputs, labels)


def hand(model, data, schedule_class, rank, max_norm: float = 0.0):
    """The schedule driven by hand: this rank's stage of the model, torch's 1/A averaging;
    ``max_norm``: gradients clipped by their norm over every stage (``clip_over_stages``).
    ``schedule_class``: torch's class, or ``engine_order(name)``."""
    part = model[:SPLIT] if rank == 0 else model[SPLIT:]
    stage = PipelineStage(part, rank, 2, torch.device("cpu"))
    schedule = schedule_class(stage, n_microbatches=ACCUMULATION, loss_fn=loss_fn)
    optimizer = adamw(part.parameters())
    x, y = data

    def step():
        if rank == 0:
            schedule.step(x, target=y)
        else:
            schedule.step(target=y)
        if max_norm:
            clip_over_stages(part.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def engine_order(name: str):
    """The engine's order of schedule ``name`` (``engine.schedule``) on torch's runtime, as the engine runs
    it (``engine.adapters.pipelining.ActionSchedule``), built like torch's class: torch's 1/A averaging."""
    def build(stage, n_microbatches, loss_fn):
        order = ScheduleRules(name, 2).order(n_microbatches)
        return ActionSchedule([stage], n_microbatches, lambda *a: loss_fn(*a) / n_microbatches, order)
    return build


def clip_over_stages(parameters, max_norm: float) -> None:
    """Clipping by the global gradient norm as a hand-written pipeline loop must do it (torchtitan's
    way): each stage's squared norm, summed over the stages, before any stage steps."""
    parameters = list(parameters)
    squares = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None]) ** 2
    dist.all_reduce(squares)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, squares.sqrt())


def engine_run(model, data, schedule, max_norm: float = 0.0):
    eng = engine.initialize(model, {"train_batch_size": GLOBAL_BATCH, "gradient_accumulation_steps": ACCUMULATION,
                                    "pipeline": {"stages": 2, "schedule": schedule, "split": [str(SPLIT)]},
                                    "gradient_clipping": max_norm},
                            optimizer=adamw)

    def step():
        eng.train_batch(data, loss_fn)

    return step, eng


def stage_alone(model, data, rank):
    """This rank's stage computing its 8 micro-batches and its optimizer step with no pipeline
    around it: the stage's busy time in a step."""
    part = model[:SPLIT] if rank == 0 else model[SPLIT:]
    optimizer = adamw(part.parameters())
    x, y = data
    inputs = x if rank == 0 else model[:SPLIT](x).detach()

    def step():
        for chunk, labels in zip(inputs.chunk(ACCUMULATION), y.chunk(ACCUMULATION)):
            out = part(chunk)
            if rank == 0:
                out.backward(torch.ones_like(out))
            else:
                (loss_fn(out, labels) / ACCUMULATION).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(argv=None):
    args, info, _, _ = start_ranks(__doc__.splitlines()[0], rounds=8, argv=argv)
    rank = info.rank
    model, data = mlp(), batch(GLOBAL_BATCH)
    runs, engines = {}, {}
    rows = {  # name -> baseline
        "hand 1F1B": None, "hand 1F1B, second copy (noise floor)": "hand 1F1B", "engine 1F1B": "hand 1F1B",
        "hand GPipe": None, "engine GPipe": "hand GPipe",
        ORDER_1F1B: "hand 1F1B", ORDER_GPIPE: "hand GPipe",
        f"hand 1F1B, {CLIPPED}": None, f"engine 1F1B, {CLIPPED}": f"hand 1F1B, {CLIPPED}",
        f"hand GPipe, {CLIPPED}": None, f"engine GPipe, {CLIPPED}": f"hand GPipe, {CLIPPED}"}
    runs["hand 1F1B"] = hand(copy.deepcopy(model), data, Schedule1F1B, rank)
    runs["hand 1F1B, second copy (noise floor)"] = hand(copy.deepcopy(model), data, Schedule1F1B, rank)
    runs["engine 1F1B"], engines["1f1b"] = engine_run(copy.deepcopy(model), data, "1f1b")
    runs["hand GPipe"] = hand(copy.deepcopy(model), data, ScheduleGPipe, rank)
    runs[ORDER_1F1B] = hand(copy.deepcopy(model), data, engine_order("1f1b"), rank)
    runs[ORDER_GPIPE] = hand(copy.deepcopy(model), data, engine_order("gpipe"), rank)
    runs["engine GPipe"], engines["gpipe"] = engine_run(copy.deepcopy(model), data, "gpipe")
    for name, schedule_class in (("1F1B", Schedule1F1B), ("GPipe", ScheduleGPipe)):
        runs[f"hand {name}, {CLIPPED}"] = hand(copy.deepcopy(model), data, schedule_class, rank, MAX_NORM)
        runs[f"engine {name}, {CLIPPED}"], _ = engine_run(copy.deepcopy(model), data, name.lower(), MAX_NORM)
    runs[BUSY] = stage_alone(copy.deepcopy(model), data, rank)  # timed among the others: the same noise
    times = interleaved(runs, args.rounds, args.steps, warmup=1, distributed=True)
    busy_seconds = times.pop(BUSY)
    bubble = {"busiest_stage_ms": busy_seconds * 1e3, "1f1b": 1 - busy_seconds / times["engine 1F1B"],
              "gpipe": 1 - busy_seconds / times["engine GPipe"],
              "theory": (2 - 1) / (ACCUMULATION + 2 - 1)}
    per_stage = {"sent_activation_bytes": _sent_bytes(), "held_bytes": held_bytes(engines["1f1b"].strategy)}
    stages = [None] * info.world_size
    dist.all_gather_object(stages, per_stage)
    if rank != 0:
        return
    print(f"{'variant':44s} {'ms/step':>8s} {'vs':>6s}  baseline")
    result = {}
    for name, baseline in rows.items():
        ratio = times[name] / times[baseline] if baseline else None
        result[name] = {"ms_per_step": times[name] * 1e3, "baseline": baseline, "ratio": ratio}
        print(f"{name:44s} {times[name] * 1e3:8.1f} {'' if ratio is None else f'{ratio:6.3f}':>6s}  {baseline or ''}")
    print(f"\nbusiest stage alone: {bubble['busiest_stage_ms']:.1f} ms; bubble 1F1B {bubble['1f1b']:.3f}, "
          f"GPipe {bubble['gpipe']:.3f} (theory (S - 1) / (A + S - 1) = {bubble['theory']:.3f})")
    print(f"{'stage':6s} {'sent MB':>8s} {'held MB':>8s}")
    for index, stage in enumerate(stages):
        print(f"{index + 1:<6d} {stage['sent_activation_bytes'] / 1e6:8.2f} {stage['held_bytes'] / 1e6:8.2f}")
    save(f"pipeline_w{info.world_size}", {
        "workload": f"MLP 4.2M params in 2 stages, global batch {GLOBAL_BATCH}, accumulation {ACCUMULATION}, AdamW "
                    f"fp32, 2 ranks gloo, {args.rounds} rounds x {args.steps} steps, median, slowest rank",
        "variants": result, "bubble": bubble, "stages": stages}, record=args.record)


def _sent_bytes() -> int:
    """Activations (stage 1 -> 2) or their gradients (stage 2 -> 1) of one step: A micro-batches of
    8 rows × 1024 fp32 values."""
    return ACCUMULATION * (GLOBAL_BATCH // ACCUMULATION) * 1024 * 4


if __name__ == "__main__":
    main()
