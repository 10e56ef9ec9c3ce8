"""State that outlives a process: checkpoints (``checkpoint``), automatic checkpoints and
resume (``autosave``), stop signals (``preemption``) and random-number state (``rng``)."""
