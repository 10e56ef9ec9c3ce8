"""Packing (``packing: true`` with ``micro_batch_tokens: N``): each micro-batch's documents end to
end in one row, no padding. This module is pure: no processes, no engine state.

A document is one row's real tokens (its length as ``engine.batching.token_budget`` reads it:
the attention mask, right padding, or the user's ``lengths``). A window's documents are grouped
into micro-batches of at most N real tokens (first-fit decreasing: each document, longest first,
goes into the first micro-batch it fits), and each micro-batch is **one row** of its documents'
tokens end to end, shape ``[1, L]`` with ``L <= N``: no padding at all, and the budget is exactly
the tokens the model computes. (Rows of a fixed width would have to pad the last row of every
micro-batch, and several rows per micro-batch would bring padding back; one row of at most N
keeps every micro-batch exact and the input shape ``[1, L]`` that padding-free kernels take.)

In the packed row

* every sequence tensor (``SequenceLayout.sequence_paths``) holds the documents' real tokens one
  after the other; the attention mask is dropped (no ``attention_mask`` key);
* ``position_ids`` restart at 0 at each document (the batch's own ``position_ids`` when it gives
  them, packed like any sequence tensor): a Hugging Face model then masks attention per document
  (the engine runs rows carrying ``position_ids`` without the key/value cache);
* for a model that shifts its targets (causal language models, and any model the engine cannot
  read), ``labels`` are -100 at each document's first token (``shift_labels``: at its last), so no
  target crosses a seam: with the model's shift, the packed row's targets are exactly the padded
  rows'; a model whose targets are its tokens' own (token classification on a causal model) keeps
  every label (:func:`no_seams`). Which one, and whether a model can be packed at all (a model that
  attends in both directions cannot: its documents would see each other), is the engine's
  decision from the model (``engine.window.model_loss.packing_seams``).

A micro-batch counts its documents as samples, the window's real tokens and rows are those of
the padded batch: the update equals the padded batch's for ``(sum, count)`` losses and the
model's own loss. A document longer than N runs alone as its own micro-batch (flagged, with the
token budget's warning): splitting it would cut its attention, so it is never split.

Equal micro-step counts. Every rank proposes its fewest micro-batches; with the agreed maximum k
a rank splits its fullest micro-batch of two or more documents (into two balanced halves) until
it has k, then repeats its shortest document with weight 0, as ``token_budget`` does.

Requirements, checked before the ranks agree (:func:`packable_layout`): the batch is a mapping
whose sequence tensors sit at its top level, it carries integer ``labels`` (or ``shift_labels``)
among them, and no tensor has rows but no sequence dimension (a per-row tensor has no place in
one packed row).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.batching.microbatch import rebuild_mapping
from engine.batching.token_budget import MASK_KEY, MicroGroup, SequenceLayout, TokenBudgetError

IGNORED = -100  # transformers' ignore_index
POSITIONS_KEY = "position_ids"


@dataclass(frozen=True)
class PackedGroup(MicroGroup):
    """One packed micro-batch: its documents (rows of the padded batch, longest first) in one row
    of ``length`` columns (their real tokens; an empty document keeps one column)."""

    @property
    def padded_tokens(self) -> int:
        """Positions computed: the one row's columns."""
        return self.length


# -- grouping ------------------------------------------------------------------------------
def _widths(lengths: Sequence[int]) -> list[int]:
    # An empty document still occupies one column (its padding, label -100): tensors are never empty.
    return [max(1, n) for n in lengths]


def _first_fit(lengths: Sequence[int], budget: int, max_rows: int | None) -> list[list[int]]:
    """Documents' rows in micro-batches of at most ``budget`` tokens and ``max_rows`` documents,
    first-fit decreasing; a document over the budget alone."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise TokenBudgetError(f"micro_batch_tokens must be a positive integer, got {budget!r}")
    if not lengths:
        raise TokenBudgetError("packing cannot group an empty batch; every rank needs at least one row")
    widths = _widths(lengths)
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(range(len(widths)), key=lambda r: -widths[r]):
        for k, load in enumerate(loads):
            if load + widths[row] <= budget and len(bins[k]) < (max_rows or len(widths)):
                bins[k].append(row)
                loads[k] += widths[row]
                break
        else:
            bins.append([row])
            loads.append(widths[row])
    return bins


def fewest_packed_steps(lengths: Sequence[int], budget: int, max_rows: int | None = None) -> int:
    """This rank's proposal: how many packed micro-batches its documents need."""
    return len(_first_fit(lengths, budget, max_rows))


def group_packed(lengths: Sequence[int], budget: int, micro_steps: int | None = None,
                 max_rows: int | None = None) -> list[PackedGroup]:
    """``lengths``' documents in exactly ``micro_steps`` packed micro-batches (default: the fewest)."""
    bins = _first_fit(lengths, budget, max_rows)
    steps = len(bins) if micro_steps is None else micro_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < len(bins):
        raise TokenBudgetError(f"micro_steps must be an integer >= {len(bins)}, the fewest packed micro-batches of "
                               f"at most {budget} tokens for {len(lengths)} documents; got {steps!r}")
    widths = _widths(lengths)
    load = lambda rows: sum(widths[r] for r in rows)  # noqa: E731
    while len(bins) < steps:
        shared = [b for b in bins if len(b) > 1]
        if not shared:
            break
        fullest = max(shared, key=load)
        halves: tuple[list[int], list[int]] = ([], [])
        for row in fullest:  # longest first, each into the lighter half
            min(halves, key=load).append(row)
        bins[bins.index(fullest)] = halves[0]
        bins.append(halves[1])
    groups = [PackedGroup(tuple(rows), load(rows), sum(lengths[r] for r in rows),
                          over_budget=load(rows) > budget) for rows in bins]
    shortest = min(range(len(lengths)), key=lambda r: (lengths[r], -r))
    repeat = PackedGroup((shortest,), widths[shortest], 0, zero_weight=True)
    return groups + [repeat] * (steps - len(groups))


