"""DeepSpeed's config keys as Microstep reads them: the keys it keeps for the DeepSpeed backend
(top level, ``zero_optimization``, ``checkpoint``), which of them a config holds, and what the
DeepSpeed backend refuses. What the torch backend makes of DeepSpeed's offload keys is
``engine.config.offload``."""
from __future__ import annotations

import json
import os

import torch

from engine.config.torch_features import without_our_keys

# Top-level DeepSpeed keys Microstep itself does not use: kept for the DeepSpeed backend.
DEEPSPEED_TOP_LEVEL_KEYS = frozenset({
    "steps_per_print", "wall_clock_breakdown", "prescale_gradients", "gradient_predivide_factor",
    "communication_data_type", "seq_parallel_communication_data_type",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
    "data_types", "amp", "autotuning", "elasticity", "aio", "memory_breakdown",
    "dump_state", "sparse_gradients", "torch_autocast", "compile", "dataloader_drop_last",
    "disable_allgather", "gradient_allreduce_op", "data_efficiency", "curriculum_learning",
    "sparse_attention", "hybrid_engine", "eigenvalue",
    "progressive_layer_drop", "quantize_training", "compression_training", "timers", "nebula",
    "use_data_before_expert_parallelism", "use_node_local_storage", "log_level",
    "disable_python_gc",
})

# DeepSpeed's pipeline keys besides ``stages`` and ``partition`` (which map): kept, not used.
DEEPSPEED_PIPELINE_KEYS = frozenset({
    "seed_layers", "activation_checkpoint_interval", "pipe_partitioned", "grad_partitioned",
    "use_reentrant"})

# Keys DeepSpeed accepts under zero_optimization besides the ones modelled below.
DEEPSPEED_ZERO_KEYS = frozenset({
    "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "overlap_comm", "use_multi_rank_bucket_allreduce",
    "compute_grad_norm", "load_from_fp32_weights", "elastic_checkpoint", "offload_param",
    "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "round_robin_gradients", "ignore_unused_parameters",
    "legacy_stage1", "parameter_alignment", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory",
    "leaf_module", "mics_shard_size", "mics_hierarchical_params_gather",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
    "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential",
})

# DeepSpeed's keys of its tensor_parallel section besides autotp_size (read as tensor_parallel.size).
DEEPSPEED_TENSOR_PARALLEL_KEYS = frozenset({
    "dtype", "tp_overlap_comm", "tensor_parallel", "injection_policy_tuple", "keep_module_on_host",
    "replace_with_kernel_inject", "partition_config", "preset_model", "tp_size", "tp_grain_size", "mpu", "tp_group",
})

# DeepSpeed's AutoEP keys of the expert_parallel section besides enabled / autoep_size (which map): kept, not used.
DEEPSPEED_EXPERT_PARALLEL_KEYS = frozenset({
    "expert_tensor_parallel_size", "validate_folding_routing", "async_split_plan", "preset_model",
    "moe_layer_pattern", "expert_pattern", "router_pattern", "use_grouped_mm", "disable_triton_grouped_mm",
    "route_norm", "route_scale", "score_apply", "combine_impl", "row_weighting_impl", "gate_up_impl",
    "comm_backend", "comm_num_sm", "comm_qp_margin", "comm_max_tokens_per_rank", "num_expert_groups",
    "num_limited_groups", "score_func", "top_k", "load_balance_coeff", "routed_scaling_factor",
})

# DeepSpeed's own keys of the checkpoint section, handed to the DeepSpeed backend.
DEEPSPEED_CHECKPOINT_KEYS = frozenset({
    "tag_validation", "load_universal", "use_node_local_storage", "parallel_write",
    "checkpoint_serialization", "writer",
})


def deepspeed_only_settings(config) -> list[str]:
    """DeepSpeed keys the config holds (top level and inside sections), sorted."""
    names = list(config.deepspeed_extras)
    for section in ("zero_optimization", "fp16", "bf16", "checkpoint", "pipeline", "tensor_parallel"):
        names += [f"{section}.{key}" for key in (getattr(config, section).model_extra or {})]
    return sorted(names)


def read_autotp_size(section: dict, where: str) -> str | None:
    """DeepSpeed's ``tensor_parallel.autotp_size`` as ``tensor_parallel.size``, in place; a
    problem when both are given and differ."""
    if "autotp_size" not in section:
        return None
    autotp = section.pop("autotp_size")
    if "size" in section and section["size"] != autotp:
        return (f"{where}: tensor_parallel.autotp_size: {autotp!r} conflicts with tensor_parallel.size: "
                f"{section['size']!r} (autotp_size is DeepSpeed's name for size; keep one)")
    section["size"] = autotp
    return None


# Set to 1 on a CPU-only machine whose oneDNN supports fp16 (DeepSpeed's CPU accelerator then runs it):
# lifts the backend's CPU refusal of fp16 on this machine (docs/deepspeed.md).
CPU_FP16_SWITCH = "MICROSTEP_DEEPSPEED_CPU_FP16"


