"""A pipeline window's micro-batches as its schedules take them: one shape for every micro-batch (equal
chunks, padded with copies of a micro-batch's own rows), a context rank's part of each sequence with its
positions, the outputs' real rows cut back for the loss, and which batches can run at all.
``engine.window.stages`` puts a window in that form."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.batching.microbatch import batch_size
from engine.context.sharding import POSITIONS_KEY
from engine.errors import EngineUsageError

# what the last stage's loss reads of a mapping batch (transformers' loss keywords); attention_mask: the
# rows are padded on the right and attention is causal, so it changes no real token's output
LAST_STAGE_KEYS = ("labels", "shift_labels", "num_items_in_batch", "attention_mask")


def check_model_batch(batch: Mapping, method: str, context_size: int) -> None:
    """An EngineUsageError where a mapping batch for the model's own loss cannot run under a pipeline: keys
    no stage would see, packed rows with a context dimension, padding before real tokens."""
    unused = sorted(key for key in batch if key not in LAST_STAGE_KEYS + ("input_ids", POSITIONS_KEY))
    if unused:
        raise EngineUsageError(
            f"{method}(): under a pipeline the first stage is called with the batch's input_ids alone (attention "
            f"runs causal over the whole row: pad on the right, labels -100 there) and the last stage reads its "
            f"labels; the batch also holds {', '.join(unused)}, which no stage would see: drop "
            f"{'it' if len(unused) == 1 else 'them'} from the batch")
    if POSITIONS_KEY in batch and context_size > 1:
        raise EngineUsageError(
            f"{method}(): packed rows (position_ids) under a pipeline with context_parallel.size {context_size}: "
            "each stage's attention exchange would need every micro-batch's documents at once, and the schedule "
            "runs them one after another; use one of the two, or pad the documents one per row")
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise EngineUsageError(
            f"{method}(): the attention_mask has padding before real tokens (left padding, or rows packed with "
            "gaps); under a pipeline attention runs causal over the whole row without a mask: pad on the right")


def sequence_parts(context, pieces: list) -> list:
    """Each micro-batch ``((input_ids, batch), samples)`` as this rank's part of its sequences under
    context parallelism (``engine.context.parallel.ContextParallel.shard``: labels shifted before the
    split, the part's ``num_items_in_batch``, which the last stage's own loss divides by, and the
    places of its tokens in the whole sequence as ``position_ids``, which the stages hand the model as
    they hand packed rows' own); whole sequences: as they are."""
    if context.size == 1:
        return pieces
    parts = []
    for (_, micro_batch), samples in pieces:
        part = context.shard(micro_batch)
        part[POSITIONS_KEY] = context.positions(part["input_ids"])
        parts.append(((part["input_ids"], part), samples))
    return parts


def packed_positions(pieces: list, rows: int) -> list[torch.Tensor] | None:
    """Each micro-batch's ``position_ids`` (packed rows: documents end to end, positions restarting at
    each; a context part: its tokens' places in the whole sequence), its rows repeated as the schedule's
    equal chunks repeat them; None where the batch gives none."""
    batches = [piece[1] for piece, _ in pieces]
    if not all(isinstance(batch, Mapping) and isinstance(batch.get(POSITIONS_KEY), torch.Tensor) for batch in batches):
        return None
    return [repeat_rows(batch[POSITIONS_KEY], rows) for batch in batches]


def inputs_and_labels(batch, method: str):
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch
    raise EngineUsageError(
        f"{method}(): under a pipeline a batch is a pair (inputs, labels): the first stage is called with "
        "inputs (a tensor, or a tuple of tensors: several arguments), loss_fn(outputs, labels) runs on the last "
        f"stage; got {type(batch).__name__}")


def rows_of(inputs) -> int:
    return (inputs if isinstance(inputs, torch.Tensor) else inputs[0]).shape[0]


def real_rows(outputs, n: int):
    """The first ``n`` rows of the outputs (the rest pads the micro-batch)."""
    if isinstance(outputs, torch.Tensor):
        return outputs if outputs.shape[0] == n else outputs[:n]
    return type(outputs)(real_rows(t, n) if isinstance(t, torch.Tensor) else t for t in outputs)


def zero_from(outputs) -> torch.Tensor:
    """0, computed from the outputs (a schedule may back-propagate it: zero gradients)."""
    tensors = [outputs] if isinstance(outputs, torch.Tensor) else [t for t in outputs if isinstance(t, torch.Tensor)]
    return sum(t.sum() * 0 for t in tensors if t.is_floating_point())


def equal_chunks(inputs: list, rows: int | None = None):
    """The micro-batches' inputs, each padded to ``rows`` (default: the largest's) with copies
    of its own rows, one after the other: equal chunks for the schedule."""
    rows = rows or max(batch_size(piece) for piece in inputs)
    return concat([repeat_rows(piece, rows) for piece in inputs])


def repeat_rows(piece, size: int):
    if isinstance(piece, torch.Tensor):
        reps = -(-size // piece.shape[0])
        return piece.repeat(reps, *([1] * (piece.dim() - 1)))[:size]
    return type(piece)(repeat_rows(t, size) for t in piece)


def concat(pieces: list):
    if isinstance(pieces[0], torch.Tensor):
        return torch.cat(pieces)
    return type(pieces[0])(torch.cat(column) for column in zip(*pieces))
