"""What the Engine keeps and decides per accumulation window, each part in its own module: the
window's records and totals (``records.py``), where the ranks are when they compare positions
(``positions.py``), and what a non-finite gradient does (``non_finite.py``)."""
