"""What the Hugging Face examples (hf_trainer_clm.py, trl_sft.py) build locally instead of downloading: a
byte-level tokenizer (every byte one token, no merges) and tiny models from a config."""

from __future__ import annotations


def byte_tokenizer():
    """A tokenizer of the 256 bytes and ``<|endoftext|>`` (end of text and padding), built without files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    end = "<|endoftext|>"
    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab[end] = len(vocab)
    words = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    words.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    words.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=words, eos_token=end, pad_token=end)


def tiny_model(model_type: str, vocab_size: int, seed: int = 0):
    """A two-layer ``llama`` or ``mixtral`` (4 experts, top 2, its router loss on) of width 32."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if model_type == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if model_type == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                            router_aux_loss_coef=0.02, **common)
        return transformers.MixtralForCausalLM(config)
    raise ValueError(f"model_type must be llama or mixtral; got {model_type!r}")
