"""Which part of every sequence a context rank holds, and the batch it is handed.

A context group of N ranks splits each sequence of S tokens into 2N equal chunks; rank r
holds chunks r and 2N-1-r (head–tail). Under causal attention the work of a query grows with
its position, so pairing an early chunk with a late one gives every rank the same work; with
right padding it also gives every rank a share of the real tokens. Ulysses does not need the
balance (each rank attends over the whole sequence for its heads) but uses the same layout,
so the labels, positions and token counts below do not depend on the method.

A rank's batch (:func:`shard_batch`) is its columns of every sequence tensor (dim 1 of length
S), with:

* labels shifted *before* the split when the model shifts them itself (a Hugging Face causal
  LM predicts token t+1 at position t: shifting inside each shard would lose the target of a
  shard's last position and shift across the head–tail seam). The shard's shifted labels go in
  as ``shift_labels`` (and ``labels``, which the model needs to compute a loss at all), with
  ``num_items_in_batch``: the model then divides the shard's loss sum by the shard's real
  tokens, at least 1, so a shard of padding alone gives 0, not NaN;
* the token count: labels other than -100 in the shard, of the shifted labels — what the
  whole sequence holds, summed over the group (counting after a split-then-shift would lose
  one token per shard seam);
* the attention mask checked to be right padding (a prefix of ones per row): under causal
  attention a real token never sees the padding after it, so the mask needs no splitting;
* a length that does not cut into equal chunks padded on the right to the next multiple when
  the batch has ``labels`` (-100 there, mask 0, other tensors 0): under causal attention the
  real tokens and their losses are those of the unpadded batch (``ShardedBatch.padded`` says
  so, and the exchange refuses non-causal attention then). Without labels it is refused.

Positions (:func:`shard_positions`) are the shard's tokens' places in the whole sequence, for
a model's ``position_ids`` (rotary embeddings, position tables), unless the batch brings its own
``position_ids``: those are split like any sequence tensor, so every part keeps its documents'
positions. Where they restart (packed rows: documents end to end, as Hugging Face's
``DataCollatorWithFlattening`` makes them), :func:`document_ids` numbers the documents of the
*whole* sequence, and the sharded batch carries them to the attention exchange, which attends
over the whole sequence and keeps each token within its document (one part alone could not tell
where a document that started on another rank began).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.errors import EngineUsageError

IGNORE_INDEX = -100
POSITIONS_KEY = "position_ids"
INPUT_KEYS = ("input_ids", "tokens", "inputs_embeds")  # where a mapping batch's sequence length is read


@dataclass(frozen=True)
class ContextShards:
    """The head–tail layout of a group of ``size`` ranks, seen from its rank ``index``."""

    size: int
    index: int

    @property
    def chunks(self) -> int:
        """Equal chunks every sequence is cut into: 2 per rank."""
        return 2 * self.size

    def check_length(self, length: int) -> None:
        """Raise, naming the fix, when a sequence of ``length`` tokens does not cut into equal chunks."""
        if length % self.chunks:
            multiple = self.chunks
            raise EngineUsageError(
                f"context_parallel: a sequence of {length} tokens does not cut into {multiple} equal chunks "
                f"(2 × context size {self.size}: each rank holds a head and a tail chunk, which balances causal "
                f"attention); {length} % {multiple} = {length % multiple}. Pad every batch's sequences to a multiple "
                f"of {multiple} (e.g. tokenizer(..., padding=True, pad_to_multiple_of={multiple}), labels -100 at "
                f"the padding), or hand a mapping batch with its 'labels' (-100 at padding): the engine then pads "
                f"on the right itself")

    def positions(self, length: int, index: int | None = None, device=None) -> torch.Tensor:
        """The places in a sequence of ``length`` tokens of rank ``index``'s tokens (default: this rank's)."""
        index = self.index if index is None else index
        chunk = length // self.chunks
        head = torch.arange(index * chunk, (index + 1) * chunk, device=device)
        tail_start = (self.chunks - 1 - index) * chunk
        return torch.cat([head, torch.arange(tail_start, tail_start + chunk, device=device)])

    def gathered_positions(self, length: int, device=None) -> torch.Tensor:
        """The places of the tokens of every rank's shard, concatenated in rank order (what an
        exchange over the group gathers): ``natural[gathered_positions]`` is the gathered order."""
        return torch.cat([self.positions(length, index, device) for index in range(self.size)])

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's head and tail chunks of ``tensor`` along ``dim``."""
        length = tensor.shape[dim]
        chunk = length // self.chunks
        head = tensor.narrow(dim, self.index * chunk, chunk)
        tail = tensor.narrow(dim, (self.chunks - 1 - self.index) * chunk, chunk)
        return torch.cat([head, tail], dim=dim)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels moved one place left, -100 at the end: position t's target is token t+1 (what a
    Hugging Face causal LM does inside its loss)."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def label_convention(batch) -> str | None:
    """Which convention a mapping batch's ``labels`` follow against its ``input_ids``: ``"shift"``
    (they are the input ids where labelled: Hugging Face's, the model shifts them), ``"aligned"``
    (they are the next input ids: already aligned with positions), or None (no labels or input
    ids to compare). Labels that are neither, or both (a row of one repeated token), are
    Hugging Face's."""
    if not isinstance(batch, Mapping):
        return None
    ids, labels = batch.get("input_ids"), batch.get("labels")
    if not (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor)) or ids.shape != labels.shape:
        return None
    labelled = labels != IGNORE_INDEX
    as_inputs = bool((labels == ids)[labelled].all())
    # the last column's target lies beyond the row: it cannot be compared
    as_next = bool((labels[:, :-1] == ids[:, 1:])[labelled[:, :-1]].all())
    return "aligned" if as_next and not as_inputs else "shift"


