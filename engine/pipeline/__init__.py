"""Pipeline parallelism: how a model is cut into stages (``stages``: a Hugging Face model by its
own pipeline plan, ``hf_plan``; any other as a sequence of modules, ``split``). The stages'
strategy is ``engine.strategies.pipeline``; a window runs as a schedule (``engine.schedule``'s orders,
``engine.strategies.stage_schedules``) through ``engine.window.stages``."""
