"""Micro-batches by token budget (``micro_batch_tokens: N``) for variable-length sequences.

One window (one optimizer step) runs this rank's per-device batch. Instead of cutting it
into micro-batches of a fixed number of rows, its rows are grouped by length so that each
micro-batch's padded size — rows × its longest row — stays within N, and each micro-batch
is trimmed to its own longest row. With ``(sum, count)`` losses the window's gradient is
unchanged: trimming drops only padding, and the engine divides by the window's real count.
This holds when padding does not change the real tokens' outputs (causal models, or models
given the attention mask). This module is pure: no processes, no engine state.

Lengths. A row's length is its number of real tokens: from the user's
``lengths(batch) -> 1-D int tensor`` when given, else from the batch's attention mask (the
one tensor stored under a mapping key ``"attention_mask"``, shape [rows, T], 1 = real).

Padding. Right only (ones then zeros in every mask row; what a lengths function means): a
micro-batch keeps its first L columns, and a real token keeps its column, its position and
what it attends to. Left padding is refused with a message, not trimmed: the usual
next-token loss makes a left-padded row predict its first real token from padding, a term
that trimming the padding away would remove (and a model numbering positions from the
first column would see other positions), so the window could not equal the full batch.
Padding between real tokens is refused too.

Sequence-shaped tensors, trimmed along dim 1 (no other dim is ever trimmed):

* by default every tensor of shape [rows, T, ...], T being the attention mask's dim 1;
* with ``sequence_keys``, exactly the named tensors, plus the attention mask (trimming the
  rest but not the mask is never right). A name matches the tensors stored directly under
  that mapping key, at any depth; a path as ``SequenceLayout.describe`` prints it
  (``batch['inputs'][0]``) matches that one tensor. Name them when some [rows, T, ...]
  tensor is not a sequence, or when the batch has no attention mask (they then give T).

Every other tensor with a batch dimension is only row-selected; 0-dim tensors and other
leaves are passed through unchanged, as ``engine.batching.microbatch`` does.

Grouping. Rows are sorted by length, longest first (stable). The fewest micro-steps is
found greedily: each micro-batch takes rows while rows × its first (longest) row fits N
(and, when the rows are capped, while it holds at most ``max_rows``) — no grouping of any
kind needs fewer. A row longer than N runs alone, flagged for a warning.
For a given number of micro-steps the rows are then cut into consecutive runs of that order
(always as good as any other grouping) computing the fewest padded tokens.

One shape per window. A pipeline schedule runs micro-batches of one shape per step
(``engine.window.stages``), so there rows are not grouped by length: every micro-batch of
a window is cut to one bucket length (the longest row rounded up to 2^k × 1 or 1.5, at most
N when that row fits N: few distinct shapes, so few schedules) and holds
⌊N / length⌋ rows or fewer, the rows split evenly (:func:`group_uniformly`). Every rank runs
the same shape, the largest any rank needs: a schedule for a new shape infers its shapes by
running the stages, which gathers sharded stages' parameters, so all replicas build it at once.
Cutting at the bucket keeps a few columns of the batch's own padding, which the loss ignores
as it does in the full batch; a rank whose batch is padded to fewer columns than the shape
extends it with its own padding (:func:`padding_row`), which needs one row that is not full.

Equal micro-step counts. Every rank must run the same number k of micro-steps (ZeRO-3
gathers parameters in each): each rank proposes its fewest, the engine takes the maximum
over ranks, and every rank groups its rows into exactly k micro-batches. Cost model: a
micro-step costs a fixed overhead (launches, parameter gathers) plus work in proportion to
its padded tokens; k fixes the overheads, so only padded tokens are left to compare.
Splitting a micro-batch of two or more rows never adds padded tokens (both parts are
trimmed to their own longest row), while a zero-weight step adds a whole extra micro-batch
of work that counts for nothing. So rows are split while any micro-batch has two; only a
rank with fewer rows than k runs zero-weight steps (its shortest row again, weight 0).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.batching.microbatch import BatchError, batch_size, map_tensors, tensor_leaves

log = logging.getLogger("engine")

MASK_KEY = "attention_mask"

LengthsFn = Callable[[Any], Any]


class TokenBudgetError(BatchError):
    """The batch cannot be split by tokens: unreadable lengths, unclear sequence tensors,
    or a micro-step count the rows cannot fill."""


# -- which tensors are sequences, and how long each row is ------------------------------
@dataclass(frozen=True)
class SequenceLayout:
    """How a per-device batch is trimmed: each row's length and the tensors cut along dim 1."""

    lengths: tuple[int, ...]  # real tokens per row
    padded_length: int  # T, the batch's dim 1
    sequence_paths: tuple[str, ...]  # trimmed along dim 1 (and row-selected)
    other_paths: tuple[str, ...]  # only row-selected
    source: str  # where the lengths came from
    rule: str  # why these tensors are sequences

    def describe(self) -> str:
        """One line for the log: what is trimmed and why (log it once per run)."""
        others = f"; rows only: {', '.join(self.other_paths)}" if self.other_paths else ""
        return (f"micro_batch_tokens: lengths from {self.source} (right padding, padded length "
                f"{self.padded_length}); trimmed along dim 1 ({self.rule}): "
                f"{', '.join(self.sequence_paths)}{others}")


