"""Context parallelism on one mesh dimension: what the strategy's ``parallelize`` installs on
the model (``engine.strategies.parallelize.apply_context_parallel``, after the tensor split and
before activation checkpointing and compile) and the engine calls for every micro-batch
(``context_parallel: {size, method, labels, check_micro_batches}``).

Exactness. Every rank of a context group holds the same rows; each takes its head–tail part
of every sequence (``engine.context.sharding``) and computes the loss of its part: a sum over
its real tokens and their count, with labels shifted before the split. The engine treats
every rank of the data × context ranks as holding its own items: the window's token count U
is summed over data × context ranks and micro-steps, the gradient averaged over the same
data × context ranks (which is what DDP / ZeRO / FSDP over those ranks do) and multiplied by
``context`` (:attr:`ContextParallel.size`: the parts of one sequence add up, they are not
alternatives), then by G / U at the boundary. So the update is the gradient of the mean token
loss of the global batch, for every context size. A loss the model returns as a mean over a
shard's tokens (a Hugging Face ``.loss``) is turned back into its sum with the shard's count
(:meth:`ContextParallel.item_weighted`); a shard of padding alone counts 0 and adds 0.

Which implementation: ``ulysses`` (``engine.context.ulysses``: an all-to-all trades sequence for
heads, any attention kernel runs on whole sequences) or ``ring`` (``engine.context.ring``: keys and
values go round the group, blockwise attention merged by log-sum-exp; no limit on the heads, 1/N
of the activations); ``auto`` (:func:`auto_method`) is Ulysses where the query and key/value heads
divide over the context size, ring where they do not: decided once at ``apply`` from a Hugging Face
model's config, per attention call from its heads for any other model (:class:`AutoExchange`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys

import torch
import torch.distributed as dist

from engine.accounting import part_as_sum
from engine.context.sharding import ContextShards, label_convention, shard_batch, tensors
from engine.context.ring import RingExchange
from engine.context.ulysses import Activity, UlyssesExchange, sequence_attention_forward
from engine.distributed.mesh import MeshGroups, MeshLayout
from engine.errors import ConfigError, EngineUsageError
from engine.distributed.batch_fingerprint import batch_fingerprint

log = logging.getLogger("engine")
_POSITIONAL = "\0positional arguments"  # a key no keyword argument can have


def auto_method(heads: list[int], size: int) -> str:
    """``auto``: Ulysses (one all-to-all each way, any attention kernel) where the heads divide over
    the context ranks, ring attention (no limit on the heads) where they do not."""
    return "ulysses" if all(count % size == 0 for count in heads) else "ring"


class AutoExchange:
    """``auto`` for a model whose heads show only in its ``scaled_dot_product_attention`` calls (no
    Hugging Face config): each call goes to Ulysses where its query and key/value heads divide over
    the context size, to ring attention where they do not (the same shapes on every rank of the
    group: the same choice); each choice logged once."""

    def __init__(self, ulysses: UlyssesExchange, ring: RingExchange):
        self.ulysses, self.ring = ulysses, ring
        self.chosen: set[str] = set()  # the methods calls went to

    @property
    def padded(self) -> bool:
        return self.ring.padded

    @padded.setter
    def padded(self, padded: bool) -> None:
        self.ulysses.padded = self.ring.padded = padded

    @property
    def documents(self) -> torch.Tensor | None:
        return self.ring.documents

    @documents.setter
    def documents(self, documents: torch.Tensor | None) -> None:
        self.ulysses.documents = self.ring.documents = documents

    def check_causal(self, causal: bool, what: str) -> None:
        self.ring.check_causal(causal, what)

    def sdpa(self, what: str, func, query, key, value, *rest, **kwargs):
        heads = [query.shape[-3], key.shape[-3]]
        method = auto_method(heads, self.ulysses.shards.size)
        if method not in self.chosen:
            self.chosen.add(method)
            log.info("context_parallel.method auto: %s for %s (%d query, %d key/value heads over context size %d)",
                     method, what, *heads, self.ulysses.shards.size)
        return (self.ring if method == "ring" else self.ulysses).sdpa(what, func, query, key, value, *rest, **kwargs)


class WholeSequences:
    """No context dimension: every rank holds whole sequences, and the engine's four calls of
    :class:`ContextParallel` change nothing."""

    size = 1  # ranks whose parts of a sequence add up

    def running(self):
        return contextlib.nullcontext()

    def shard(self, batch):
        return batch

    def shard_call(self, args: tuple, kwargs: dict):
        return args, kwargs

    def item_weighted(self, output):
        return output


class ContextParallel:
    """One rank's context group: splits batches, wraps the model's attention, weighs its losses."""

    def __init__(self, mesh: MeshLayout, groups: MeshGroups, *, method: str, labels: str, check_micro_batches: int = 0):
        self.size, self.mesh = mesh.context, mesh
        self._checks_left, self._checked = check_micro_batches, 0
        self._count_checks_left = check_micro_batches  # (sum, count) losses whose counts are compared
        self.method = method  # auto: chosen at apply, where the model's heads are known
        self.labels = labels
        self.group = groups.group(("context",))  # None: the context group is the whole world
        self.shards = ContextShards(self.size, mesh.coordinates(groups.rank).context)
        self._ring_ranks = mesh.group_ranks(("context",), groups.rank)
        self.exchange = self._exchange(method if method != "auto" else "ulysses")
        self.activity = Activity()  # on while the engine runs a micro-step's forward or backward
        self.shift = labels == "shift"
        self._told_padding = False
        self._labels_read = True  # labels: shift / aligned, or auto once decided
        self._tokens = None  # the real tokens of the micro-step being run (after shard)

    def _exchange(self, method: str):
        if method == "ring":
            return RingExchange(self.shards, self.group, self._ring_ranks)
        return UlyssesExchange(self.shards, self.group)

    # -- the model ------------------------------------------------------------------------------
    def apply(self, model: torch.nn.Module) -> None:
        """Wrap ``model``'s attention in the exchange and its forward in the shard's positions,
        in place (no wrapper module: parameter names and checkpoints do not change)."""
        self.apply_attention(model)
        self._wrap_positions(model)

    def apply_attention(self, model: torch.nn.Module) -> None:
        """Wrap ``model``'s attention in the exchange, in place. Alone (without :meth:`apply`'s
        positions) under a pipeline: the stages, copies of the model's module tree sharing its
        configuration and attention, are handed each part's :meth:`positions` with its micro-batch."""
        hugging_face = _attention_implementation(model) is not None
        if self.labels == "auto":
            self.shift = hugging_face and getattr(model, "loss_type", None) == "ForCausalLM"
            self._labels_read = not self.shift  # a causal LM's first labelled batch says which convention
        if hugging_face:
            self._wrap_hugging_face(model)
        else:
            self._wrap_attention_modules(model)

    def _wrap_hugging_face(self, model) -> None:
        from transformers import AttentionInterface  # an optional dependency: only for its models
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        implementation = _attention_implementation(model)
        config = model.config
        heads = {attribute: getattr(config, attribute) // self.mesh.tensor  # what a rank holds after the tensor split
                 for attribute in ("num_attention_heads", "num_key_value_heads")
                 if isinstance(getattr(config, attribute, None), int)}
        if self.method == "auto":
            self.method = auto_method(list(heads.values()), self.size)
            self.exchange = self._exchange(self.method)
            log.info("context_parallel.method auto: %s (%s over context size %d)", self.method,
                     ", ".join(f"{attribute} {count}" for attribute, count in heads.items()) or "heads unknown",
                     self.size)
        for attribute, count in heads.items():
            self.exchange.check_heads(count, f"{type(model).__name__} ({attribute}: {count * self.mesh.tensor} / "
                                             f"tensor {self.mesh.tensor})")
        inner = ALL_ATTENTION_FUNCTIONS.get(implementation) if implementation != "eager" else None
        if inner is None:  # eager: the modeling file's own function
            attention = next((m for m in model.modules() if type(m).__name__.endswith("Attention")), None)
            inner = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None) \
                if attention is not None else None
            if inner is None:
                raise ConfigError([f"context_parallel: {type(model).__name__} uses attention implementation "
                                   f"{implementation!r}, which Microstep cannot find to wrap; load the model with "
                                   "attn_implementation='sdpa'"])
        name = f"microstep_context_{implementation}_{id(self)}"
        AttentionInterface.register(name, self.exchange.hugging_face_attention(inner, implementation, self.activity))
        model.set_attn_implementation(name)

    def _wrap_attention_modules(self, model) -> None:
        if self.method == "auto":
            self.exchange = AutoExchange(self._exchange("ulysses"), self._exchange("ring"))
        modules = _outermost(model, lambda m: type(m).__name__.endswith("Attention"))
        if not modules:
            raise ConfigError([
                f"context_parallel: {type(model).__name__} has no attention module (a module whose class name ends "
                "in 'Attention', calling torch.nn.functional.scaled_dot_product_attention), and is not a Hugging "
                "Face model: Microstep cannot tell where its tokens meet. Name the class of your attention "
                "modules ...Attention, or use a Hugging Face model"])
        for module in modules:
            module.forward = sequence_attention_forward(module.forward, self.exchange, self.activity,
                                                        type(module).__name__)

    def _wrap_positions(self, model) -> None:
        """The shard's positions as ``position_ids`` and, for a Hugging Face model, no key/value
        cache (a cache would keep one micro-step's shard and hand it back to the recompute of
        activation checkpointing, doubled)."""
        forward = model.forward
        parameters = inspect.signature(forward).parameters
        if "position_ids" not in parameters:
            log.warning("context_parallel: %s.forward takes no position_ids: each rank holds a part of every "
                        "sequence, and a model that numbers its positions itself starts every part at 0. Add a "
                        "position_ids argument if the model has position embeddings", type(model).__name__)
            return
        activity, caches = self.activity, "use_cache" in parameters

        def run(*args, **kwargs):
            if activity.on and caches and kwargs.get("use_cache") is None:
                kwargs["use_cache"] = False
            inputs = kwargs.get("input_ids", args[0] if args else None)
            if activity.on and kwargs.get("position_ids") is None and isinstance(inputs, torch.Tensor) \
                    and inputs.dim() >= 2:
                kwargs["position_ids"] = self.positions(inputs)
            return forward(*args, **kwargs)

        model.forward = run

    def positions(self, part: torch.Tensor) -> torch.Tensor:
        """The places in the whole sequence of the tokens of ``part`` (this rank's part of a batch's
        rows, ids ``(rows, length)``), one row per row."""
        length = part.shape[1] * self.shards.size
        return self.shards.positions(length, device=part.device).expand(part.shape[0], -1)

    # -- batches and losses (the engine's calls) -----------------------------------------------
    def running(self):
        """The context inside which the engine runs a micro-step's forward or backward."""
        return self.activity

    def shard(self, batch):
        """This rank's part of ``batch`` (what the loss function and the model are handed); its
        real tokens are kept for :meth:`item_weighted`."""
        if self._checks_left:
            self._check_same_rows(batch)
        if not self._labels_read:
            self._read_label_convention(batch)
        sharded = shard_batch(batch, self.shards, shift=self.shift)
        self._tokens = sharded.tokens
        self.exchange.padded = sharded.padded > 0
        self.exchange.documents = sharded.documents
        if sharded.padded and not self._told_padding:
            self._told_padding = True
            log.info("context_parallel: sequences padded on the right by %d column(s) to cut into %d equal chunks "
                     "(labels -100 there; shown once)", sharded.padded, self.shards.chunks)
        return sharded.batch

    def _read_label_convention(self, batch) -> None:
        """``labels: auto`` on a Hugging Face causal LM: its first labelled batch says whether the
        labels are the input ids (shifted before the split: the model shifts them) or the next
        tokens already (kept as they are, for a loss written on the logits). Decided once."""
        convention = label_convention(batch)
        if convention is None:
            return
        self._labels_read = True
        if convention == "aligned":
            self.shift = False
            log.info("context_parallel: the labels are the next tokens already (labels[t] = input_ids[t + 1]): "
                     "taken as aligned with positions, not shifted (context_parallel.labels: shift or aligned "
                     "says it explicitly)")

    def _check_same_rows(self, batch) -> None:
        """Raise on every rank when the ranks of a context group were handed different rows
        (one all-gather of a fingerprint over the world: every rank learns every group's verdict)."""
        self._checks_left -= 1
        self._checked += 1
        device = next((t.device for t in tensors(batch)), torch.device("cpu"))  # the compute device
        mine = batch_fingerprint(batch, device)
        everyone = [torch.empty_like(mine) for _ in range(self.mesh.world_size)]
        dist.all_gather(everyone, mine)
        differing = [ranks for ranks in context_groups(self.mesh)
                     if any(not torch.equal(everyone[ranks[0]], everyone[r]) for r in ranks)]
        if differing:
            groups = "; ".join(f"ranks {', '.join(map(str, ranks))} (data index {self.mesh.data_rank(ranks[0])})"
                               for ranks in differing)
            raise EngineUsageError(
                f"context_parallel: the ranks of a context group were handed different rows at micro-batch "
                f"{self._checked} ({groups}). The ranks of one context group split the same sequences between them "
                f"and must see the same batch: slice the data by eng.plan.rank and eng.plan.world_size (the "
                f"data-parallel index and size, {self.mesh.describe()}), or use eng.batches(dataset). "
                "(context_parallel.check_micro_batches sets how many micro-batches are checked)")

    def _check_count(self, count, tokens: torch.Tensor) -> None:
        """During the checked micro-batches: raise on every rank when a ``(sum, count)`` loss
        counted other tokens than the part's labels hold (one all-reduce of a flag), the sign of
        a loss that shifts labels again inside each part."""
        self._count_checks_left -= 1
        counted = torch.as_tensor(count).to(tokens.device)
        differs = (counted != tokens).to(torch.int32).reshape(1)
        dist.all_reduce(differs, op=dist.ReduceOp.MAX)
        if not bool(differs.item()):
            return
        target = "shifted before the split, as the model's own loss shifts them" if self.shift \
            else "aligned with positions"
        raise EngineUsageError(
            f"context_parallel: loss_fn counted {int(counted)} token(s) in this rank's part of a micro-batch, but "
            f"the part's labels hold {int(tokens)} real target(s) (labels {target}; some rank's counts differ). A loss "
            "that shifts the labels itself (logits[:, :-1] against labels[:, 1:]) shifts each part on its own and "
            "loses a target at every seam. Use the model's own loss (m(**batch).loss), or compute it on the logits "
            "against batch['labels'] as they are handed in (already one per position)")

    def shard_call(self, args: tuple, kwargs: dict):
        """``eng(*args, **kwargs)`` of a manual loop: the arguments' parts (the keyword
        arguments are read as a mapping batch: ``eng(**batch)``)."""
        sharded = self.shard({_POSITIONAL: args, **kwargs})
        return tuple(sharded.pop(_POSITIONAL)), sharded

    def item_weighted(self, output):
        """``loss_fn``'s output as ``(sum, count)`` over this rank's part: a pair as it is; a mean
        (a tensor, or a model output's ``.loss``) times the part's real tokens."""
        tokens, self._tokens = self._tokens, None
        if isinstance(output, (tuple, list)):
            if self._count_checks_left and tokens is not None and len(output) == 2:
                self._check_count(output[1], tokens)
            return output
        loss = output.loss if isinstance(getattr(output, "loss", None), torch.Tensor) else output
        if not isinstance(loss, torch.Tensor):
            return output  # the engine names what is wrong with it
        if tokens is None:
            raise EngineUsageError(
                "context_parallel: a mean loss, but the batch has no 'labels' to count its tokens by; each rank "
                "holds a part of every sequence, and the parts' means weigh by their real tokens. Put the labels "
                "(-100 at padding) under 'labels' in a mapping batch, or return (loss_sum, num_tokens)")
        # shifted: the model's own loss divided its part's sum by num_items_in_batch = max(tokens, 1)
        return part_as_sum(loss, tokens, keeps_other_terms=self.shift)


def context_groups(mesh: MeshLayout) -> list[list[int]]:
    """The ranks of every context group (ranks that split the same sequences), each in context
    order, the groups in order of their first rank."""
    firsts = [rank for rank in range(mesh.world_size) if mesh.coordinates(rank).context == 0]
    return [mesh.group_ranks(("context",), rank) for rank in firsts]


def _attention_implementation(model) -> str | None:
    """A Hugging Face model's attention implementation name (None: not a Hugging Face model)."""
    if not callable(getattr(model, "set_attn_implementation", None)):
        return None
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _outermost(module: torch.nn.Module, chosen) -> list[torch.nn.Module]:
    found = []

    def visit(node):
        for child in node.children():
            if chosen(child):
                found.append(child)
            else:
                visit(child)

    visit(module)
    return found
