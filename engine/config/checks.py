"""Checks of a loaded config that need no model: ``check_without_model(config)``.

``python -m engine validate`` runs them after ``load_config``, and ``engine.initialize``
before building anything (no process group is joined for a config that cannot run), so
both report the same problems, all at once:

* optimizer / scheduler: the type is known, every ``params`` name is a parameter of it,
  no ``'auto'`` placeholder, and the values are accepted (built on a stand-in parameter);
* precision: this machine's device (CUDA when available, else CPU) runs autocast in the
  enabled dtype, bf16 on CUDA only where the GPU supports it;
* backend: ``backend: deepspeed`` needs the deepspeed package installed (looked up, not
  imported) and a config the DeepSpeed backend accepts; ``backend: torch`` an offload
  request FSDP2 can carry out (``engine.config.offload``);
* batch keys: what the planner refuses at any world size
  (``engine.batching.plan.world_free_batch_problems``: ``auto`` / ``explore`` micro sizes with
  ``gradient_accumulation_steps`` or without ``train_batch_size``, three strict batch numbers no
  process count satisfies, ``micro_batch_tokens`` with the keys it cannot be combined with),
  ``sequence_keys`` without ``micro_batch_tokens``;
* ``packing: true``: needs ``micro_batch_tokens``, refused under a pipeline;
* pipeline: what cannot run under more than one stage (another backend, zero-bubble at ZeRO 3,
  batches whose micro-batches neither the plan nor a token budget fixes);
* ``activation_checkpointing: auto``: needs the automatic micro size, which chooses it;
* context parallelism: what it does not compose with (another backend, the automatic micro
  size);
* expert parallelism: the same (another backend, the automatic micro size);
* context parallelism refuses ``moe.load_balance: micro_batch`` (a rank sees a part of every sequence);
* hybrid sharding (``engine.config.sharding``): a shard group size at ZeRO 2 / 3 on backend torch
  only, one value however it is spelled.
"""
from __future__ import annotations

import warnings
from importlib.util import find_spec

import torch

from engine.adapters.deepspeed_internals import INSTALL_HINT
from engine.batching.plan import SEARCH_MODES, world_free_batch_problems
from engine.config.deepspeed import deepspeed_backend_problems
from engine.config.schema import Config, locate, torch_sections
from engine.config.sharding import shard_size_problems
from engine.config.torch_features import model_transforms_requested
from engine.config.optim import check_sections


def check_without_model(config: Config) -> list[str]:
    """Every problem found, as ``<where>: <key.path>: <problem>`` lines (empty: none)."""
    problems = check_sections(config.optimizer, config.scheduler)
    problems += _precision_problems(config)
    problems += _batch_problems(config)
    problems += _packing_problems(config)
    problems += _pipeline_problems(config)
    problems += _mesh_precision_problems(config)
    problems += _automatic_checkpointing_problems(config)
    problems += _expert_problems(config)  # [moe]
    problems += _context_problems(config)
    problems += shard_size_problems(config)
    if config.backend == "deepspeed":
        if find_spec("deepspeed") is None:
            problems.append(INSTALL_HINT)
        problems += deepspeed_backend_problems(config)
        problems += model_transforms_requested(config.deepspeed_extras)[2]
    else:
        problems += torch_sections(config).problems
    return locate(config, problems)


def _expert_problems(config: Config) -> list[str]:
    """What ``expert_parallel.size`` > 1 does not run with (docs/moe.md, "Expert parallelism"), and a
    way of counting the window's routers where no window is counted."""
    problems = []
    if config.moe.load_balance == "micro_batch" and config.moe.global_counts != "auto":
        problems.append(f"moe.global_counts: {config.moe.global_counts} says how the window's router counts are "
                        "learnt for the global load-balancing term, but moe.load_balance: micro_batch takes each "
                        "forward's own term and counts nothing; drop global_counts, or set load_balance: global")
    size = config.expert_parallel.size
    if size == 1:
        return problems
    where = f"with expert_parallel.size {size}"
    if config.backend != "torch":
        problems.append(f"backend: {config.backend} is not available {where}: DeepSpeed's expert parallelism needs "
                        "its own layer (deepspeed.moe.layer.MoE) in the model, Microstep's splits a Hugging Face "
                        "model's experts as they are on backend: torch; set backend: torch")
    problems += _automatic_micro_size_refused(config, where, "inside an expert leaves its expert group waiting in "
                                              "the all-to-all")
    return problems


