"""What the Engine keeps and decides per accumulation window, each part in its own module: the
window executor that runs every window as a schedule (``executor.py``; schedules: ``engine.schedule``),
the state machine (``machine.py``), the model's own loss read as (sum, count) (``model_loss.py``), the
window's records (``records.py``), where the ranks are when they compare positions (``positions.py``),
what a non-finite gradient does (``non_finite.py``), what a loss must look like (``loss_checks.py``), the
hooks told at fixed points (``hooks.py``), and a pipeline's window in its stages' form (``stages.py``). Every weight and divisor:
``engine.accounting``; a model's routers: ``engine.experts.window``."""
