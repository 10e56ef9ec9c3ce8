"""Expert parallelism: each rank of an expert group holds E / N of a mixture-of-experts layer's
experts, and tokens travel to the rank holding their expert and back (``expert_parallel: {size: N}``).

Which modules. A Hugging Face MoE model (Mixtral, Qwen2/3-MoE, OLMoE, ... in transformers 5) holds
each layer's experts as one module with 3-D parameters ``[num_experts, ...]`` and
``forward(hidden_states, top_k_index, top_k_weights)``; its config's ``base_model_ep_plan`` names
them (``"layers.*.mlp.experts": "ep_dispatch_experts"``, relative to the base model). Any other
model names its modules of that form with ``expert_parallel.modules`` (glob patterns of module
names, ``*`` one name part). Nothing found, or a module whose experts do not divide by N, is refused.

What changes in a module. Its parameters become this rank's E / N consecutive experts (real
``nn.Parameter`` s of the local shape: the optimizer, ZeRO and checkpoints see what the rank
holds), its ``num_experts`` the local count, and its forward a dispatch around its own forward:

1. every (token, k) assignment goes to the rank holding its expert, in one uneven all-to-all of
   the token's hidden state (the counts exchanged first), with its expert's local index;
2. the module's own forward runs on what arrived, with weight 1 (one expert per row);
3. the results come back by the reverse all-to-all and are weighted by ``top_k_weights`` and summed
   on the token's own rank. The router, its weights and its gradient stay local and exact; the
   all-to-all's gradient is the reverse all-to-all (``engine.distributed.collectives.all_to_all``).

Every rank of a group runs every exchange of every forward and backward, also with nothing to
send or receive (a rank whose experts got no token still joins the backward's exchanges), so
every forward is collective over the expert group: all of its ranks run the same micro-steps.

Gradients. Autograd leaves on a rank the gradient of its experts summed over every token its
expert group sent them, each weighted as its own rank's loss (the engine weights a rank's loss by
W / global, W = data × context). The whole batch's gradient is therefore the sum over the ranks
holding the same slice (the expert replicas) divided by W: :meth:`ExpertShards.reduce_gradients_`,
called where the dense parameters are averaged over data × context.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from engine.accounting import gradient_ranks
from engine.distributed.collectives import all_reduce_mean_, all_to_all, exchange_counts
from engine.distributed.group_held import GroupHeldParameters, HeldParameter
from engine.errors import ConfigError

EP_DISPATCH = "ep_dispatch_experts"  # transformers' base_model_ep_plan style of a module of experts


def _pattern(glob: str) -> re.Pattern:
    """A module-name glob: ``*`` is one name part (``layers.*.mlp.experts``)."""
    return re.compile("".join("[^.]+" if part == "*" else re.escape(part) for part in re.split(r"(\*)", glob)) + "$")


def hugging_face_patterns(model: torch.nn.Module) -> list[str]:
    """The ``ep_dispatch_experts`` entries of the model's ``base_model_ep_plan``, prefixed with the
    base model's name (a ``...ForCausalLM`` holds its base model as ``model``)."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), torch.nn.Module) else ""
    return [prefix + name for name, style in plan.items() if style == EP_DISPATCH]


def stage_expert_modules(model: torch.nn.Module, patterns: list[str] | None, stage: torch.nn.Module,
                         stages: str) -> list[str]:
    """The modules of experts of a pipeline ``stage`` (which keeps ``model``'s names): found on the whole
    ``model``, as exact names of the modules the stage holds; ``stages``: the stage numbers, for the error."""
    held = dict(stage.named_modules())
    names = [name for name in find_expert_modules(model, patterns) if name in held]
    if not names:
        raise ConfigError([f"expert_parallel: pipeline stage(s) {stages} hold no module of experts to split; "
                           "cut the model so that every stage holds some (pipeline.split), or set "
                           "expert_parallel.size: 1"])
    return names


