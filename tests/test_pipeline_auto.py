"""The automatic micro size under a pipeline: an out-of-memory injected on one stage (one
rank) in its forward or backward, inside the schedule, makes every rank of the pipeline ×
data mesh discard the window, halve the micro size (A doubles, the global batch stays) and
re-run the same batch through a schedule built for the new number of micro-batches. No rank
waits for another (the failed stage stands in for the rest of the schedule), and the final
parameters equal the float64 full-batch reference. The broken variant that keeps the failed
attempt's gradients misses it."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import engine
from engine.errors import ConfigError
from tests import broken
from tests.dist_utils import run_scenarios
from tests.oom_models import Tripwire
from tests.reference import max_param_diff, regression_batches, sgd, state
from tests.test_pipeline import data_share, mse_outputs, reference_mse, reference_run

TOL = 1e-10
MISSED = 1e-4
# where stages 2.. start: the Tripwires (parts 2 and 5) on rank 0's and rank 1's side, each
# schedule (interleaved: four stages, rank 0 holding the first and third)
SPLITS = {"interleaved": ["2", "3", "5"]}


def tripped_mlp(stage: int, **tripwire) -> torch.nn.Sequential:
    """tests.reference.mlp's layers cut in two at part "3", a Tripwire on ``stage``'s side."""
    torch.manual_seed(0)
    wires = [Tripwire(), Tripwire()]
    wires[stage] = Tripwire(**tripwire)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), wires[0],
                               torch.nn.Linear(16, 16), torch.nn.Tanh(), wires[1],
                               torch.nn.Linear(16, 3)).double()


def auto_pipeline(rank, world, *, stage, where="forward", schedule="1f1b", trip_ranks=None, after_calls=0,
                  breaks="intact"):
    """Per-device batch 8: auto starts at 8 (A = 1, which 1F1B over 2 ranks cannot run: 4),
    out of memory above 2 on ``trip_ranks``: 4 -> 2, A = 4; three windows."""
    data_ranks = world // 2
    global_batch = 8 * data_ranks
    model = tripped_mlp(stage, max_micro=2, ranks=trip_ranks, where=where, after_calls=after_calls)
    batches = regression_batches(3, global_batch)
    expected, _ = reference_run(tripped_mlp(stage), batches, reference_mse, 0.0)  # the same weights, no trip
    settings = {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": "auto",
                "pipeline": {"stages": 2, "schedule": schedule, "split": SPLITS.get(schedule, ["3"])},
                "distributed": {"agreement_timeout_seconds": 60}}
    eng = getattr(broken, breaks)(engine.initialize(copy.deepcopy(model), settings, optimizer=sgd))
    for batch in batches:
        eng.train_batch(data_share(batch, eng), mse_outputs)
    result = {"diff": max_param_diff(eng.full_state_dict(), state(expected)),
              "plan": (eng.plan.train_micro_batch_size_per_gpu, eng.plan.gradient_accumulation_steps,
                       eng.plan.train_batch_size),
              "changes": [(c["old"], c["new"], c["ranks"]) for c in eng.micro_batch_tuner.changes],
              "counters": (eng.global_steps, eng.micro_steps, eng.global_samples),
              "stage": eng.strategy.position}
    eng.close()
    return result
