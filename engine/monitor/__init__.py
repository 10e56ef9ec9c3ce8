"""Training metrics: one record per optimizer step (``metrics.py``: files, TensorBoard, wandb,
progress, plots) and the throughput figures in it (``throughput.py``: MFU)."""

from engine.monitor.metrics import FIELDS, Monitor, plot_expert_load

__all__ = ["Monitor", "FIELDS", "plot_expert_load"]
