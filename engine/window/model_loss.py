"""A model's own loss, read as ``(sum, count)``: what makes ``m(**batch).loss`` exact.

A Hugging Face model called with ``labels`` returns ``.loss``, the mean over the items its loss
type counts in that call. A window of micro-batches whose items differ (padding, ``-100``
labels) is the mean over the window's items only if each micro-batch's mean is weighted by its
items, not by its rows. The engine sees every forward it runs (``eng(**micro_batch)``, and
``loss_fn``'s calls of the model in ``train_batch``), so it counts the items from the labels it
handed in, by the model's loss type, and marks the returned ``.loss`` with that count;
``engine.accounting.loss_and_units`` then reads that very tensor as ``(loss × count,
count)``. A tensor derived from it (``loss * 2``, ``loss + other``) is not marked: it is taken as
a mean over the micro-batch's samples, as any scalar loss.

What a loss averages over is decided by the loss type *and* by how the model's forward computes it
(read once per class from its source, :func:`loss_computation`):

* through transformers' loss function (``self.loss_function(...)``: Llama, Mixtral, Llava, ...): what
  that function averages — ``ForCausalLMLoss`` (``ForCausalLM`` and decoder-only
  ``ForConditionalGeneration``) the shifted targets that are not -100 (``labels[..., 1:]``, or
  ``shift_labels``); ``ForMaskedLMLoss`` / ``ForTokenClassification`` the labels that are not -100;
  ``ForSequenceClassificationLoss`` the rows whose label is not -100 (single label) or every label
  element (regression, multi-label). A given ``num_items_in_batch`` replaces the divisor of its cross
  entropies: the sum is then ``loss × num_items_in_batch``;
* through a loss module the forward builds itself (T5, BART and other encoder-decoders, BERT): the
  flattened, unshifted labels that are not -100 (an encoder-decoder's decoder reads the labels shifted
  right, so its targets are the labels themselves), rows for classification; ``num_items_in_batch``
  is ignored by those models, and by the reading.

Every other loss type (question answering, detection, CTC, ...: ``NOT_READ`` says why), a model whose
forward does neither, one whose ``loss_function`` was replaced, and models that are not Hugging
Face's are not read (:class:`LossReading` warns when that leaves a window's micro-batches weighted by
rows while their items differ; ``strict`` refuses).

A routed model's ``.loss`` includes its load-balancing term λ·aux: read as a sum, that term
is multiplied by the micro-batch's count too, which the term's factor divides out
(``engine.accounting.term_factors``, from :func:`mean_items`). Under a pipeline no rank
holds the whole model: the last stage hands ``loss_fn(model, micro_batch)`` a :class:`LastStageModel`
whose call applies the model's own loss function to the stage's logits; a routed model's term is then
the window's (``moe.load_balance: global``: the stages exchange their router counts first,
``engine.experts.stages``), its coefficient λ read from the model (``engine.experts.hf.RouterTerm``).
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
from dataclasses import dataclass
from typing import Callable

import torch

from engine.batching.packing import Seams, no_seams, seams_of_shifted_targets
from engine.accounting import mark_mean_items, mean_items
from engine.errors import ConfigError, EngineUsageError

log = logging.getLogger("engine")

IGNORED = -100  # transformers' ignore_index


def _causal_targets(labels: torch.Tensor, kwargs: dict, config) -> torch.Tensor:
    shifted = kwargs.get("shift_labels")
    targets = shifted if isinstance(shifted, torch.Tensor) else labels[..., 1:]
    return (targets != IGNORED).sum()


def _labelled(labels: torch.Tensor, kwargs: dict, config) -> torch.Tensor:
    return (labels != IGNORED).sum()


def _classified_rows(labels: torch.Tensor, kwargs: dict, config) -> torch.Tensor:
    if getattr(config, "problem_type", None) == "single_label_classification":
        return (labels != IGNORED).sum()
    return torch.tensor(labels.numel(), device=labels.device)  # MSE / BCE: a mean over every element


def _always(config) -> bool:
    return True


def _single_label(config) -> bool:  # transformers' fixed cross entropy; MSE / BCE take no divisor
    return getattr(config, "problem_type", None) == "single_label_classification"


def _never(config) -> bool:
    return False


@dataclass(frozen=True)
class Reading:
    """What one loss of a model averages over: ``items(labels, kwargs, config)`` counts them, and
    ``honours_num_items(config)`` says whether a given ``num_items_in_batch`` replaces that divisor."""

    items: Callable
    honours_num_items: Callable


# A model's forward computes its loss in one of two ways, read from its source (``loss_computation``):
# by transformers' function of its loss type (``self.loss_function(...)``: the function's own items,
# ``num_items_in_batch`` honoured), or by a ``CrossEntropyLoss`` / ``MSELoss`` it builds itself on the
# flattened, unshifted labels (T5, BART, BERT: a mean over the labels that are not -100; no divisor taken).
BY_FUNCTION: dict[str, Reading] = {  # transformers' loss function's name -> what it averages
    "ForCausalLMLoss": Reading(_causal_targets, _always),
    "ForMaskedLMLoss": Reading(_labelled, _always),
    "ForTokenClassification": Reading(_labelled, _always),
    "ForSequenceClassificationLoss": Reading(_classified_rows, _single_label),
}
BY_OWN_LOSS: dict[str, Reading] = {  # loss type -> what a forward's own loss module averages
    "ForConditionalGeneration": Reading(_labelled, _never),  # encoder-decoder: decoder inputs are the labels shifted right
    "ForMaskedLM": Reading(_labelled, _never),
    "ForTokenClassification": Reading(_labelled, _never),
    "ForSequenceClassification": Reading(_classified_rows, _never),
    "ForImageClassification": Reading(_classified_rows, _never),
    "ForAudioClassification": Reading(_classified_rows, _never),
    "ForVideoClassification": Reading(_classified_rows, _never),
}
# Every loss type transformers defines that is not read, and why (tests/unit/test_model_loss.py sorts
# every key of transformers' LOSS_MAPPING into READ_TYPES or NOT_READ).
READ_TYPES = frozenset(BY_OWN_LOSS) | {"ForCausalLM"}  # a causal LM's own loss only through transformers' function
NOT_READ = {
    "ForQuestionAnswering": "the mean of two cross entropies over rows, positions clamped: return (sum, count)",
    "ForSemanticSegmentation": "a mean over pixels plus an auxiliary head's: return (sum, count)",
    "ForSegmentation": "matched masks (Hungarian matching per batch): no per-item sum exists",
    "ForObjectDetection": "matched boxes (Hungarian matching per batch): no per-item sum exists",
    "ForCTC": "a mean of per-sequence losses each divided by its target length",
    "CsmForConditionalGeneration": "audio codebooks with their own depth decoder's loss added",
    "PocketTTSForConditionalGeneration": "a flow-matching loss over latent frames",
    "GradiumPhononTTSForConditionalGeneration": "a flow-matching loss over latent frames",
    "ParakeetForRNNT": "a transducer loss, per sequence",
    "ParakeetForTDT": "a transducer loss, per sequence",
    **dict.fromkeys(("DeformableDetrForObjectDetection", "ConditionalDetrForObjectDetection", "DabDetrForObjectDetection",
                     "GroundingDinoForObjectDetection", "MMGroundingDinoForObjectDetection", "RTDetrForObjectDetection",
                     "RTDetrV2ForObjectDetection", "DFineForObjectDetection", "Deimv2ForObjectDetection",
                     "LwDetrForObjectDetection", "RfDetrForObjectDetection", "ConditionalDetrForSegmentation",
                     "RfDetrForInstanceSegmentation"),
                    "matched boxes or masks (Hungarian matching per batch): no per-item sum exists"),
}


def loss_computation(model_class: type) -> str:
    """How ``model_class.forward`` computes its loss: ``"function"`` (it calls ``self.loss_function``),
    ``"own"`` (it builds a loss module itself and calls no loss function), or ``"unknown"`` (its source
    is not readable, or it does neither)."""
    return _loss_computation(getattr(model_class, "forward", None))


@functools.lru_cache(maxsize=None)
def _loss_computation(forward) -> str:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return "unknown"
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            function = node.func
            called.add(function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None))
    if "loss_function" in called:
        return "function"
    if called & {"CrossEntropyLoss", "MSELoss", "BCEWithLogitsLoss"}:
        return "own"
    return "unknown"


def reading_of(model: torch.nn.Module) -> Reading | None:
    """What ``model``'s ``.loss`` averages over, or None when the engine is not sure (not read)."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type not in READ_TYPES or "_loss_function" in vars(model) or not hasattr(model, "config"):
        return None
    computation = loss_computation(type(model))
    if computation == "function":
        return BY_FUNCTION.get(getattr(model.loss_function, "__name__", None))
    if computation == "own":
        return BY_OWN_LOSS.get(loss_type)
    return None