def find_expert_modules(model: torch.nn.Module, patterns: list[str] | None) -> dict[str, torch.nn.Module]:
    """{name: module} of ``model``'s modules of experts: those ``patterns`` name (the config's
    ``expert_parallel.modules``), else the Hugging Face plan's."""
    source = "expert_parallel.modules" if patterns else "the model's base_model_ep_plan"
    patterns = patterns or hugging_face_patterns(model)
    if not patterns:
        raise ConfigError([
            f"expert_parallel: no module of experts found in {type(model).__name__}: it has no Hugging Face "
            "base_model_ep_plan naming one (transformers 5 MoE models such as Mixtral, Qwen2/3-MoE, OLMoE do); "
            "name its modules of experts with expert_parallel.modules: [glob, ...] (e.g. 'layers.*.experts'), "
            "each holding parameters [num_experts, ...], a num_experts attribute and forward(hidden_states, "
            "top_k_index, top_k_weights)"])
    compiled = [_pattern(glob) for glob in patterns]
    found = {name: module for name, module in model.named_modules() if any(p.match(name) for p in compiled)}
    if not found:
        guesses = [guess for glob in patterns if (guess := _closest_glob(model, glob))]
        hint = (f"did you mean {', '.join(repr(g) for g in guesses)}?" if guesses else
                f"its modules are named like {', '.join(name for name, _ in list(model.named_modules())[1:4])}, ...")
        raise ConfigError([f"expert_parallel: {source} ({', '.join(patterns)}) matches no module of "
                           f"{type(model).__name__}; {hint}"])
    return found


def _closest_glob(model: torch.nn.Module, glob: str) -> str | None:
    """The model's module name nearest ``glob``, its layer numbers written ``*`` (modules of experts first)."""
    import difflib

    def generic(name: str) -> str:
        return ".".join("*" if part.isdigit() else part for part in name.split("."))

    named = list(model.named_modules())[1:]
    for candidates in ({generic(name) for name, module in named if holds_experts(module)},
                       {generic(name) for name, _ in named}):
        close = difflib.get_close_matches(glob, sorted(candidates), n=1, cutoff=0.6)
        if close:
            return close[0]
    return None


def holds_experts(module: torch.nn.Module) -> bool:
    """Hugging Face's form of a module of experts: an integer ``num_experts`` and parameters of its
    own ``[num_experts, ...]`` (a router, with its ``top_k``, is not one)."""
    experts = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return (isinstance(experts, int) and not isinstance(experts, bool) and getattr(module, "top_k", None) is None
            and bool(params) and all(p.dim() >= 1 and p.shape[0] == experts for p in params))


def expert_count(name: str, module: torch.nn.Module, size: int) -> int:
    """The module's expert count, after checking it can be split over ``size`` ranks."""
    experts = getattr(module, "num_experts", None)
    params = dict(module.named_parameters(recurse=False))
    problems = []
    if not isinstance(experts, int):
        inside = [(f"{name}.{inner}" if name else inner, type(sub).__name__)
                  for inner, sub in module.named_modules() if inner and holds_experts(sub)]
        where = (f": it is not a module of experts but holds {', '.join(f'{n} ({t})' for n, t in inside)}; match "
                 "those (e.g. expert_parallel.modules: ['<pattern>.experts'])" if inside else "")
        problems.append(f"{name} ({type(module).__name__}) has no integer num_experts attribute{where}")
    elif experts % size:
        problems.append(f"{name}: its {experts} experts do not divide over expert_parallel.size {size} "
                        f"({experts} % {size} = {experts % size}): each rank holds an equal share; use a divisor "
                        f"of {experts}")
    else:
        inner = [n for n, _ in module.named_parameters() if "." in n]
        wrong = [f"{n} {tuple(p.shape)}" for n, p in params.items() if p.dim() == 0 or p.shape[0] != experts]
        if inner or wrong or not params:
            problems.append(f"{name} ({type(module).__name__}) does not hold its experts as parameters "
                            f"[num_experts={experts}, ...] of its own"
                            + (f": {', '.join(inner + wrong)}" if inner or wrong else ": it has none"))
    if problems:
        raise ConfigError([f"expert_parallel: {problem}" for problem in problems])
    return experts


