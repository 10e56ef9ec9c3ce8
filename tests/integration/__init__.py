"""End to end through the user's entry points: examples, docs commands, the CLI and launcher, the
DeepSpeed / Colossal-AI facades, Hugging Face model families, verify, bench.gpu."""