def sequence_layout(batch: Any, *, lengths: LengthsFn | None = None,
                    sequence_keys: Sequence[str] | None = None) -> SequenceLayout:
    """Read ``batch``'s row lengths and sequence tensors (see the module docstring)."""
    rows = batch_size(batch)
    leaves = [(path, t) for path, t in tensor_leaves(batch) if t.dim() > 0]
    masks = [(path, t) for path, t in leaves if _stored_under(path, MASK_KEY)]
    if len(masks) > 1 and (lengths is None or sequence_keys is None):
        raise TokenBudgetError(
            f"the batch holds {len(masks)} attention masks ({', '.join(p for p, _ in masks)}), so "
            "it is unclear which one gives the row lengths; pass a lengths(batch) function and "
            "sequence_keys naming the tensors to trim")
    mask_path, mask = masks[0] if len(masks) == 1 else (None, None)
    if mask is None and lengths is None:
        raise TokenBudgetError(
            "micro_batch_tokens needs each row's length: the batch has no 'attention_mask'; pass "
            "lengths(batch) -> 1-D int tensor, and sequence_keys naming the tensors to trim")

    if sequence_keys is None:
        if mask is None:
            raise TokenBudgetError(
                "without an attention_mask the tensors to trim cannot be told apart: set "
                "sequence_keys, e.g. ['input_ids', 'labels'] (paths: "
                f"{', '.join(p for p, _ in leaves)})")
        width = _check_mask_shape(mask_path, mask)
        sequence = [p for p, t in leaves if t.dim() >= 2 and t.shape[1] == width]
        rule = f"every [rows, {width}, ...] tensor; set sequence_keys to choose"
    else:
        sequence = _named_paths(leaves, sequence_keys, mask_path)
        width = _check_mask_shape(mask_path, mask) if mask is not None else None
        width = _check_sequence_widths(leaves, sequence, width)
        rule = "sequence_keys"

    found = _read_mask(mask_path, mask) if mask is not None else None
    source = mask_path
    if lengths is not None:
        given = _check_lengths(lengths(batch), rows, width)
        if found is not None:
            _check_covers_mask(given, found, mask_path)
        found, source = given, "the lengths function"
    return SequenceLayout(tuple(found), width, tuple(sequence),
                          tuple(p for p, _ in leaves if p not in sequence), source, rule)


def _stored_under(path: str, key: str) -> bool:
    return path.endswith(f"[{key!r}]")


def _check_mask_shape(path: str, mask: torch.Tensor) -> int:
    if mask.dim() != 2:
        raise TokenBudgetError(f"{path} has shape {tuple(mask.shape)}; micro_batch_tokens reads "
                               "a [rows, length] mask (1 = real token), or pass lengths(batch)")
    return mask.shape[1]


def _named_paths(leaves, names: Sequence[str], mask_path: str | None) -> list[str]:
    """The paths ``sequence_keys`` names, in batch order, plus the attention mask's."""
    if isinstance(names, str):
        raise TokenBudgetError(f"sequence_keys must be a list of names, got the string {names!r}")
    paths = [p for p, _ in leaves]
    for name in names:
        if not any(p == name or _stored_under(p, name) for p in paths):
            raise TokenBudgetError(f"sequence_keys names {name!r}, which is no tensor of the "
                                   f"batch; its tensors: {', '.join(paths)}")
    return [p for p in paths
            if p == mask_path or any(p == name or _stored_under(p, name) for name in names)]