class ExpertDispatch:
    """The forward of a module of experts holding ``local`` consecutive experts on each of the
    ``size`` ranks of ``group`` (its own ``forward`` runs on the tokens that arrive)."""

    def __init__(self, forward, group, size: int, local: int):
        self.forward, self.group, self.size, self.local = forward, group, size, local

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        destination = torch.div(flat, self.local, rounding_mode="floor")
        order = torch.argsort(destination, stable=True)  # the assignments grouped by the rank they go to
        send = torch.bincount(destination, minlength=self.size)
        sent, received = send.tolist(), exchange_counts(send, self.group).tolist()
        rows = torch.arange(tokens, device=flat.device).repeat_interleave(k)[order]
        arrived = all_to_all(hidden_states.index_select(0, rows), self.group, sent, received)
        local_ids = all_to_all((flat - destination * self.local)[order], self.group, sent, received)
        ones = torch.ones(len(local_ids), 1, dtype=top_k_weights.dtype, device=top_k_weights.device)
        computed = self.forward(arrived, local_ids[:, None], ones)
        if arrived.requires_grad and not computed.requires_grad:
            # Nothing arrived: the backward must still run this rank's part of both exchanges.
            computed = computed + arrived[:0].sum()
        returned = all_to_all(computed, self.group, received, sent)
        per_assignment = returned.index_select(0, torch.argsort(order)).reshape(tokens, k, -1)
        return (per_assignment * top_k_weights[..., None]).sum(1).to(hidden_states.dtype)


class ExpertShards(GroupHeldParameters):
    """The experts of one model split over the expert groups of a mesh (``engine.distributed.mesh``):
    parameters held apart (``engine.distributed.group_held``) whose forwards dispatch tokens."""

    exchanges_in_forward = True  # tokens dispatched to their expert's rank in every forward

    def __init__(self, groups, mesh_layout, rank: int):
        super().__init__()
        self.size = mesh_layout.expert
        self.index = mesh_layout.expert_index(rank)
        self.group, self.replicas_group = groups.experts, groups.expert_replicas
        self.replicas = mesh_layout.expert_replicas
        self.divisor = gradient_ranks(mesh_layout)  # the dense gradients' 1/W
        self.mesh = groups.expert_mesh

    # -- splitting ----------------------------------------------------------------------------
    @torch.no_grad()
    def apply(self, model: torch.nn.Module, patterns: list[str] | None) -> None:
        """Keep this rank's slice of every module of experts of ``model`` and wrap its forward."""
        found = find_expert_modules(model, patterns)
        counts = {name: expert_count(name, module, self.size) for name, module in found.items()}
        for name, module in found.items():
            local = counts[name] // self.size
            for param_name, param in list(module.named_parameters(recurse=False)):
                piece = torch.nn.Parameter(param.detach()[self.index * local:(self.index + 1) * local].clone(),
                                           requires_grad=param.requires_grad)
                setattr(module, param_name, piece)
                self.hold(HeldParameter(f"{name}.{param_name}", piece, param.shape))
            module.num_experts = local
            module.forward = ExpertDispatch(module.forward, self.group, self.size, local)

    # -- gradients ----------------------------------------------------------------------------
    def reduce_gradients_(self, bucket_bytes: int | None = None) -> None:
        """Each expert gradient summed over the expert replicas and divided by W = data × context
        (the dense gradients' average): the whole batch's gradient of this rank's experts."""
        grads = []
        for entry in self.parameters:
            if not entry.param.requires_grad:
                continue
            if entry.param.grad is None:  # no token reached these experts on this rank
                entry.param.grad = torch.zeros_like(entry.param)
            grads.append(entry.param.grad)
        if self.replicas > 1:
            all_reduce_mean_(grads, self.divisor, group=self.replicas_group, bucket_bytes=bucket_bytes)
        else:
            for grad in grads:
                grad.div_(self.divisor)

    # -- whole tensors, checkpoints -------------------------------------------------------------
    def whole(self, state: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
        """``state`` with every expert tensor (``prefix`` + its name) gathered whole over the expert
        group (collective: every rank of the group calls it)."""
        state = dict(state)
        for entry in self.parameters:
            key = prefix + entry.name
            if key in state:
                piece = state[key].detach().contiguous()
                pieces = [torch.empty_like(piece) for _ in range(self.size)]
                dist.all_gather(pieces, piece, group=self.group)
                state[key] = torch.cat(pieces)
        return state

    def placed(self, tensor: torch.Tensor, entry: HeldParameter) -> DTensor:
        """This rank's piece of an expert tensor (shaped like ``entry``'s parameter) as a DTensor
        sharded over the expert group and replicated over its replicas: what a checkpoint stores,
        so that it loads onto another expert size."""
        shape = (entry.full_shape[0], *tensor.shape[1:])
        return DTensor.from_local(tensor, self.mesh, [Replicate(), Shard(0)], run_check=False, shape=shape,
                                  stride=torch.empty(shape, device="meta").stride())