def _automatic_checkpointing_problems(config: Config) -> list[str]:
    checkpointing = model_transforms_requested(config.deepspeed_extras)[0]
    if checkpointing is None or not checkpointing.automatic:
        return []
    if config.pipeline.stages > 1:
        return [f"activation_checkpointing.enabled: auto is not available under a pipeline of {config.pipeline.stages} "
                "stages (the pipeline's automatic micro size shrinks on an out-of-memory but does not switch "
                "checkpointing, which its failed stages' stand-ins and cached schedules were not built for); write "
                "true or false"]
    if config.train_micro_batch_size_per_gpu in SEARCH_MODES:
        return []
    return ["activation_checkpointing.enabled: auto is chosen by the automatic micro-batch size (it measures or "
            "tries each micro size with and without checkpointing); set train_micro_batch_size_per_gpu: auto or "
            "explore (with micro_batch_tokens too: the budget is then tuned), or activation_checkpointing.enabled: "
            "true or false"]


def _context_problems(config: Config) -> list[str]:
    """What ``context_parallel.size`` > 1 does not run with (docs/context_parallel.md)."""
    size = config.context_parallel.size
    if size == 1:
        return []
    where, problems = f"with context_parallel.size {size}", []
    if config.backend != "torch":
        problems.append(f"backend: {config.backend} is not available {where}: Microstep's context parallelism (and "
                        "DeepSpeed's sequence_parallel_size, read as it) runs on backend: torch; set backend: torch")
    if config.moe.load_balance == "micro_batch":
        problems.append(f"moe.load_balance: micro_batch is not available {where}: each rank's forward sees a part of "
                        "every sequence, so a model's own per-forward load-balancing term would be its part's, not "
                        "the micro-batch's; use moe.load_balance: global (the window's counts over every part, exact)")
    problems += _automatic_micro_size_refused(config, where, "inside attention leaves its context group waiting in "
                                              "the exchange")
    return problems


def _automatic_micro_size_refused(config: Config, where: str, stall: str) -> list[str]:
    """``auto`` / ``explore`` micro sizes under a dimension whose collectives run inside the forward:
    a rank that runs out of memory there (``stall``: what it leaves waiting) cannot vote."""
    mode = config.train_micro_batch_size_per_gpu
    if mode not in SEARCH_MODES:
        return []
    return [f"train_micro_batch_size_per_gpu: {mode!r} is not available {where} (a rank that runs out of memory "
            f"{stall}); give a number"]


def _mesh_precision_problems(config: Config) -> list[str]:
    """Under a tensor or pipeline mesh half precision is autocast over fp32 parameters
    (engine.config.setup), so gradients accumulate in fp32: a half-precision accumulation asked for
    would not happen."""
    if config.backend != "torch" or (config.tensor_parallel.size == 1 and config.pipeline.stages == 1):
        return []
    accumulation = torch_sections(config).features.grad_accum_dtype
    if accumulation == "fp32":
        return []
    return [f"data_types.grad_accum_dtype: {accumulation} is not available under tensor_parallel.size "
            f"{config.tensor_parallel.size} × pipeline.stages {config.pipeline.stages}: there half precision is "
            "autocast over fp32 parameters and gradients accumulate in fp32; remove grad_accum_dtype"]


def _batch_problems(config: Config) -> list[str]:
    """What the planner refuses at any world size (the token budget's conflicts included)."""
    problems = world_free_batch_problems(config.train_batch_size, config.train_micro_batch_size_per_gpu,
                                         config.gradient_accumulation_steps, config.batch_split, config.auto_max,
                                         config.micro_batch_tokens)
    if config.micro_batch_tokens is None and config.sequence_keys is not None:
        problems.append("sequence_keys: names the tensors micro_batch_tokens trims, but micro_batch_tokens is not "
                        "set; set it, or remove sequence_keys")
    return problems


def _packing_problems(config: Config) -> list[str]:
    """``packing: true`` packs the micro-batches a token budget forms, without a pipeline
    (engine.batching.packing)."""
    if not config.packing:
        return []
    problems = []
    if config.micro_batch_tokens is None:
        problems.append("packing: true packs each micro-batch's documents into one row of at most micro_batch_tokens "
                        "tokens, but micro_batch_tokens is not set; set it (e.g. micro_batch_tokens: 16384, the "
                        "tokens of one packed row), or remove packing")
    if config.pipeline.stages > 1:
        problems.append(f"packing: true is not available under a pipeline of {config.pipeline.stages} stages: its "
                        "schedule runs micro-batches of one shape per window, and packed rows differ in length; use "
                        "micro_batch_tokens without packing (bucketed), or pipeline.stages: 1")
    return problems