def _check_sequence_widths(leaves, sequence: list[str], width: int | None) -> int:
    """T: the mask's dim 1, else the one dim 1 that every named tensor shares."""
    shapes = {p: tuple(t.shape) for p, t in leaves if p in sequence}
    widths = {shape[1] for shape in shapes.values() if len(shape) >= 2}
    expected = width if width is not None else (widths.pop() if len(widths) == 1 else None)
    wrong = {p: s for p, s in shapes.items() if len(s) < 2 or s[1] != expected}
    if wrong:
        listing = ", ".join(f"{p}: {list(s)}" for p, s in shapes.items())
        target = f"the attention mask's length {width}" if width is not None else "one length"
        raise TokenBudgetError(f"the tensors sequence_keys names must be [rows, T, ...] with T "
                               f"{target}; got {listing}")
    return expected


def _read_mask(path: str, mask: torch.Tensor) -> list[int]:
    """Real tokens per row of a right-padded mask; one transfer from the mask's device."""
    real = mask != 0
    counts, rises, falls, odd = torch.stack([
        real.sum(1),
        (real[:, 1:] & ~real[:, :-1]).any(1),  # a real token after padding: not right-padded
        (real[:, :-1] & ~real[:, 1:]).any(1),  # padding after a real token
        (real & (mask != 1)).any(1),
    ]).tolist()
    if any(odd):
        raise TokenBudgetError(f"{path} must hold 0 (padding) and 1 (real token); row "
                               f"{odd.index(True)} holds other values")
    if any(rises):
        row = rises.index(True)
        if falls[row]:
            raise TokenBudgetError(f"{path}: row {row} has padding between real tokens; "
                                   "micro_batch_tokens trims padding from the right end of rows")
        raise TokenBudgetError(
            f"{path}: row {row} is left-padded; micro_batch_tokens needs right padding "
            "(tokenizer.padding_side = 'right'): a left-padded row's next-token loss predicts its "
            "first real token from padding, a term that trimming would remove, so the update "
            "would no longer equal the full batch's")
    return counts


def _check_lengths(value: Any, rows: int, width: int) -> list[int]:
    lengths = torch.as_tensor(value)
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise TokenBudgetError(f"lengths(batch) must return integers; got dtype {lengths.dtype}")
    if tuple(lengths.shape) != (rows,):
        raise TokenBudgetError(f"lengths(batch) must return one length per row, shape [{rows}]; "
                               f"got shape {list(lengths.shape)}")
    found = lengths.tolist()
    outside = [(row, n) for row, n in enumerate(found) if not 0 <= n <= width]
    if outside:
        row, n = outside[0]
        raise TokenBudgetError(f"lengths(batch) gives row {row} {n} tokens; a length must be in "
                               f"0..{width}, the batch's padded length")
    return found


def _check_covers_mask(given: list[int], counted: list[int], path: str) -> None:
    short = [row for row, (g, c) in enumerate(zip(given, counted)) if g < c]
    if short:
        row = short[0]
        raise TokenBudgetError(f"lengths(batch) gives row {row} {given[row]} tokens but {path} marks "
                               f"{counted[row]} real ones; trimming would drop real tokens")


# -- grouping ------------------------------------------------------------------------------
@dataclass(frozen=True)
class MicroGroup:
    """One micro-batch of a window: which rows, trimmed to which length."""

    rows: tuple[int, ...]  # row indices into the per-device batch, longest first
    length: int  # its padded length: the longest row, at least 1 (no empty tensors)
    real_tokens: int  # 0 for a zero-weight step
    zero_weight: bool = False  # a repeat that only keeps the ranks' micro-step counts equal
    over_budget: bool = False  # a single row longer than the budget

    @property
    def padded_tokens(self) -> int:
        """Positions computed: rows × length."""
        return len(self.rows) * self.length

    @property
    def samples(self) -> int:
        """Rows that count towards the window (the weight of a mean loss)."""
        return 0 if self.zero_weight else len(self.rows)


