"""Batch planning: how a global batch is cut across ranks and micro-steps.

W = data-parallel world size, G = global batch (``train_batch_size``),
M = micro-batch cap per device, A = accumulation steps, P = per-device batch.

* ``strict`` (default): G = M·A·W exactly, every micro-batch holds M samples.
* ``balanced``: the first G mod W ranks hold ⌈G/W⌉ samples, the rest ⌊G/W⌋; every rank
  runs the same A micro-steps and splits its P into A near-equal micro-batches, none
  larger than M and none empty.
* ``micro_batch_tokens`` (a token budget): P is split per window by padded tokens
  (``engine.batching.token_budget``), so the micro-steps follow from the row lengths; G is
  required, A is not given (the plan holds A = 1), and M only caps the rows of a
  micro-batch (default: P).
* data-defined (a config giving only A, Colossal-AI's usual): G, M and P are whatever the
  script's own data loader yields. ``plan_from_config`` returns ``data_defined_plan``; the
  engine weights every micro-batch by its real size and sums a window's samples over the
  ranks at its boundary.

This module is pure: no torch, no processes. ``resolve_batch_plan`` validates the numbers
and raises ``BatchConfigError`` with the equation and the nearest valid values.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from engine.errors import BatchConfigError

logger = logging.getLogger("engine")

SPLIT_MODES = ("strict", "balanced")
SEARCH_MODES = ("auto", "explore")
DATA_DEFINED = "data"  # micro_batch_mode of a plan whose batch sizes come from the data


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """`total` cut into `parts` near-equal pieces, the larger ones first."""
    base, extra = divmod(total, parts)
    return (base + 1,) * extra + (base,) * (parts - extra)


def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


def _join(values) -> str:
    return ",".join(str(v) for v in values)


def _rank_range(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


@dataclass(frozen=True)
class BatchPlan:
    """A resolved plan for one rank (``rank``); ``for_rank`` gives the same plan for another.

    Build it with ``resolve_batch_plan``, which checks the numbers. The stored fields are
    G, M (the micro-batch cap), A and W; per-rank sizes are derived from them: G is cut
    into near-equal per-device batches, each into A near-equal micro-batches (all equal
    to M in strict mode).

    When ``micro_batch_mode`` is ``"auto"`` or ``"explore"`` the plan is provisional: it
    holds the starting candidate (the whole per-device batch, capped by ``auto_max``) and
    the engine replaces it through ``with_micro_batch_size`` once it has measured.

    With ``micro_batch_tokens`` set, micro-batches are formed per window by padded tokens
    (rows × longest row within the budget): M is the most rows one may hold, A is 1 and
    ``micro_batch_sizes`` is the whole per-device batch, since the number of micro-steps
    follows from each window's lengths. ``auto`` / ``explore`` then move the budget
    (``with_micro_batch_tokens``), never G.

    When it is ``"data"`` (``data_defined_plan``) only A and W are known: G and M are None
    and the per-device sizes raise ``BatchConfigError``; the data decides them.
    """

    world_size: int
    train_batch_size: int | None  # None: data-defined
    train_micro_batch_size_per_gpu: int | None  # None: data-defined
    gradient_accumulation_steps: int
    batch_split: str = "strict"
    rank: int = 0
    micro_batch_mode: str = "fixed"
    notes: tuple[str, ...] = ()
    micro_batch_tokens: int | None = None  # the token budget, when micro-batches are formed by tokens

    @property
    def is_provisional(self) -> bool:
        """True while the engine still searches the micro-batch size (auto / explore)."""
        return self.micro_batch_mode in SEARCH_MODES

    @property
    def is_data_defined(self) -> bool:
        """True when the data loader, not the config, sizes the batches (only A was given)."""
        return self.micro_batch_mode == DATA_DEFINED

    # -- sizes -------------------------------------------------------------------------
    @property
    def per_device_batch_sizes(self) -> tuple[int, ...]:
        if self.is_data_defined:
            raise BatchConfigError(
                f"this plan has no batch sizes: the config gives only gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}), so each micro-batch is whatever the data loader "
                "yields (weighted by its real size); set train_batch_size or "
                "train_micro_batch_size_per_gpu to plan the sizes")
        return split_evenly(self.train_batch_size, self.world_size)

    @property
    def per_device_batch_size(self) -> int:
        return self.per_device_batch_sizes[self.rank]

    def micro_batch_sizes_for_rank(self, rank: int) -> tuple[int, ...]:
        # In strict mode P = M·A, so the even split gives A micro-batches of exactly M.
        return split_evenly(self.per_device_batch_sizes[rank], self.gradient_accumulation_steps)

    @property
    def micro_batch_sizes(self) -> tuple[int, ...]:
        return self.micro_batch_sizes_for_rank(self.rank)

    def window_samples(self, k: int) -> int:
        """Samples over all ranks in the first `k` micro-steps of a window (k = A gives G)."""
        if not 0 <= k <= self.gradient_accumulation_steps:
            raise ValueError(f"k must be in 0..{self.gradient_accumulation_steps}, got {k}")
        return sum(count * sum(split_evenly(p, self.gradient_accumulation_steps)[:k])
                   for p, count in self._rank_kinds())

    def _rank_kinds(self) -> list[tuple[int, int]]:
        """(per-device batch, number of ranks holding it), larger batches first."""
        sizes = self.per_device_batch_sizes
        return [(p, sizes.count(p)) for p in sorted(set(sizes), reverse=True)]

    # -- re-planning -------------------------------------------------------------------
    def for_rank(self, rank: int) -> BatchPlan:
        _check_rank(rank, self.world_size)
        return dataclasses.replace(self, rank=rank)

    def with_micro_batch_size(self, micro: int) -> BatchPlan:
        """The same global batch, world size, split, rank and mode with cap `micro`."""
        _check_positive_int("micro-batch size", micro)
        if self.batch_split == "strict" and self.per_device_batch_size % micro:
            raise BatchConfigError(
                f"micro-batch size {micro} does not divide the per-device batch "
                f"{self.per_device_batch_size}; valid sizes: {_join(self.candidate_micro_sizes())}")
        plan = resolve_batch_plan(self.world_size, self.train_batch_size, micro,
                                  batch_split=self.batch_split, rank=self.rank)
        return dataclasses.replace(plan, micro_batch_mode=self.micro_batch_mode)

    def with_micro_batch_tokens(self, tokens: int) -> BatchPlan:
        """The same plan with token budget `tokens` (a plan that splits by tokens)."""
        if self.micro_batch_tokens is None:
            raise BatchConfigError("with_micro_batch_tokens() needs a plan that splits by tokens "
                                   "(micro_batch_tokens set)")
        _check_positive_int("micro_batch_tokens", tokens)
        return dataclasses.replace(self, micro_batch_tokens=tokens)

    def candidate_micro_sizes(self) -> tuple[int, ...]:
        """Micro sizes that give a valid plan, ascending.

        Balanced: 1..max P, minus the sizes that would leave some rank an empty micro-batch.
        """
        if self.batch_split == "strict":
            return _divisors(self.per_device_batch_size)
        largest, smallest = max(self.per_device_batch_sizes), min(self.per_device_batch_sizes)
        return tuple(m for m in range(1, largest + 1) if math.ceil(largest / m) <= smallest)

    def next_smaller_micro_size(self) -> int | None:
        """The next size to try after running out of memory, or None at the bottom."""
        if self.batch_split == "strict":
            smaller = [d for d in _divisors(self.per_device_batch_size)
                       if d < self.train_micro_batch_size_per_gpu]
            return smaller[-1] if smaller else None
        # Halve the largest micro-batch actually run: halving a cap above it changes nothing.
        biggest = max(self.micro_batch_sizes_for_rank(0))
        if biggest == 1:
            return None
        fitting = [m for m in self.candidate_micro_sizes() if m <= max(1, biggest // 2)]
        return fitting[-1] if fitting else None

    # -- display -----------------------------------------------------------------------
    def describe(self) -> str:
        if self.is_data_defined:
            return self._describe_data_defined()
        rows = [("world size", str(self.world_size)),
                ("global batch", str(self.train_batch_size))]
        first = 0
        for p, count in self._rank_kinds():
            micro = self.micro_batch_sizes_for_rank(first)
            split = "micro-batches by tokens" if self.micro_batch_tokens else f"micro-batches {_join(micro)}"
            rows.append((_rank_range(first, first + count - 1), f"{p} samples, {split}"))
            first += count
        provisional = f" ({self.micro_batch_mode}: provisional, the engine picks the final size)"
        if self.micro_batch_tokens:
            budget = f"{self.micro_batch_tokens} padded tokens (rows x longest row) per micro-batch"
            if self.micro_batch_mode != "fixed":
                budget += f" ({self.micro_batch_mode}: the starting budget, shrunk on out-of-memory)"
            rows += [("token budget", budget),
                     ("rows per micro-batch", f"at most {self.train_micro_batch_size_per_gpu}"),
                     ("micro-steps", "per window, from the lengths; the same on every rank")]
        else:
            cap = str(self.train_micro_batch_size_per_gpu)
            rows += [("micro-batch cap", cap + (provisional if self.micro_batch_mode != "fixed" else "")),
                     ("accumulation steps", str(self.gradient_accumulation_steps))]
        rows.append(("batch split", self.batch_split))
        return self._table(rows)

    def _describe_data_defined(self) -> str:
        return self._table([
            ("world size", str(self.world_size)),
            ("global batch", "defined by the data: every rank's samples in a window, summed at its boundary"),
            ("micro-batches", "as the data loader yields them, each weighted by its real size"),
            ("accumulation steps", str(self.gradient_accumulation_steps))])

    def _table(self, rows) -> str:
        width = max(len(label) for label, _ in rows) + 2
        lines = [f"{label + ':':<{width}}{value}" for label, value in rows]
        return "\n".join(lines + [f"note: {note}" for note in self.notes])


# -- validation helpers ----------------------------------------------------------------
def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BatchConfigError(f"{name} must be a positive integer, got {value!r} "
                               f"({type(value).__name__})")
    if value < 1:
        raise BatchConfigError(f"{name} must be a positive integer, got {value}")


def _check_rank(rank, world_size: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise BatchConfigError(f"rank must be an integer in 0..{world_size - 1} "
                               f"for world size {world_size}, got {rank!r}")


def _either(values) -> str:
    return " or ".join(str(v) for v in values)


def _nearest_multiples(value: int, step: int) -> list[int]:
    """The positive multiples of `step` just below and above `value`."""
    below = value // step * step
    above = below + step if below != value else below
    return [v for v in sorted({below, above}) if v > 0]


def _nearest_divisors(n: int, value: int) -> list[int]:
    divisors = _divisors(n)
    below = [d for d in divisors if d <= value][-1:]
    above = [d for d in divisors if d >= value][:1]
    return sorted(set(below + above))


_BALANCED_HINT = " (or set batch_split: balanced)"


def _valid_global(g: int, step: int) -> str:
    return f"nearest valid train_batch_size: {_either(_nearest_multiples(g, step))}"


def _valid_divisor(name: str, per_device: int, value: int) -> str:
    return (f"or {name} {_either(_nearest_divisors(per_device, value))} "
            f"(divisors of the per-device batch {per_device})")


# -- strict ----------------------------------------------------------------------------
def _strict(world: int, g, m, a) -> tuple[int, int, int]:
    if g is None:
        return m * (a or 1) * world, m, a or 1
    if g % world:
        raise BatchConfigError(
            f"train_batch_size {g} is not divisible by world size {world} "
            f"({g} / {world} = {g / world:g} per device); "
            f"{_valid_global(g, world * (m or 1) * (a or 1))}{_BALANCED_HINT}")
    per_device = g // world
    if m is not None and a is not None:
        if m * a * world != g:
            # Keep M and W (what memory and hardware fix) and let A follow the new G.
            near = _nearest_multiples(g, m * world)
            fixes = [f"{_valid_global(g, m * world)}, with gradient_accumulation_steps "
                     f"{_either(v // (m * world) for v in near)}"]
            if per_device % m == 0:
                fixes.append(f"or gradient_accumulation_steps {per_device // m}")
            if per_device % a == 0:
                fixes.append(f"or train_micro_batch_size_per_gpu {per_device // a}")
            raise BatchConfigError(
                f"train_batch_size {g} != micro {m} × accumulation {a} × world {world} = "
                f"{m * a * world}; {'; '.join(fixes)}{_BALANCED_HINT}")
        return g, m, a
    if m is not None:
        if per_device % m:
            raise BatchConfigError(
                f"train_batch_size {g} is not divisible by micro {m} × world {world} = "
                f"{m * world}; {_valid_global(g, m * world)}; "
                f"{_valid_divisor('train_micro_batch_size_per_gpu', per_device, m)}"
                f"{_BALANCED_HINT}")
        return g, m, per_device // m
    a = a or 1
    if per_device % a:
        raise BatchConfigError(
            f"train_batch_size {g} is not divisible by accumulation {a} × world {world} = "
            f"{a * world}; {_valid_global(g, a * world)}; "
            f"{_valid_divisor('gradient_accumulation_steps', per_device, a)}{_BALANCED_HINT}")
    return g, per_device // a, a


# -- balanced --------------------------------------------------------------------------
def _balanced(world: int, g, m, a) -> tuple[int, int, int]:
    if g is None:
        return m * (a or 1) * world, m, a or 1
    largest, smallest = math.ceil(g / world), g // world
    accumulation_given = a is not None
    if a is None:
        m = m or largest
        a = math.ceil(largest / m)
    elif m is None:
        m = math.ceil(largest / a)
    elif math.ceil(largest / a) > m:
        raise BatchConfigError(
            f"gradient_accumulation_steps {a} splits a per-device batch of {largest} into "
            f"micro-batches of {math.ceil(largest / a)} > micro {m}; use "
            f"gradient_accumulation_steps >= {math.ceil(largest / m)}")
    if a > smallest:
        if accumulation_given:
            fix = (f"gradient_accumulation_steps <= {smallest}, "
                   f"or train_batch_size >= {world * a}")
        else:
            fix = (f"train_micro_batch_size_per_gpu >= {math.ceil(largest / smallest)}, or "
                   f"train_batch_size to a multiple of {world} "
                   f"({_either(_nearest_multiples(g, world))})")
        raise BatchConfigError(
            f"balanced plan leaves rank {world - 1} an empty micro-batch: it holds {smallest} "
            f"sample(s) for {a} micro-steps (train_batch_size {g} over world {world}); "
            f"set {fix}")
    return g, m, a


def _balanced_notes(plan: BatchPlan) -> tuple[str, ...]:
    notes = []
    kinds = plan._rank_kinds()
    if len(kinds) > 1:
        (big, n_big), (small, _) = kinds
        notes.append(f"train_batch_size {plan.train_batch_size} does not divide by world size "
                     f"{plan.world_size}: {_rank_range(0, n_big - 1)} get {big} samples, "
                     f"{_rank_range(n_big, plan.world_size - 1)} get {small}")
    for p, _ in kinds:
        micro = split_evenly(p, plan.gradient_accumulation_steps)
        if len(set(micro)) > 1:
            notes.append(f"per-device batch {p} does not divide into "
                         f"{plan.gradient_accumulation_steps} equal micro-batches: {_join(micro)}")
    return tuple(notes)


# -- entry points ----------------------------------------------------------------------
def resolve_batch_plan(world_size, train_batch_size=None, train_micro_batch_size_per_gpu=None,
                       gradient_accumulation_steps=None, batch_split="strict", rank=0,
                       auto_max=None, micro_batch_tokens=None) -> BatchPlan:
    """Resolve G, M and A for `world_size` ranks; see the module docstring for the rules.

    ``train_micro_batch_size_per_gpu`` may be ``"auto"`` or ``"explore"``: then G is
    required, A must not be given, and the returned plan is provisional — M is the whole
    per-device batch (capped by ``auto_max``) until the engine calls
    ``with_micro_batch_size``.

    ``micro_batch_tokens``: micro-batches formed by padded tokens (see ``BatchPlan``); an
    integer M (or ``auto_max`` under ``auto`` / ``explore``) caps their rows.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise BatchConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    _check_rank(rank, world_size)
    if batch_split not in SPLIT_MODES:
        raise BatchConfigError(f"batch_split must be 'strict' or 'balanced', got {batch_split!r}")
    g, m, a = train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
    mode = m if m in SEARCH_MODES else "fixed"
    if isinstance(m, str) and mode == "fixed":
        raise BatchConfigError("train_micro_batch_size_per_gpu must be a positive integer, "
                               f"'auto' or 'explore', got {m!r}")
    for name, value in (("train_batch_size", g), ("gradient_accumulation_steps", a),
                        ("auto_max", auto_max), ("train_micro_batch_size_per_gpu",
                                                 None if mode != "fixed" else m)):
        if value is not None:
            _check_positive_int(name, value)
    if g is not None and g < world_size:
        raise BatchConfigError(
            f"train_batch_size {g} is smaller than world size {world_size}: every rank needs "
            f"at least one sample; use train_batch_size >= {world_size}")
    if micro_batch_tokens is not None:
        return _token_plan(world_size, g, m, a, batch_split, rank, mode, auto_max, micro_batch_tokens)
    if g is None and m is None:
        hint = " (gradient_accumulation_steps alone does not fix the batch)" if a is not None else ""
        raise BatchConfigError(f"set train_batch_size or train_micro_batch_size_per_gpu{hint}")
    if mode != "fixed":
        m = _starting_micro_size(mode, world_size, g, a, batch_split, auto_max)

    resolve = _strict if batch_split == "strict" else _balanced
    g, m, a = resolve(world_size, g, m, a)
    return _with_notes(BatchPlan(world_size, g, m, a, batch_split, rank, mode))


