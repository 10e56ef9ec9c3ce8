"""Small Hugging Face models and the losses their users write, shared by the tests that train
them through the pipeline plan or activation checkpointing (tests/integration/test_pipeline_hf.py,
test_checkpointing_hf.py): a Llama and a GPT-2 of a few layers, token batches as (input_ids,
labels), the (sum, count) and mean token losses on the model's outputs, and the plain model's
full-batch run. transformers is imported inside the factories, so that importing this module
needs no transformers."""

import copy
import functools

import torch
import torch.nn.functional as F

import engine
from tests.support.pipeline_helpers import token_batches as pipeline_token_batches
from tests.support.reference import sgd

# Llama's RMSNorm normalises in float32 inside the float64 model, its backward included: the
# gradient flowing through it is rounded to float32 at whatever scale the loss has. The engine
# back-propagates each micro-batch loss times W_dp / G and corrects by G / U at the boundary;
# the reference divides by U at once, so their float32 roundings differ (measured 8.4e-9 after
# three steps; the same scaling in one process without a pipeline: 9.5e-9; with the norm in
# float64 both agree to 1e-16). A wrong gradient misses by far more (summed micro-batches: above 1e-2).
TOL = 1e-7
VOCAB = 16


def llama_config(layers=4, vocab=VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                       attn_implementation="eager")


def llama(layers=4, seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(layers)).double()


token_batches = functools.partial(pipeline_token_batches, vocab=VOCAB)


# The user's losses: on the model's outputs, the same with and without a pipeline.
@engine.loss_on_outputs
def token_sum(outputs, labels):
    loss = F.cross_entropy(outputs.logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


@engine.loss_on_outputs
def token_mean(outputs, labels):
    loss, count = token_sum.on_outputs(outputs, labels)
    return loss / count


def reference_run(model, batches, clip=0.0):
    """The plain model on each whole global batch, SGD with momentum: the trained copy."""
    model = copy.deepcopy(model)
    optimizer = sgd(model.parameters())
    for tokens, labels in batches:
        optimizer.zero_grad()
        loss, count = token_sum.on_outputs(model(tokens), labels)
        (loss / count).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16))
