"""The DeepSpeed names Microstep does not provide, each refused with what to use instead.

A refused name raises :class:`NotProvidedError` (an ``ImportError``) where the script reaches it:
``from engine.compat.deepspeed.pipe import PipelineModule``, ``deepspeed.init_inference(...)``,
``model_engine.train_batch()``. Its message is one line naming the replacement; docs/migrating.md
lists the same names ("Not provided") and tests/integration/test_compat_deepspeed_zero3.py checks
that the two agree.
"""
from __future__ import annotations

from engine.errors import MicrostepError

__all__ = ["NotProvidedError", "NOT_PROVIDED", "refusal", "refusing_getattr"]

_PIPELINE = ("the config's pipeline section with engine.initialize(model, config) and "
             "eng.train_batch((inputs, labels), loss_fn) (docs/parallelism.md: Pipeline parallelism)")
_OWN_LAYERS = "train the model's own layers (e.g. a Hugging Face model's); Microstep has no DeepSpeed kernels"

# name as a DeepSpeed script writes it -> what to use instead
NOT_PROVIDED = {
    "deepspeed.pipe": f"DeepSpeed's pipeline engine: use {_PIPELINE}",
    "deepspeed.PipelineModule": f"DeepSpeed's pipeline engine: use {_PIPELINE}",
    "deepspeed.ops.sparse_attention": "block-sparse attention kernels: use the model's own attention "
                                      "(torch.nn.functional.scaled_dot_product_attention)",
    "deepspeed.ops.transformer": f"DeepSpeed's fused transformer layer: {_OWN_LAYERS}",
    "deepspeed.DeepSpeedTransformerLayer": f"DeepSpeed's fused transformer layer: {_OWN_LAYERS}",
    "deepspeed.DeepSpeedTransformerConfig": f"DeepSpeed's fused transformer layer: {_OWN_LAYERS}",
    "deepspeed.module_inject": f"kernel injection replaces layers by DeepSpeed's kernels: {_OWN_LAYERS}",
    "deepspeed.replace_transformer_layer": f"kernel injection replaces layers by DeepSpeed's kernels: {_OWN_LAYERS}",
    "deepspeed.ops.lamb": "torch has no LAMB optimizer: use a torch.optim optimizer "
                          "(deepspeed.ops.adam.FusedAdam here is torch's Adam / AdamW), or DeepSpeed itself for LAMB",
    "deepspeed.moe.layer": "DeepSpeed's MoE layer: a Hugging Face mixture-of-experts model (Mixtral, Qwen-MoE, "
                           "OLMoE, ...) trains as it is, with expert_parallel.size for expert parallelism (docs/moe.md)",
    "deepspeed.init_inference": "DeepSpeed's inference engine: call the model (or model.generate) directly",
    "deepspeed.DeepSpeedConfig": "DeepSpeed's parsed config object: read the JSON with json.load, or "
                                 "engine.load_config(path) for Microstep's reading of it",
    "deepspeed.runtime.config.DeepSpeedConfig": "DeepSpeed's parsed config object: read the JSON with json.load, "
                                                "or engine.load_config(path) for Microstep's reading of it",
    "deepspeed.tp_model_init": "tensor parallelism is the config's tensor_parallel.autotp_size, applied by "
                               "deepspeed.initialize",
    "deepspeed.runtime.data_pipeline": "DeepSpeed's curriculum and data-efficiency pipeline: feed the batches "
                                       "from the script's own data loader",
    "engine.train_batch": f"DeepSpeed's pipeline engine's method: use {_PIPELINE}",
    "engine.eval_batch": "DeepSpeed's pipeline engine's method: use the config's pipeline section with "
                         "engine.initialize(model, config) and eng.eval_batch((inputs, labels), loss_fn)",
}


class NotProvidedError(MicrostepError, ImportError):
    """A DeepSpeed name Microstep does not provide; the message says what to use."""


def refusal(name: str) -> NotProvidedError:
    """The error for ``name`` (a key of ``NOT_PROVIDED``, or a name under one)."""
    key = name
    while key not in NOT_PROVIDED and "." in key:
        key = key.rsplit(".", 1)[0]
    return NotProvidedError(f"{name} is not provided by Microstep ({NOT_PROVIDED[key]})")


def refusing_getattr(module_name: str):
    """A module ``__getattr__`` refusing every name of ``module_name`` (a key of ``NOT_PROVIDED``)."""

    def __getattr__(name: str):
        if name.startswith("__"):  # the import machinery's and tools' questions: the usual answer
            raise AttributeError(name)
        raise refusal(f"{module_name}.{name}")

    return __getattr__
