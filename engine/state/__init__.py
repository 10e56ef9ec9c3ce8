"""State that outlives a process: checkpoints of stateful parts (``checkpoint``), written in the
background (``async_save``), stop signals (``preemption``) and random-number state (``rng``).
When automatic checkpoints are taken is the engine hook ``engine.autosave``."""
