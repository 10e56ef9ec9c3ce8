"""Pipeline parallelism: how a model is cut into stages (``split``). The stages' strategy is
``engine.strategies.pipeline``; a window runs as a ``torch.distributed.pipelining`` schedule
through ``engine.pipeline_windows``."""