def _with_notes(plan: BatchPlan) -> BatchPlan:
    if plan.batch_split != "balanced":
        return plan
    notes = _balanced_notes(plan)
    for note in notes:
        logger.info("batch_split balanced: %s", note)
    return dataclasses.replace(plan, notes=notes)


# -- by tokens -------------------------------------------------------------------------
def token_budget_conflicts(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
                           auto_max) -> list[tuple[str, str]]:
    """(key, problem) for each batch key ``micro_batch_tokens`` cannot be combined with;
    needs no world size, so ``python -m engine validate`` reports them too."""
    problems = []
    if train_batch_size is None:
        problems.append(("micro_batch_tokens", "needs train_batch_size: the global batch (rows per "
                         "optimizer step) stays fixed while its micro-batches are formed by tokens"))
    if gradient_accumulation_steps is not None:
        problems.append(("gradient_accumulation_steps", "micro_batch_tokens chooses each window's "
                         "micro-steps from the row lengths; remove gradient_accumulation_steps"))
    if auto_max is not None and train_micro_batch_size_per_gpu not in SEARCH_MODES:
        problems.append(("auto_max", "with micro_batch_tokens, auto_max caps the rows of a micro-batch "
                         "under train_micro_batch_size_per_gpu auto / explore; a fixed cap is "
                         "train_micro_batch_size_per_gpu itself"))
    return problems