class ModelLoss:
    """Marks the ``.loss`` of a Hugging Face model's forwards with the items it averages, and keeps
    a packed row's documents apart (no key/value cache when ``position_ids`` are given)."""

    def __init__(self, model: torch.nn.Module, reading: Reading, takes_cache: bool):
        self.config = getattr(model, "config", None)
        self.loss_type = getattr(model, "loss_type", None)
        self.reading, self._takes_cache = reading, takes_cache
        self._loss_function = model.loss_function  # transformers' function of this loss type

    def call_arguments(self, kwargs: dict) -> dict:
        """``kwargs`` for the model: rows carrying ``position_ids`` (packed documents) run without the
        cache, with which transformers skips the per-document mask and attention crosses documents."""
        if self._takes_cache and "position_ids" in kwargs and kwargs.get("use_cache") is None:
            return {**kwargs, "use_cache": False}
        return kwargs

    def observe(self, kwargs: dict, output) -> None:
        """Mark ``output.loss`` when it was computed from ``kwargs['labels']``."""
        loss, labels = getattr(output, "loss", None), kwargs.get("labels")
        if not isinstance(loss, torch.Tensor) or not isinstance(labels, torch.Tensor) or loss.dim() != 0:
            return
        items = self.reading.items(labels, kwargs, self.config)
        given = kwargs.get("num_items_in_batch")
        multiplier = given if given is not None and self.reading.honours_num_items(self.config) else items
        mark_mean_items(loss, multiplier, items)


    def last_stage_loss(self, logits: torch.Tensor, kwargs: dict, routers_counted: bool = False) -> torch.Tensor:
        """Under a pipeline: the model's own loss of the last stage's ``logits`` and ``kwargs``'
        labels, as the whole model's forward computes it (causal language models: no other loss
        type's head runs on the last stage alone). A routed model's, only where the stages count their
        routers (``routers_counted``), is without its load-balancing term: the term is the window's (or
        evaluated batch's), its gradient reaches every stage's routers beside the loss, and the pipeline's
        window executor adds its value to the recorded losses (``engine.window.executor``)."""
        if self.reading.items is not _causal_targets:
            raise EngineUsageError(
                f"under a pipeline the last stage applies the model's own loss for causal language models; "
                f"{type(self.config).__name__}'s loss type is {self.loss_type}: write loss_fn(outputs, labels) "
                "returning (loss_sum, num_items), and give batches (inputs, labels)")
        routed = getattr(self.config, "output_router_logits", False)
        if routed and not routers_counted:
            raise EngineUsageError(
                "under a pipeline the last stage holds the logits only, not the routers of the other stages, whose "
                "load-balancing term the model's own .loss adds (output_router_logits is true): the stages exchange "
                "their router counts for the window's (or evaluated batch's) term under moe.load_balance: global "
                "(for a model that names num_experts, num_experts_per_tok and router_aux_loss_coef, as Mixtral, "
                "Qwen2/3-MoE and OLMoE do), never for one micro-batch's term (moe.load_balance: micro_batch); set "
                "moe.load_balance: global, or write loss_fn(outputs, labels) for the language-model part as "
                "(loss_sum, num_items)")
        extra = {key: kwargs[key] for key in ("shift_labels", "num_items_in_batch") if key in kwargs}
        loss = self._loss_function(logits, kwargs["labels"], vocab_size=self.config.vocab_size, **extra)
        return loss


