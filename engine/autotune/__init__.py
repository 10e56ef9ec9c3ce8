"""Automatic micro-batch sizes: the tuner behind ``auto`` / ``explore`` (``tuner``) and the
explore report and plot (``report``)."""
