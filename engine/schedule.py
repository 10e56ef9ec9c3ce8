"""A window as a schedule: the actions one rank runs for its micro-batches, in order, as data.

An action is ``(kind, k)``, micro-batch ``k`` (``-1`` where an action is the window's):

* ``FORWARD k``: a training forward; its output is kept until ``BACKWARD k``;
* ``BACKWARD k``: the weighted backward of that output, counted in the window;
* ``COUNT k``: a forward without gradients whose router counts the window learns before any backward;
* ``EXCHANGE``: the window's collective between what was counted or held and the backwards (the
  routers' counts over every micro-batch and data rank);
* ``EVALUATE k``: a forward whose loss is added to an evaluation's totals (no backward);
* ``STAGES``: under a pipeline, every micro-batch of the window through this rank's stages in their
  order (one of the stage orders below), the last stage's losses weighed as ``BACKWARD``'s are;
  ``COUNT_STAGES`` and ``EVALUATE_STAGES`` run the same order's forwards alone, to count or evaluate.

A schedule is made by a generator below; the window executor (``engine.window.executor``) runs any of
them, and a window's hooks (a mixture of experts' routers, ``engine.experts.window``) choose one.

A pipeline's schedules (GPipe, 1F1B, interleaved, zero-bubble V) are data too: one list of stage actions
per pipeline rank, below. ``torch.distributed.pipelining``'s runtime runs them with the sends and
receives their order implies (``engine.adapters.pipelining.ActionSchedule``), its last stage handing
each loss to the window machine. They are the orders torch's own schedule classes run
(tests/unit/test_schedule.py compares GPipe, interleaved and zero-bubble with torch's descriptions of
them, and simulates every order); a new one is a generator here.
"""

from __future__ import annotations

from typing import NamedTuple

FORWARD, BACKWARD, COUNT, EXCHANGE, EVALUATE = "forward", "backward", "count", "exchange", "evaluate"
STAGES, COUNT_STAGES, EVALUATE_STAGES = "stages", "count_stages", "evaluate_stages"
WINDOW = -1  # the micro-batch index of an action that is the window's

Action = tuple[str, int]


def one_after_another(micro_batches: int) -> list[Action]:
    """Each micro-batch's forward, then its backward: one micro-batch's activations alive at a time."""
    return [action for k in range(micro_batches) for action in ((FORWARD, k), (BACKWARD, k))]


def counted_first(micro_batches: int) -> list[Action]:
    """Every micro-batch counted without gradients, the counts exchanged, then one after another."""
    return [(COUNT, k) for k in range(micro_batches)] + [(EXCHANGE, WINDOW)] + one_after_another(micro_batches)


def held_forwards(micro_batches: int) -> list[Action]:
    """Every forward first (their graphs held), the counts exchanged, then every backward."""
    return ([(FORWARD, k) for k in range(micro_batches)] + [(EXCHANGE, WINDOW)]
            + [(BACKWARD, k) for k in range(micro_batches)])


def forwards_only(micro_batches: int) -> list[Action]:
    """An evaluation: each micro-batch's forward, its loss added to the totals."""
    return [(EVALUATE, k) for k in range(micro_batches)]


def through_stages(micro_batches: int) -> list[Action]:
    """A pipeline window: its micro-batches through the stages' order. Held forwards (an order whose
    forwards all come first: GPipe) exchange their counts inside it, at the first gradient's receive."""
    return [(STAGES, WINDOW)]


def counted_through_stages(micro_batches: int) -> list[Action]:
    """A pipeline window whose routers are counted first: the order's forwards without gradients, the
    counts exchanged, then the order."""
    return [(COUNT_STAGES, WINDOW), (EXCHANGE, WINDOW), (STAGES, WINDOW)]


def evaluated_through_stages(micro_batches: int) -> list[Action]:
    """A pipeline's evaluation: the stages' order's forwards alone, the last stage's losses added up."""
    return [(EVALUATE_STAGES, WINDOW)]


# -- a pipeline's stages ------------------------------------------------------------------------------
# A pipeline window is one list of actions per pipeline rank, each on one of the stages that rank holds:
# ``StageAction(stage, kind, k)``. Backwards are whole (``BACKWARD``), or split (zero-bubble) into the
# gradient for the stage's inputs (``INPUT_GRADIENT``, which the previous stage waits for) and the one
# for its weights (``WEIGHT_GRADIENT``, which fills a gap later). ``engine.strategies.stage_schedules``
# runs them; the sends and receives between ranks follow from the order.
INPUT_GRADIENT, WEIGHT_GRADIENT = "input_gradient", "weight_gradient"


class StageAction(NamedTuple):
    stage: int
    kind: str
    k: int


def gpipe(ranks: int, micro_batches: int) -> dict[int, list[StageAction]]:
    """Every forward, then every backward, on each rank's one stage (the stage is the rank)."""
    return {rank: [StageAction(rank, FORWARD, k) for k in range(micro_batches)]
            + [StageAction(rank, BACKWARD, k) for k in range(micro_batches)] for rank in range(ranks)}