def _pipeline_problems(config: Config) -> list[str]:
    stages = config.pipeline.stages
    if stages == 1:
        return []
    problems = []
    if config.backend != "torch":
        problems.append(f"pipeline.stages: {stages} stages run on backend torch only (torch.distributed.pipelining); "
                        "set backend: torch")
    if config.zero_optimization.stage == 3 and config.pipeline.schedule == "zero_bubble":
        # measured: torch's V schedule then applies wrong weight gradients (its split backward
        # and FSDP's resharding after forward), silently
        problems.append("pipeline.schedule: zero_bubble does not train exactly with ZeRO stage 3 (torch's zero-bubble "
                        "V schedule computes wrong weight gradients on stages resharded after their forward); use "
                        "zero_optimization.stage 2, or another schedule")
    problems += _automatic_micro_size_problems(config)
    if config.train_batch_size is None and config.train_micro_batch_size_per_gpu is None:
        problems.append(f"pipeline.stages: a pipeline of {stages} stages runs the plan's micro-batches; give "
                        "train_batch_size or train_micro_batch_size_per_gpu besides gradient_accumulation_steps")
    return problems


def _automatic_micro_size_problems(config: Config) -> list[str]:
    """What ``auto`` cannot do under a pipeline (docs/autotune.md): a stage that fails stands in
    for its layers for the rest of the schedule (engine.strategies.stage_failures), which the
    collectives inside a sharded or tensor-split stage, and the zero-bubble schedule's split
    backward, do not allow; ``explore`` is not built for a schedule."""
    mode, stages = config.train_micro_batch_size_per_gpu, config.pipeline.stages
    if mode not in ("auto", "explore"):
        return []
    where = f"under a pipeline of {stages} stages"
    if mode == "explore":
        return [f"train_micro_batch_size_per_gpu: 'explore' is not available {where} (it measures candidate sizes "
                "outside the schedule); use 'auto' (an out-of-memory on any stage halves the micro size) or a number"]
    problems = []
    if config.micro_batch_tokens is not None:
        problems.append(f"train_micro_batch_size_per_gpu: 'auto' {where} is not available with micro_batch_tokens (the "
                        "token budget chooses each window's micro-batches for the schedule, which the automatic size "
                        "would replace by a fixed plan); give a number")
    if config.zero_optimization.stage >= 2 or (config.backend == "torch" and torch_sections(config).offload.to_host):
        problems.append(f"train_micro_batch_size_per_gpu: 'auto' {where} runs on stages FSDP2 does not shard "
                        "(zero_optimization.stage 0 or 1 without offload: a stage that runs out of memory skips its "
                        "layers for the rest of the window, which FSDP's collectives inside them do not allow); use "
                        "stage 0, or give a number")
    if config.tensor_parallel.size > 1:
        problems.append(f"train_micro_batch_size_per_gpu: 'auto' {where} is not available with tensor_parallel.size "
                        f"{config.tensor_parallel.size} (the layers a failed stage skips hold tensor-parallel "
                        "collectives); give a number")
    if config.pipeline.schedule == "zero_bubble":
        problems.append(f"train_micro_batch_size_per_gpu: 'auto' {where} is not available with pipeline.schedule "
                        "zero_bubble (its split backward); use gpipe, 1f1b or interleaved, or give a number")
    if config.auto_memory_limit is not None:
        problems.append(f"auto_memory_limit: not available {where} (it measures one process's forward); remove it, "
                        "out-of-memory errors on any stage still shrink the micro size")
    return problems


def _precision_problems(config: Config) -> list[str]:
    key, dtype = ("fp16", torch.float16) if config.fp16.enabled else ("bf16", torch.bfloat16)
    if not getattr(config, key).enabled:
        return []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return [f"bf16.enabled: this GPU ({torch.cuda.get_device_name()}) has no bf16 support; "
                "use fp16.enabled instead"]
    with warnings.catch_warnings(record=True) as caught:  # torch warns and turns autocast off
        warnings.simplefilter("always")
        with torch.autocast(device, dtype=dtype):
            pass
    if caught:
        return [f"{key}.enabled: autocast on {device} does not run in {dtype} with torch "
                f"{torch.__version__} ({caught[0].message}); disable it or use the other half precision"]
    return []
