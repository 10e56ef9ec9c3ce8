"""Where a rank is in training, compared across ranks before a collective that must pair the same
window on every rank (``engine.window.machine.WindowMachine.agree`` says when): one all-gather of a few integers on
the control group; any difference raises ``RankDisagreementError`` on every rank, naming each
rank's position."""

from __future__ import annotations

from engine.distributed.collectives import PostedPositions, post_positions
from engine.errors import RankDisagreementError

WINDOW_START, FORWARD, CLOSING_MICRO_STEP, FLUSH, CLOSED = range(5)
_POINTS = {WINDOW_START: "starting a window", FORWARD: "before a forward",
           CLOSING_MICRO_STEP: "in the backward that closes its window", FLUSH: "in flush()",
           CLOSED: "closing the engine"}


def describe_position(position: list[int]) -> str:
    point, global_steps, started, micro_steps, forwards = position
    if point == CLOSED:
        return f"closing the engine after global step {global_steps} (its data ended?)"
    return (f"{_POINTS[point]}, after global step {global_steps}, window {started} begun on this rank, "
            f"{micro_steps} micro-step(s) done in it ({forwards} training forward(s))")


def post_position(rank: int, point: int, global_steps: int, windows_started: int, micro_steps: int,
                  training_forwards: int) -> PostedPosition:
    """Send this rank's position to every rank (one all-gather on the control group, in flight);
    ``confirm()`` on the result compares them."""
    mine = [point, global_steps, windows_started, micro_steps, training_forwards]
    return PostedPosition(post_positions(
        mine, f"rank {rank} {{waited}} while {describe_position(mine)}: {{cause}}; every rank must run the "
              "same windows and micro-steps"))


class PostedPosition:
    """This rank's position on its way to every rank (``post_position``)."""

    def __init__(self, posted: PostedPositions):
        self.posted, self.confirmed = posted, False

    def confirm(self) -> None:
        """Wait for every rank's position; raise ``RankDisagreementError`` (every rank alike) when
        they differ, ``PeerLostError`` when a peer never came. Once: later calls return at once."""
        if self.confirmed:
            return
        self.confirmed = True
        everyone = self.posted.wait()
        if all(position == everyone[0] for position in everyone):
            return
        ranks = "; ".join(f"rank {r}: {describe_position(p)}" for r, p in enumerate(everyone))
        held = sorted(p[3] for p in everyone)
        flushing = f"flush(): the ranks hold between {held[0]} and {held[-1]} micro-steps in this window; " \
            if all(p[0] == FLUSH for p in everyone) else ""
        raise RankDisagreementError(
            f"{flushing}the ranks are not at the same point of training ({ranks}): their collectives would pair "
            "different windows. Give every rank the same number of batches (eng.batches() does), and let a rank "
            "that fails in a window stop the run rather than go on with its next batch")
