"""What the Engine keeps and decides per accumulation window, each part in its own module: the
state machine (``machine.py``), every weight and divisor (``accounting.py``), the model's own loss
read as (sum, count) (``model_loss.py``), evaluation (``evaluation.py``), the window's records
(``records.py``), where the ranks are when they compare positions (``positions.py``), what a
non-finite gradient does (``non_finite.py``), what a loss must look like (``loss_checks.py``), the
hooks told at fixed points (``hooks.py``), and who runs a window's micro-steps (``runner.py``: the
protocol; ``pipeline.py``: a pipeline's schedule; the router counts of a window before its
backwards: the routers' module here)."""
