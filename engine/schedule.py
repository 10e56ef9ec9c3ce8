"""A window as a schedule: the actions one rank runs for its micro-batches, in order, as data.

An action is ``(kind, k)``, micro-batch ``k`` (``-1`` where an action is the window's):

* ``FORWARD k``: a training forward; its output is kept until ``BACKWARD k``;
* ``BACKWARD k``: the weighted backward of that output, counted in the window;
* ``COUNT k``: a forward without gradients whose router counts the window learns before any backward;
* ``EXCHANGE``: the window's collective between what was counted or held and the backwards (the
  routers' counts over every micro-batch and data rank);
* ``EVALUATE k``: a forward whose loss is added to an evaluation's totals (no backward).

A schedule is made by a generator below; the window executor (``engine.window.executor``) runs any of
them, and a window's hooks (a mixture of experts' routers, ``engine.experts.window``) choose one. A
pipeline's stages run their micro-batches through ``torch.distributed.pipelining``'s own schedule
(GPipe, 1F1B, interleaved, zero-bubble), whose last stage hands each loss to the same executor.
"""

from __future__ import annotations

FORWARD, BACKWARD, COUNT, EXCHANGE, EVALUATE = "forward", "backward", "count", "exchange", "evaluate"
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