def fewest_micro_steps(lengths: Sequence[int], budget: int, max_rows: int | None = None) -> int:
    """The fewest micro-batches within ``budget`` padded tokens and ``max_rows`` rows (a row
    longer than the budget runs alone): what this rank proposes before the ranks agree on
    the maximum."""
    widths = _widths(_longest_first(lengths, budget, max_rows), lengths)
    steps = start = 0
    while start < len(widths):
        start += max(1, min(budget // widths[start], max_rows or len(widths)))
        steps += 1
    return steps


def group_by_tokens(lengths: Sequence[int], budget: int, micro_steps: int | None = None,
                    max_rows: int | None = None) -> list[MicroGroup]:
    """``lengths``' rows in ``micro_steps`` micro-batches (default: the fewest) within
    ``budget`` padded tokens and at most ``max_rows`` rows each, computing the fewest padded
    tokens; zero-weight repeats at the end when there are fewer rows than micro-steps (see
    the module docstring)."""
    order = _longest_first(lengths, budget, max_rows)
    fewest = fewest_micro_steps(lengths, budget, max_rows)
    steps = fewest if micro_steps is None else micro_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < fewest:
        cap = f" and {max_rows} rows" if max_rows else ""
        raise TokenBudgetError(f"micro_steps must be an integer >= {fewest}, the fewest that fit "
                               f"{len(order)} rows in micro_batch_tokens {budget}{cap}; got {steps!r}")
    widths = _widths(order, lengths)
    real = min(steps, len(order))
    cuts = _cheapest_cuts(widths, budget, real, max_rows) + [len(order)]
    groups = [MicroGroup(tuple(order[a:b]), widths[a], sum(lengths[r] for r in order[a:b]),
                         over_budget=widths[a] > budget) for a, b in zip(cuts, cuts[1:])]
    repeat = MicroGroup((order[-1],), widths[-1], 0, zero_weight=True)
    return groups + [repeat] * (steps - real)


def _longest_first(lengths: Sequence[int], budget: int, max_rows: int | None) -> list[int]:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise TokenBudgetError(f"micro_batch_tokens must be a positive integer, got {budget!r}")
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1):
        raise TokenBudgetError(f"the rows per micro-batch must be capped by a positive integer, got {max_rows!r}")
    if not lengths:
        raise TokenBudgetError("micro_batch_tokens cannot group an empty batch; every rank needs "
                               "at least one row")
    return sorted(range(len(lengths)), key=lambda row: -lengths[row])


def _widths(order: list[int], lengths: Sequence[int]) -> list[int]:
    # An all-padding row still occupies one position: micro-batch tensors are never empty.
    return [max(1, lengths[row]) for row in order]


def _cheapest_cuts(widths: list[int], budget: int, parts: int, max_rows: int | None) -> list[int]:
    """Where each of ``parts`` consecutive groups of ``widths`` (longest first) starts, for
    the fewest padded tokens within ``budget`` and ``max_rows``; among equals, the most even
    sizes (least sum of squared padded sizes), since a small micro-batch uses an accelerator
    poorly.

    Dynamic programming over prefixes, adding one group per pass: each pass takes, for
    every end, the minimum over all starts at once: O(parts · rows²) elementwise work, on
    one CPU core about 5 ms for 256 rows in 16 micro-steps, 0.5 s for 1024 rows in 64.
    Float64 is exact for token counts below 2**53."""
    n = len(widths)
    edges = torch.arange(n + 1, dtype=torch.float64)
    rows = edges[None, 1:] - edges[:-1, None]  # [start, end - 1] -> rows of start..end-1
    padded = rows * torch.tensor(widths, dtype=torch.float64)[:, None]
    padded = padded.masked_fill((rows < 1) | ((rows > 1) & (padded > budget)) | (rows > (max_rows or n)), math.inf)
    padded_squared = padded.square()
    inf = torch.full((1,), math.inf, dtype=torch.float64)
    tokens = torch.cat([torch.zeros(1, dtype=torch.float64), inf.expand(n)])  # best per prefix
    squares = tokens.clone()
    starts = []
    for _ in range(parts):
        candidates = tokens[:-1, None] + padded
        best = candidates.amin(0)
        even = torch.where(candidates == best, squares[:-1, None] + padded_squared, inf)
        start = even.argmin(0)
        starts.append(start)
        tokens = torch.cat([inf, best])
        squares = torch.cat([inf, even.gather(0, start[None])[0]])
    cuts, end = [], n
    for start in reversed(starts):
        end = int(start[end - 1])
        cuts.append(end)
    return cuts[::-1]


# -- one shape per window (a pipeline schedule) -------------------------------------------
def bucket_length(longest: int, budget: int, cap: int | None = None) -> int:
    """The length every micro-batch of a window is cut to when they must share one shape: the
    longest row rounded up to the ladder 2^k × (1, 1.5) (at most half more columns, and two
    lengths per octave, so few schedules); at most ``cap`` (a batch that cannot be extended:
    every row full) and at most the budget when the longest row fits it (rounding never
    pushes a micro-batch over N)."""
    longest = max(1, longest)
    step = 1 << max(0, (longest - 1).bit_length() - 2)
    bucket = -(-longest // step) * step
    if cap is not None:
        bucket = min(bucket, max(cap, longest))
    return min(bucket, budget) if longest <= budget else bucket


def one_shape_micro_steps(rows: int, length: int, budget: int, max_rows: int | None = None) -> int:
    """The fewest micro-batches of ``length`` columns that hold ``rows`` rows within ``budget``
    padded tokens and ``max_rows`` rows (one row each when a row alone exceeds the budget)."""
    _longest_first([length], budget, max_rows)  # checks the budget and the cap
    return -(-rows // max(1, min(budget // length, max_rows or rows)))


def group_uniformly(lengths: Sequence[int], length: int, budget: int, micro_steps: int) -> list[MicroGroup]:
    """``lengths``' rows, in row order, in ``micro_steps`` micro-batches cut to ``length``
    columns that differ by at most one row; zero-weight repeats of the last row when there
    are fewer rows than micro-steps. For a schedule of one shape per step."""
    _longest_first(lengths, budget, None)  # checks the budget and the rows
    if length < max(lengths):
        raise TokenBudgetError(f"micro-batches of {length} columns would cut rows of {max(lengths)} tokens")
    if isinstance(micro_steps, bool) or not isinstance(micro_steps, int) or micro_steps < 1:
        raise TokenBudgetError(f"micro_steps must be a positive integer; got {micro_steps!r}")
    real = min(micro_steps, len(lengths))
    base, extra = divmod(len(lengths), real)
    groups, start = [], 0
    for k in range(real):
        rows = tuple(range(start, start + base + (k < extra)))
        start += len(rows)
        groups.append(MicroGroup(rows, length, sum(lengths[r] for r in rows),
                                 over_budget=len(rows) == 1 and length > budget))
    repeat = MicroGroup((len(lengths) - 1,), length, 0, zero_weight=True)
    return groups + [repeat] * (micro_steps - real)


def over_budget_message(groups: Sequence[MicroGroup], budget: int) -> str | None:
    """A warning for the log when some rows are longer than the budget, else None."""
    long = [g for g in groups if g.over_budget]
    if not long:
        return None
    listing = ", ".join(f"row {g.rows[0]} ({g.length} tokens)" for g in long)
    return (f"{listing} exceed micro_batch_tokens {budget}: each runs alone as a micro-batch of "
            f"its own length, which may not fit in memory; raise micro_batch_tokens to "
            f"{max(g.length for g in long)} or truncate such sequences")


def smaller_budget(groups: Sequence[MicroGroup]) -> int:
    """The budget to try after ``groups`` ran out of memory: half the largest micro-batch of
    two or more rows (halving a budget above it would change nothing); 0 when every
    micro-batch holds one row, which no budget can make smaller."""
    shared = [g.padded_tokens for g in groups if len(g.rows) > 1 and not g.zero_weight]
    return max(shared, default=0) // 2


def budget_candidates(start: int, longest: int) -> list[int]:
    """Token budgets ``explore`` measures, ascending: ``start`` halved while it still holds
    the ``longest`` row (a smaller budget leaves such rows over it), ``start`` itself always."""
    budgets = [start]
    while budgets[-1] // 2 >= max(longest, 1):
        budgets.append(budgets[-1] // 2)
    return budgets[::-1]


class TokenSplitter:
    """Reads and groups one engine's per-device batches by tokens: the user's ``lengths``
    function and ``sequence_keys``, and the log lines shown once per run (what is trimmed,
    and rows over the budget)."""

    def __init__(self, lengths: LengthsFn | None = None, sequence_keys: Sequence[str] | None = None,
                 length_multiple: int = 1):
        self.lengths = lengths
        self.sequence_keys = sequence_keys
        # Context parallelism cuts every sequence into 2 × context equal chunks: a micro-batch's
        # length is rounded up to that multiple (within the batch's own padding).
        self.length_multiple = length_multiple
        self._described = self._warned = False

    def layout(self, batch: Any) -> SequenceLayout:
        """``batch``'s row lengths and sequence tensors."""
        return sequence_layout(batch, lengths=self.lengths, sequence_keys=self.sequence_keys)

    def read(self, batch: Any, budget: int, max_rows: int | None = None) -> tuple[SequenceLayout, int]:
        """``batch``'s layout and its fewest micro-steps (this rank's proposal)."""
        layout = self.layout(batch)
        return layout, fewest_micro_steps(self._widths(layout), budget, max_rows)

    def group(self, layout: SequenceLayout, budget: int, micro_steps: int,
              max_rows: int | None = None) -> list[MicroGroup]:
        """The layout's rows in the ``micro_steps`` the ranks agreed on."""
        groups = group_by_tokens(self._widths(layout), budget, micro_steps, max_rows)
        if self.length_multiple > 1:  # grouped by rounded widths; the real tokens are the rows' own
            groups = [group if group.zero_weight else
                      replace(group, real_tokens=sum(layout.lengths[row] for row in group.rows)) for group in groups]
        return self.logged(layout, groups, budget)

    def _widths(self, layout: SequenceLayout) -> list[int]:
        """The columns each row needs: its length, rounded up to ``length_multiple`` within the
        batch's padded length."""
        multiple = self.length_multiple
        if multiple == 1:
            return list(layout.lengths)
        return [min(-(-length // multiple) * multiple, layout.padded_length) for length in layout.lengths]

    def logged(self, layout: SequenceLayout, groups: list[MicroGroup], budget: int) -> list[MicroGroup]:
        """``groups``, after the run's first layout and its first rows over the budget are logged."""
        if not self._described:
            self._described = True
            log.info("%s", layout.describe())
        message = over_budget_message(groups, budget)
        if message and not self._warned:
            self._warned = True
            log.warning("%s (shown once)", message)
        return groups


# -- building a micro-batch ----------------------------------------------------------------
def take_rows(batch: Any, layout: SequenceLayout, group: MicroGroup) -> Any:
    """``group``'s micro-batch of ``batch``: the group's rows, in its order, of every tensor
    with a batch dimension, sequence tensors cut to their first ``group.length`` columns (or,
    longer than the batch, extended by :func:`padding_row`'s last column); mappings and
    sequences keep their types (e.g. a ``BatchEncoding``)."""
    indices: dict[torch.device, torch.Tensor] = {}
    extend = group.length - layout.padded_length
    source = padding_row(layout) if extend > 0 else None

    def take(path: str, tensor: torch.Tensor):
        if tensor.dim() == 0:
            return tensor
        if path in layout.sequence_paths:
            if extend > 0:
                pad = tensor[source:source + 1, -1:]
                tensor = torch.cat([tensor, pad.expand(tensor.shape[0], extend, *pad.shape[2:])], 1)
            else:
                tensor = tensor[:, :group.length]  # a view: the copy below moves only what is kept
        if tensor.device not in indices:
            indices[tensor.device] = torch.tensor(group.rows, device=tensor.device)
        return tensor.index_select(0, indices[tensor.device])

    return map_tensors(batch, take)


def padding_row(layout: SequenceLayout) -> int | None:
    """A row whose last column is padding (shorter than the batch's padded length): what its
    last column holds in each sequence tensor is that tensor's padding (pad id, mask 0, the
    ignored label), which extends the batch to a longer length. None when every row is full."""
    return next((row for row, n in enumerate(layout.lengths) if n < layout.padded_length), None)


# -- cost, for the window report ----------------------------------------------------------
@dataclass(frozen=True)
class TokenCost:
    """What a window's micro-batches compute."""

    micro_steps: int
    real_tokens: int
    padded_tokens: int  # positions computed, padding included


def token_cost(groups: Sequence[MicroGroup]) -> TokenCost:
    """Totals of ``groups`` (e.g. for the window report: padded vs real tokens)."""
    return TokenCost(len(groups), sum(g.real_tokens for g in groups), sum(g.padded_tokens for g in groups))


def one_shape_cost(groups: Sequence[MicroGroup], rows: int) -> TokenCost:
    """Totals of ``groups`` run as micro-batches of ``rows`` rows each (padded with copies of
    their own rows) at their common length."""
    return TokenCost(len(groups), sum(g.real_tokens for g in groups), len(groups) * rows * groups[0].length)