# -- building a packed micro-batch ------------------------------------------------------------
def packable_layout(batch: Any, read: Callable[[Any], SequenceLayout]) -> SequenceLayout:
    """``batch``'s layout (``read(batch)``); refuses, before the ranks agree, a batch that cannot be
    packed (see the module docstring)."""
    if not isinstance(batch, Mapping):
        raise TokenBudgetError(f"packing: true needs a mapping batch (input_ids, labels, ... as keyword arguments of "
                               f"the model); got a {type(batch).__name__}")
    layout = read(batch)
    top = {f"batch[{key!r}]": key for key in batch}
    nested = [p for p in layout.sequence_paths if p not in top]
    if nested:
        raise TokenBudgetError(f"packing: true packs the batch's top-level sequence tensors; {', '.join(nested)} is "
                               "nested: give the model's inputs as the batch's own keys")
    rows_only = [p for p in layout.other_paths]
    misaligned = [key for key in ("labels", "shift_labels") if f"batch[{key!r}]" in rows_only
                  and isinstance(batch[key], torch.Tensor) and batch[key].dim() == 2]
    if misaligned and layout.sequence_paths:
        key = misaligned[0]
        raise TokenBudgetError(
            f"packing: true puts each document's tokens and labels side by side in one row, but batch[{key!r}] has "
            f"{batch[key].shape[1]} columns where the inputs have {batch[top[layout.sequence_paths[0]]].shape[1]}: "
            "labels of another length than the inputs (an encoder-decoder's targets) have no place in the inputs' "
            "packed row; set packing: false (micro_batch_tokens still forms micro-batches by tokens)")
    if rows_only:
        raise TokenBudgetError(f"packing: true puts a micro-batch's documents in one row, so a tensor with rows but no "
                               f"sequence dimension has no place: {', '.join(rows_only)}; drop it, or name it in "
                               "sequence_keys if it is a sequence")
    labels = [top[p] for p in layout.sequence_paths if top[p] in ("labels", "shift_labels")]
    if not labels or any(batch[key].is_floating_point() or batch[key].dim() != 2 for key in labels):
        raise TokenBudgetError(
            "packing: true needs the batch's token labels under 'labels' (Hugging Face's convention: the model shifts "
            "them; or 'shift_labels', already shifted), integer [rows, length], among the tensors it packs: the engine "
            "marks each document's first target -100 so that no target crosses a seam between documents")
    return layout


def document_positions(columns: torch.Tensor) -> torch.Tensor:
    """``position_ids`` of the packed row: each token's column in its padded row, restarting at 0
    with each document (right padding)."""
    return columns


def mark_seams(labels: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, shifted: bool) -> torch.Tensor:
    """``labels`` of the packed row with no target across a seam: -100 at each document's first
    token (``shift_labels``, already shifted: at its last)."""
    return labels.masked_fill(ends if shifted else starts, IGNORED)


def seams_of_shifted_targets(key: str, labels: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """A model that shifts its targets (causal language models): the packed row's ``labels`` with no
    target across a seam (:func:`mark_seams`)."""
    return mark_seams(labels, starts, ends, shifted=key == "shift_labels")


def no_seams(key: str, labels: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """A model whose targets are its tokens' own (masked language models, token classification with
    causal attention): each label stays with its token, no target crosses a seam."""
    return labels


Seams = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def take_packed(batch: Mapping, layout: SequenceLayout, group: MicroGroup,
                seams: Seams = seams_of_shifted_targets) -> Mapping:
    """``group``'s packed micro-batch of ``batch``: one row of its documents' tokens, its
    ``position_ids``, labels marked at the seams by ``seams``, no attention mask (the module docstring)."""
    widths = _widths([layout.lengths[r] for r in group.rows])
    index: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def indices(device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in index:
            rows = torch.repeat_interleave(torch.tensor(group.rows), torch.tensor(widths))
            columns = torch.cat([torch.arange(w) for w in widths])
            ends = torch.cat([torch.arange(w) == w - 1 for w in widths])
            index[device] = tuple(t.to(device) for t in (rows, columns, columns == 0, ends))
        return index[device]

    packed, positions = {}, None
    for key, value in batch.items():
        path = f"batch[{key!r}]"
        if path not in layout.sequence_paths:
            packed[key] = value  # 0-dim tensors and other leaves, unchanged
            continue
        if key == MASK_KEY:
            continue
        rows, columns, starts, ends = indices(value.device)
        tokens = value[rows, columns][None]
        if key in ("labels", "shift_labels"):
            tokens = seams(key, tokens, starts[None], ends[None])
        packed[key] = tokens
        positions = columns
    if POSITIONS_KEY not in packed:
        packed[POSITIONS_KEY] = document_positions(positions)[None]
    return rebuild_mapping(batch, packed)