class NoModelLoss:
    """A model whose loss the engine does not read (not Hugging Face's, another loss type, or a
    ``loss_function`` of the user's): calls pass unchanged."""

    loss_type = None

    def call_arguments(self, kwargs: dict) -> dict:
        return kwargs

    def observe(self, kwargs: dict, output) -> None:
        pass

    def last_stage_loss(self, logits: torch.Tensor, kwargs: dict, routers_counted: bool = False) -> torch.Tensor:
        raise EngineUsageError(NO_LAST_STAGE_LOSS)


NO_LAST_STAGE_LOSS = (
    "loss_fn(model, micro_batch) under a pipeline: the last stage can apply a model's own loss only for a Hugging "
    "Face causal language model; write loss_fn(outputs, labels) (a mean, or (loss_sum, num_items)) and give batches "
    "(inputs, labels)")


class LastStageModel:
    """What ``loss_fn(model, micro_batch)`` is handed on a pipeline's last stage, where no rank holds
    the whole model: called with the micro-batch (``m(**micro_batch)``), it returns the last stage's
    outputs, with the model's own ``.loss`` of their logits and the labels given (marked with its
    items, as a whole model's forward through the engine would be). ``routers_counted``: the stages
    count a routed model's routers (``engine.experts.stages``), whose term the window executor adds."""

    def __init__(self, outputs, model: ModelLoss | NoModelLoss, routers_counted: bool = False):
        self._outputs, self._model, self._routers_counted = outputs, model, routers_counted

    def __call__(self, *args, **kwargs):
        outputs = self._outputs
        if not isinstance(kwargs.get("labels"), torch.Tensor):
            return outputs
        if not isinstance(getattr(outputs, "logits", None), torch.Tensor):
            raise EngineUsageError(NO_LAST_STAGE_LOSS)
        loss = self._model.last_stage_loss(outputs.logits, kwargs, self._routers_counted)
        outputs = type(outputs)(loss=loss, logits=outputs.logits)
        self._model.observe(kwargs, outputs)
        return outputs