def deepspeed_backend_problems(config) -> list[str]:
    """What the DeepSpeed backend refuses, as config problems (checked before DeepSpeed starts)."""
    problems = []
    zero = config.zero_optimization
    if config.fp16.enabled and not torch.cuda.is_available() and os.environ.get(CPU_FP16_SWITCH) != "1":
        problems.append(
            "fp16.enabled: backend deepspeed runs fp16 on CUDA GPUs only, and this machine has none (DeepSpeed's "
            "CPU accelerator supports fp16 only on some CPUs, so the same config would start on one machine and "
            "fail on another); use bf16: {enabled: true}, or backend: torch (its fp16 autocast and loss scaler "
            f"run on CPU); {CPU_FP16_SWITCH}=1 lifts this on a CPU whose oneDNN supports fp16")
    op = config.deepspeed_extras.get("gradient_allreduce_op", "mean")
    if op != "mean":
        problems.append(
            f"gradient_allreduce_op: {op!r}: Microstep weights every micro-batch loss by its share of the "
            "global batch and relies on DeepSpeed averaging gradients over ranks; remove the key")
    if "writer" in (config.checkpoint.model_extra or {}):
        problems.append(
            "checkpoint.writer: DeepSpeed's checkpoint writers change when and by whom the files are written "
            "(decoupled: by a background process after the save returned; FAST: by some data-parallel ranks "
            "only; MOCK: not at all), while a Microstep checkpoint lists every file with its size and is "
            "published (renamed into place, older ones removed by keep_last) only once they are all written; "
            "remove the key")
    micro = config.train_micro_batch_size_per_gpu
    if micro in ("auto", "explore") and zero.stage == 3:
        problems.append(
            f"train_micro_batch_size_per_gpu: {micro} with backend deepspeed needs ZeRO stage 0, 1 or 2: "
            "DeepSpeed's ZeRO-3 communicates inside every forward, where one rank's out-of-memory cannot be "
            "agreed on without a hang. Give a number, or use backend: torch (its ZeRO-3 supports auto and "
            "keeps ZeRO-3 memory)")
    elif micro in ("auto", "explore") and zero.stage == 2 and zero.defer_reduction is not True:
        problems.append(
            f"train_micro_batch_size_per_gpu: {micro} with backend deepspeed at ZeRO stage 2 needs "
            "zero_optimization.defer_reduction: true: DeepSpeed's ZeRO-2 reduces inside every backward, where "
            "one rank's out-of-memory cannot be agreed on without a hang; deferring holds full-size gradients "
            "until the window's end instead. Or use backend: torch, whose ZeRO-2 keeps its memory under auto")
    if config.tensor_parallel.size > 1:
        problems.append(
            f"tensor_parallel.size: {config.tensor_parallel.size}: tensor parallelism runs on backend: torch "
            "(DTensor composed with FSDP2); backend deepspeed trains data-parallel only here. Set backend: "
            "torch, or the size to 1")
    return problems


# Microstep keys that do not exist in DeepSpeed's zero_optimization section.
_OUR_ZERO_KEYS = {"defer_reduction", "shard_unit_size", "shard_size"}


def deepspeed_config(config, world_size: int) -> dict:
    """The DeepSpeed config for a Microstep config: batch keys that leave accumulation to
    Microstep, clipping stated explicitly (DeepSpeed's default is 1.0), DeepSpeed-only keys
    passed through. Optimizer and scheduler are not translated: Microstep builds torch ones
    and hands the instances over, so both backends train identically."""
    zero = config.zero_optimization.model_dump()
    for key in _OUR_ZERO_KEYS:
        zero.pop(key, None)
    if zero["stage"] == 3:
        # Otherwise ZeRO-3 patches torch.nn.functional.linear for the whole process.
        zero.setdefault("memory_efficient_linear", False)
    ds = json.loads(json.dumps(without_our_keys(config.deepspeed_extras)))  # a deep copy: DeepSpeed may edit it
    ds.update({
        "train_batch_size": world_size,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": config.gradient_clipping,
        "zero_optimization": zero,
    })
    if config.checkpoint.model_extra:  # DeepSpeed's own checkpoint keys (the rest is Microstep's)
        ds["checkpoint"] = json.loads(json.dumps(config.checkpoint.model_extra))
    if config.fp16.enabled:
        ds["fp16"] = config.fp16.model_dump()
    if config.bf16.enabled:
        ds["bf16"] = config.bf16.model_dump()
    # Microstep always hands DeepSpeed a torch optimizer instance: any type is fine with us
    # (DeepSpeed refuses untested ones at ZeRO-1..3), and with offload_optimizer it steps
    # on the CPU copy (DeepSpeed refuses client optimizers there unless told otherwise).
    ds.setdefault("zero_allow_untested_optimizer", True)
    ds.setdefault("zero_force_ds_cpu_optimizer", False)
    return ds
