"""Batches: the batch plan (``plan``), splitting a batch into micro-batches (``microbatch``),
how a window is cut (``window_split``), token budgets (``token_budget``), sizes read from a
forward's inputs (``forward_sizes``) and each rank's batches of a dataset (``data``)."""
