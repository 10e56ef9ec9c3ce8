"""Processes: the process group from the launcher's environment (``process_group``), the
collectives the engine agrees through (``collectives``), torchrun's agent store
(``agent_store``) and the check that every rank runs the same settings (``rank_consistency``)."""
