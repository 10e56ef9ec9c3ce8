"""Attention within each document of packed rows (``packing: true``), without a mask over the row:
where the documents are (``documents``), the kernels that attend within them (``kernels``), and
the Hugging Face registration that puts them in a model (``hugging_face``), applied by
``engine.strategies.parallelize`` when packing is on."""