def _token_plan(world: int, g, m, a, batch_split: str, rank: int, mode: str, auto_max,
                tokens) -> BatchPlan:
    _check_positive_int("micro_batch_tokens", tokens)
    conflicts = token_budget_conflicts(g, m, a, auto_max)
    if conflicts:
        raise BatchConfigError("; ".join(f"{key}: {problem}" for key, problem in conflicts))
    if batch_split == "strict" and g % world:
        raise BatchConfigError(f"train_batch_size {g} is not divisible by world size {world}; "
                               f"{_valid_global(g, world)}{_BALANCED_HINT}")
    cap = (auto_max if mode != "fixed" else m) or math.ceil(g / world)
    return _with_notes(BatchPlan(world, g, cap, 1, batch_split, rank, mode, micro_batch_tokens=tokens))


def search_mode_conflicts(mode, train_batch_size, gradient_accumulation_steps) -> list[str]:
    """What ``train_micro_batch_size_per_gpu: auto / explore`` cannot be combined with; needs
    no world size, so ``python -m engine validate`` reports it too."""
    problems = []
    if train_batch_size is None:
        problems.append(f"train_micro_batch_size_per_gpu {mode!r} needs train_batch_size: the global batch is "
                        "what stays fixed while the micro size moves")
    if gradient_accumulation_steps is not None:
        problems.append(f"train_micro_batch_size_per_gpu {mode!r} derives gradient_accumulation_steps; remove "
                        "gradient_accumulation_steps (on the command line: --set gradient_accumulation_steps=null)")
    return problems