def model_loss(model: torch.nn.Module) -> ModelLoss | NoModelLoss:
    """What the engine reads from ``model``'s own loss (see the module's docstring)."""
    reading = reading_of(model)
    if reading is None:
        return NoModelLoss()
    try:
        takes_cache = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_cache = False
    return ModelLoss(model, reading, takes_cache)


def packing_seams(model: torch.nn.Module, own: ModelLoss | NoModelLoss) -> Seams:
    """How ``packing: true`` marks a packed row's seams for ``model`` (``engine.batching.packing``), or a
    ``ConfigError`` where packing would change what it trains: a model attending in both directions
    (BERT, T5, BART: transformers keeps a packed row's documents apart only under causal attention, so
    they would see each other). A model the engine does not read keeps the convention of labels the
    model shifts."""
    attention = {getattr(module, "is_causal") for module in model.modules()
                 if isinstance(getattr(module, "is_causal", None), bool)}
    if False in attention or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ConfigError([
            f"packing: {type(model).__name__} attends in both directions, so the documents of a packed row would "
            "see each other (transformers keeps a packed row's documents apart under causal attention only); set "
            "packing: false: micro_batch_tokens alone forms micro-batches by tokens, each row its own document"])
    if isinstance(own, ModelLoss) and own.reading.items is not _causal_targets:
        return no_seams
    return seams_of_shifted_targets


