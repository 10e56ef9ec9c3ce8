"""Tests that start several ranks: run_distributed / run_scenarios, or the launcher / torchrun with
more than one process per node."""