def world_free_batch_problems(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps,
                              batch_split, auto_max, micro_batch_tokens) -> list[str]:
    """The batch keys' problems that no world size can fix: what ``resolve_batch_plan`` (via
    ``plan_from_config``) refuses whatever the number of processes (``validate`` runs it)."""
    g, m, a = train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps
    if micro_batch_tokens is not None:
        return [f"{key}: {problem}" for key, problem in token_budget_conflicts(g, m, a, auto_max)]
    if m in SEARCH_MODES:
        return search_mode_conflicts(m, g, a)
    if g is None and m is None:
        return [] if a is not None else ["set train_batch_size or train_micro_batch_size_per_gpu"]
    if batch_split == "strict" and None not in (g, m, a) and all(isinstance(v, int) for v in (g, m, a)) and g % (m * a):
        return [f"train_batch_size {g} must be train_micro_batch_size_per_gpu {m} × gradient_accumulation_steps {a} "
                f"× world size, and {g} / ({m} × {a}) = {g / (m * a):.4g} is no whole number of processes; "
                f"{_valid_global(g, m * a)}, or remove one of the three (it is then derived), or set "
                "batch_split: balanced"]
    return []


def _starting_micro_size(mode, world, g, a, batch_split, auto_max) -> int:
    conflicts = search_mode_conflicts(mode, g, a)
    if conflicts:
        raise BatchConfigError(conflicts[0])
    cap = auto_max or g
    if batch_split == "balanced":
        return min(math.ceil(g / world), cap)
    if g % world:
        raise BatchConfigError(f"train_batch_size {g} is not divisible by world size {world}; "
                               f"{_valid_global(g, world)}{_BALANCED_HINT}")
    return max(d for d in _divisors(g // world) if d <= cap)


def data_defined_plan(world_size, gradient_accumulation_steps, rank=0, notes=()) -> BatchPlan:
    """A plan whose batch sizes come from the data: A micro-steps per window on every rank,
    each micro-batch as large as the data loader makes it (Colossal-AI's usual config)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise BatchConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    _check_rank(rank, world_size)
    _check_positive_int("gradient_accumulation_steps", gradient_accumulation_steps)
    return BatchPlan(world_size, None, None, gradient_accumulation_steps, "strict", rank, DATA_DEFINED,
                     tuple(notes))


def plan_from_config(config, world_size: int, rank: int = 0) -> BatchPlan:
    """The plan for `config` (an ``engine.Config``) on `world_size` ranks: a config giving
    only ``gradient_accumulation_steps`` gets a ``data_defined_plan``."""
    if (config.train_batch_size is None and config.train_micro_batch_size_per_gpu is None
            and config.gradient_accumulation_steps is not None):
        notes = ["batch_split has no effect: the data defines the batches"] if config.batch_split == "balanced" else []
        return data_defined_plan(world_size, config.gradient_accumulation_steps, rank, notes)
    try:
        return resolve_batch_plan(world_size, config.train_batch_size,
                                  config.train_micro_batch_size_per_gpu,
                                  config.gradient_accumulation_steps, config.batch_split,
                                  rank, config.auto_max, config.micro_batch_tokens)
    except BatchConfigError as error:  # the keys as the user wrote them (an alias: batch_size, ...)
        raise BatchConfigError(config.as_written(str(error))) from None
