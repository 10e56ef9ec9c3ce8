"""Pipeline parallelism: how a model is cut into stages (``stages``: a Hugging Face model by its
own pipeline plan, ``hf_plan``; any other as a sequence of modules, ``split``). The stages'
strategy is ``engine.strategies.pipeline``; a window runs as a ``torch.distributed.pipelining``
schedule through ``engine.window.pipeline``."""
