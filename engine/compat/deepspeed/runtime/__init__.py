"""``deepspeed.runtime``: the names scripts reach under it: ``config`` (optimizer names), ``engine``
(``DeepSpeedEngine``), ``dataloader``, ``utils`` (``set_random_seed``), ``zero.partition_parameters``
(``ZeroParamStatus``); ``data_pipeline`` is not provided (its names say what to use)."""

from engine.compat.deepspeed.runtime import config, data_pipeline, dataloader, engine, utils, zero

__all__ = ["config", "data_pipeline", "dataloader", "engine", "utils", "zero"]
