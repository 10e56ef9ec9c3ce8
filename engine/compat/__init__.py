"""Drop-in entry points for scripts written against other engines' APIs, over one
:class:`engine.Engine`: ``engine.compat.deepspeed`` and ``engine.compat.colossalai``
(see docs/migrating.md). Imported on demand: ``import engine`` does not load them."""

from __future__ import annotations

from engine.batching.plan import SEARCH_MODES
from engine.config.schema import Config, locate
from engine.errors import ConfigError


def refuse_engine_formed_micro_batches(config: Config, loop: str) -> None:
    """A facade's loop (``engine(x)``, ``backward``, ``step``) forms its micro-batches itself,
    so settings that let the engine form them (``train_batch`` only) are refused up front,
    not at the first backward."""
    problems = []
    micro = config.train_micro_batch_size_per_gpu
    if micro in SEARCH_MODES:
        placeholder = (" ('auto' in a DeepSpeed JSON written for the Hugging Face Trainer is a placeholder the "
                       "Trainer fills in)") if micro == "auto" else ""
        problems.append(f"train_micro_batch_size_per_gpu: {micro!r}: give a number{placeholder}; the {loop} loop "
                        "forms its own micro-batches, one per engine(x) / backward / step, so their size cannot "
                        "be chosen by the engine")
    if config.micro_batch_tokens is not None:
        problems.append(f"micro_batch_tokens: the {loop} loop forms its own micro-batches, one per engine(x) / "
                        "backward / step, so they cannot be formed by tokens; remove micro_batch_tokens and give "
                        "train_micro_batch_size_per_gpu (the size of the micro-batches the script forms)")
    if config.pipeline.stages > 1:
        problems.append(f"pipeline.stages: {config.pipeline.stages}: under a pipeline the accumulation steps are the "
                        f"schedule's micro-batches, which the {loop} loop (one engine(x) / backward / step per "
                        "micro-batch) cannot drive; train with engine.initialize(model, config) and "
                        "eng.train_batch((inputs, labels), loss_fn) (docs/parallelism.md: Pipeline parallelism)")
    if problems:
        raise ConfigError(locate(config, problems))