def one_f_one_b(ranks: int, micro_batches: int) -> dict[int, list[StageAction]]:
    """Rank r, ``ranks - 1 - r`` places before the last, starts with that many forwards, then alternates a
    forward and the oldest backward, then finishes the backwards: at most ``ranks - r`` micro-batches'
    activations held at once."""
    order = {}
    for rank in range(ranks):
        ahead = min(ranks - 1 - rank, micro_batches)
        actions = [StageAction(rank, FORWARD, k) for k in range(ahead)]
        for k in range(micro_batches - ahead):
            actions += [StageAction(rank, FORWARD, ahead + k), StageAction(rank, BACKWARD, k)]
        actions += [StageAction(rank, BACKWARD, k) for k in range(micro_batches - ahead, micro_batches)]
        order[rank] = actions
    return order


def interleaved(ranks: int, micro_batches: int, stages_per_rank: int = 2) -> dict[int, list[StageAction]]:
    """Interleaved 1F1B (Narayanan et al. 2021): rank r holds stages r, r + ranks, ... (the model loops
    over the ranks). Micro-batches go in rounds of ``micro_batches / ⌊micro_batches / ranks⌋``: a rank
    runs one round's forwards on one of its stages, then the next round on its next stage. It starts
    with as many forwards as the stages after it need to fill (two per rank below the last, plus a
    round per further stage it holds), then pairs each forward with the oldest ready backward (its
    stages in reverse), then finishes the backwards."""
    per_round = micro_batches // max(1, micro_batches // ranks)
    runs = micro_batches * stages_per_rank  # forwards (and backwards) on this rank
    order = {}
    for rank in range(ranks):
        ahead = min((stages_per_rank - 1) * per_round + 2 * (ranks - 1 - rank), runs)

        def stage_of(run: int) -> int:  # the stage of this rank's run-th forward (or backward)
            return (run // per_round) % stages_per_rank * ranks + rank

        forwards, backwards = _counter(), _counter()
        actions = [StageAction(stage, FORWARD, forwards(stage)) for stage in map(stage_of, range(ahead))]
        for run in range(ahead, runs):
            forward = stage_of(run)
            backward = (stages_per_rank - 1 - stage_of(run - ahead) // ranks) * ranks + rank
            actions += [StageAction(forward, FORWARD, forwards(forward)),
                        StageAction(backward, BACKWARD, backwards(backward))]
        for run in range(runs - ahead, runs):
            backward = (stages_per_rank - 1 - stage_of(run) // ranks) * ranks + rank
            actions.append(StageAction(backward, BACKWARD, backwards(backward)))
        order[rank] = actions
    return order


def zero_bubble_v(ranks: int, micro_batches: int) -> dict[int, list[StageAction]]:
    """Zero-bubble V (Qi et al. 2024): rank r holds stage r on the way down and stage 2·ranks − 1 − r on
    the way back up. Each backward is split: the input gradient first (what the stage before waits for),
    the weight gradient where the rank would otherwise wait. Phases per rank: forwards down to fill the
    V, alternating with forwards up where the V has turned, then each forward up followed at once by its
    backward (the turn of the V); a steady phase of (forward down, backward down, forward up, backward
    up); then the remaining input gradients, their weight gradients last."""
    order = {}
    for rank in range(ranks):
        down, up = rank, 2 * ranks - 1 - rank
        # planned for the micro-batches that fill the V, those past the window then dropped
        planned = max(2 * ranks - 1, micro_batches)
        counts = {(stage, kind): 0 for stage in (down, up) for kind in (FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT)}
        actions: list[StageAction] = []

        def run(stage: int, *kinds: str) -> None:
            for kind in kinds:
                actions.append(StageAction(stage, kind, counts[stage, kind]))
                counts[stage, kind] += 1

        for _ in range(2 * (ranks - rank) - 1):
            run(down, FORWARD)
        for _ in range(rank):
            run(up, FORWARD)
            run(down, FORWARD)
        for _ in range(ranks - rank):
            run(up, FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT)
        while counts[up, FORWARD] < counts[down, FORWARD] or counts[down, FORWARD] < planned:
            if counts[down, FORWARD] < planned:
                run(down, FORWARD)
            run(down, INPUT_GRADIENT, WEIGHT_GRADIENT)
            run(up, FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT)
        # the next weight gradient of each stage: the cool-down runs input gradients ahead of them
        weights = {stage: counts[stage, INPUT_GRADIENT] for stage in (down, up)}
        for _ in range(rank):
            run(down, INPUT_GRADIENT)
            run(up, INPUT_GRADIENT)
        for _ in range(ranks - rank):
            run(down, INPUT_GRADIENT)
            actions.append(StageAction(down, WEIGHT_GRADIENT, weights[down]))
            weights[down] += 1
        for stage in (up, down):
            actions += [StageAction(stage, WEIGHT_GRADIENT, k)
                        for k in range(weights[stage], counts[stage, INPUT_GRADIENT])]
        order[rank] = [action for action in actions if action.k < micro_batches]
    return order


def _counter():
    """A function that numbers its calls per key: 0, 1, 2, ... for each stage."""
    counts: dict[int, int] = {}

    def next_of(key: int) -> int:
        counts[key] = counts.get(key, 0) + 1
        return counts[key] - 1
    return next_of


def forwards_first(order: dict[int, list[StageAction]]) -> bool:
    """Whether every rank runs every forward of the window before its first backward (GPipe)."""
    return all(max(i for i, action in enumerate(actions) if action.kind == FORWARD)
               < min(i for i, action in enumerate(actions) if action.kind != FORWARD) for actions in order.values())


def splits_backward(order: dict[int, list[StageAction]]) -> bool:
    """Whether the order splits backwards into input and weight gradients (zero-bubble)."""
    return any(action.kind == INPUT_GRADIENT for actions in order.values() for action in actions)
