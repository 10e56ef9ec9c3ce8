"""Pipeline parallelism: how a model is cut into stages (``split``) and how a window runs as a
``torch.distributed.pipelining`` schedule (``runner``; the stages' strategy is
``engine.strategies.pipeline``)."""