class LossReading:
    """The engine's side of its forwards' losses: the model's own loss marked (``ModelLoss``), and
    mean losses it could not read watched in windows whose micro-batches hold different numbers of
    items per row (labels that are not -100, or attention-mask tokens), over every rank where the
    window's statistics travel: weighted by rows, those are not the window's mean over items. One
    warning per run; ``strict: true`` refuses such a loss at its backward whenever the batch carries
    labels or a mask (on every rank alike: the batches' structure is the same on each)."""

    def __init__(self, model: ModelLoss | NoModelLoss, strict: bool):
        self.model, self.strict = model, strict
        self._last_items = None  # of the last forward: its counted items, a call counting them, or None
        self._unread: list = []  # (items, rows) of the window's micro-batches whose mean loss went unread
        self._told = False

    def call_arguments(self, kwargs: dict) -> dict:
        return self.model.call_arguments(kwargs)

    def observe(self, kwargs: dict, output) -> None:
        """A forward through the engine returned ``output`` for ``kwargs``."""
        self.model.observe(kwargs, output)
        marked = mean_items(getattr(output, "loss", None))  # its items are counted already
        self._last_items = marked[1] if marked is not None else _batch_items(kwargs)  # counted only if unread

    def backward_of(self, item_weighted: bool, rows: int) -> None:
        """The micro-step's loss, of ``rows`` samples, reaches its backward, read as a sum (``item_weighted``)
        or not."""
        items, self._last_items = self._last_items, None
        if item_weighted or items is None:
            return
        if self.strict:
            raise EngineUsageError(
                "strict: the loss is a scalar the engine cannot read as (sum, count), while the batch carries "
                f"labels or an attention mask. {_FIX}")
        if not self._told and rows:
            self._unread.append((items() if callable(items) else items, rows))

    def unread_sums(self) -> tuple:
        """The window's unread micro-batches' items per row as ``(count, Σ, Σ²)``, for the window's
        statistics reduction to add up over the ranks; the window's record of them is cleared."""
        unread, self._unread = self._unread, []
        if not unread:
            return (0.0, 0.0, 0.0)
        ratios = torch.stack([torch.as_tensor(n).reshape(()).double().cpu() / rows for n, rows in unread])
        return (float(len(unread)), ratios.sum(), (ratios * ratios).sum())

    def forget_window(self) -> None:
        """The window was discarded: what its micro-batches held is not compared."""
        self._unread, self._last_items = [], None

    def window_closed(self, sums: tuple, over_ranks: bool) -> None:
        """Warn once when the window's unread micro-batches (their ``unread_sums``, added up over every rank
        where ``over_ranks``, else this rank's own) differ in their items per row."""
        count, total, squares = (float(v) for v in sums)
        if count < 2 or self._told:
            return
        spread = count * squares - total * total  # count² × the variance of the items per row
        if spread > 1e-9 * total * total:
            self._told = True
            where = "over every rank" if over_ranks else "on this rank"
            log.warning("the loss is a scalar the engine cannot read as (sum, count), and this window's micro-batches "
                        "(%s) hold different numbers of items per row (what the model's loss counts, labels that are "
                        "not -100, or attention-mask tokens; %.4g on average): each micro-batch's mean is weighted by "
                        "its rows, which is not the mean over the window's items. %s (shown once; strict: true makes "
                        "it an error)", where, total / count, _FIX)


_FIX = ("Return the model's own output loss unchanged (m(**batch).loss, which the engine reads by its labels), or "
        "(loss_sum, num_items) from loss_fn; `python -m engine verify` compares a config with one process on the "
        "whole batch")


def _batch_items(kwargs: dict):
    """What counts the items a forward's arguments hold (labels that are not -100, else attention-mask
    tokens), called only when its loss went unread; None: neither is given."""
    labels, mask = kwargs.get("labels"), kwargs.get("attention_mask")
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
        return lambda: (labels != IGNORED).sum()
    if isinstance(mask, torch.Tensor):
        return mask.sum
    return None