def sequence_length(batch) -> int | None:
    """S of a batch: dim 1 of its input ids (``input_ids`` / ``tokens`` of a mapping, else its
    first tensor of two or more dimensions); None when it holds none."""
    if isinstance(batch, Mapping):
        for key in INPUT_KEYS:
            value = batch.get(key)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:
                return value.shape[1]
    for tensor in tensors(batch):
        if tensor.dim() >= 2:
            return tensor.shape[1]
    return None


def tensors(batch):
    """Every tensor in a batch of mappings, tuples and lists."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from tensors(value)
    elif isinstance(batch, (tuple, list)):
        for value in batch:
            yield from tensors(value)


def check_right_padding(mask: torch.Tensor) -> None:
    """Raise unless every row of an attention mask is ones then zeros (right padding)."""
    mask = mask.bool()
    if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise EngineUsageError(
            "context_parallel: the attention mask is not right padding (a row has a real token after padding, "
            "e.g. left padding or packed rows with holes). Sequences are split over the context ranks under "
            "causal attention, which keeps real tokens from seeing the padding after them but not before; pad "
            "on the right (tokenizer.padding_side = 'right', labels -100 at the padding)")


def document_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The document of every position of packed rows ``(rows, S)``: a document starts wherever a
    position is not its predecessor's plus one (the rule transformers' packed-sequence mask
    follows). None when no row holds more than one document (plain causal attention then)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    return starts.cumsum(dim=1)


@dataclass
class ShardedBatch:
    """A rank's part of a batch: ``batch`` (same structure), the real tokens it holds (labels
    other than -100, as a 0-dim tensor; None when the batch has no ``labels``), the columns
    of padding added to make the length cut into equal chunks, and the documents of the whole
    sequence (:func:`document_ids`, None for rows of one document each)."""

    batch: object
    tokens: torch.Tensor | None
    padded: int = 0
    documents: torch.Tensor | None = None


def shard_batch(batch, shards: ContextShards, *, shift: bool) -> ShardedBatch:
    """This rank's columns of every sequence tensor of ``batch`` (see the module docstring; a
    mapping comes back as a dict, e.g. a Hugging Face ``BatchEncoding``); ``shift``: the model shifts its labels itself (they are shifted here, before the split,
    and handed in as ``shift_labels``)."""
    length = sequence_length(batch)
    if length is None:
        raise EngineUsageError(
            "context_parallel: the batch holds no tensor of shape (rows, sequence, ...) to split over the context "
            "ranks; give the input ids as a 2-D tensor (a mapping's input_ids or tokens)")
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor):
        shards.check_length(length)
        labels = None
    if not isinstance(batch, Mapping):
        return ShardedBatch(_split_sequences(batch, shards, length), None)
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        check_right_padding(mask)
    padded = -length % shards.chunks
    if padded:
        batch = {key: _pad_sequences(key, value, length, padded) for key, value in batch.items()}
        length, labels = length + padded, batch["labels"]
    positions = batch.get(POSITIONS_KEY)
    documents = document_ids(positions) if isinstance(positions, torch.Tensor) and positions.dim() == 2 else None
    sharded = {key: _split_sequences(value, shards, length) for key, value in batch.items()}
    if labels is None:
        return ShardedBatch(sharded, None, padded, documents)
    if shift:
        sharded["labels"] = sharded["shift_labels"] = shards.split(shift_labels(labels))
    tokens = (sharded["labels"] != IGNORE_INDEX).sum()
    if shift:
        # The model divides its shard's sum by this: its mean over the shard's real tokens, 0 for none.
        sharded["num_items_in_batch"] = tokens.clamp(min=1)
    return ShardedBatch(sharded, tokens, padded, documents)


_PAD_VALUES = {"labels": IGNORE_INDEX, "attention_mask": 0}


def _pad_sequences(key, value, length: int, columns: int):
    """``value`` with ``columns`` columns of padding after its ``length`` ones (a sequence tensor)."""
    if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length):
        return value
    if key == POSITIONS_KEY:  # the last document goes on over the padding: no document is added
        pad = value[:, -1:] + torch.arange(1, columns + 1, dtype=value.dtype, device=value.device)
    else:
        pad = value.new_full((value.shape[0], columns, *value.shape[2:]), _PAD_VALUES.get(key, 0))
    return torch.cat([value, pad], dim=1)


def _split_sequences(value, shards: ContextShards, length: int):
    """``value`` with every tensor whose dim 1 has ``length`` entries cut to this rank's chunks."""
    if isinstance(value, torch.Tensor):
        return shards.split(value) if value.dim() >= 2 and value.shape[1] == length else value
    if isinstance(value, Mapping):
        return type(value)({key: _split_sequences(item, shards, length) for key, item in value.items()})
    if isinstance(value, (tuple, list)):
        items = [_split_sequences(item, shards, length) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
