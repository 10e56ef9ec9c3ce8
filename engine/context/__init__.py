"""Context parallelism: every sequence split over the ranks of a context group
(``context_parallel: {size, method, labels}``). ``sharding``: which part of each sequence a
rank holds and the batch it is handed (labels, positions, token counts); ``ulysses``: attention
over whole sequences by all-to-all between sequence and heads; ``ring``: attention over whole
sequences by passing keys and values round the group, blocks merged by log-sum-exp; ``parallel``: what the
strategy's ``parallelize`` installs on the model and the engine calls. docs/context_parallel.md."""
