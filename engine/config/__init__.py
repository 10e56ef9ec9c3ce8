"""Configs: the schema (``schema``), reading YAML / JSON / Python files (``loaders``, ``raw``),
Colossal-AI and DeepSpeed spellings (``colossalai``, ``deepspeed``, ``offload``) and the checks
that need no model (``checks``). ``engine.Config`` and ``engine.load_config`` are the public names."""
