"""Which way a model is cut into pipeline stages: a Hugging Face model by its own pipeline plan
(``engine.pipeline.hf_plan``), any other as a sequence of modules (``engine.pipeline.split``).

Either way the result has ``pieces`` (each stage's parts, ``(name, module)`` under the model's
own names) and ``stage(index, forward_context, own_outputs)``, the module that runs stage
``index`` and whose ``model_outputs(value)`` is what ``loss_fn`` sees of a last stage's output.
"""

from __future__ import annotations

from torch import nn

from engine.errors import ConfigError
from engine.pipeline.hf_plan import PlanSplit, is_hugging_face_model, plan_of
from engine.pipeline.split import SequenceSplit


def split_model(model: nn.Module, stages: int, split, per_rank: int = 1) -> PlanSplit | SequenceSplit:
    """``model`` cut into ``stages`` consecutive stages as ``split`` (auto, uniform, names) asks;
    ``per_rank``: how many of them each pipeline rank holds (the schedule's), for the errors."""
    if not is_hugging_face_model(model):
        return SequenceSplit(model, stages, split, per_rank)
    plan = plan_of(model)
    if plan is None:
        raise ConfigError([
            f"pipeline.stages: {stages}: {type(model).__name__} is a Hugging Face model without a pipeline plan "
            "(its config's base_model_pp_plan is empty), which says where it may be cut; run it with "
            "pipeline.stages: 1 (ZeRO-3 or tensor_parallel shard it instead), or give its config class a "
            "base_model_pp_plan (embeddings, the list of decoder layers, the final norm), as Llama's has"])
    return PlanSplit(model, plan, stages, split, per_rank)
