"""Activation checkpointing (and the block discovery compile shares) from the config: the
repeated blocks found, gradients equal to the run without it (dropout included) at every
stage, activation bytes saved for backward counted."""

import copy
import warnings

import pytest
import torch

import engine
from bench.model_transforms import lm, lm_loss, saved_activation_bytes, tokens
from engine.config.schema import load_config
from engine.strategies.model_transforms import apply_activation_checkpointing, repeated_blocks
from tests.support.dist_utils import run_scenarios
from tests.support.reference import max_param_diff, state
from tests.support.scenarios import CHECKPOINTING, checkpointing_case, every_stage_and_precision

def train(model, batch, **features):
    eng = engine.initialize(copy.deepcopy(model), {"train_batch_size": 8, "gradient_accumulation_steps": 2, **features},
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    torch.manual_seed(7)  # the same dropout draws in every run
    eng.train_batch(batch, lm_loss)
    return state(eng.module)


def preserving_no_rng(monkeypatch):
    """The broken variant: recomputation draws fresh dropout masks."""
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda fn, *args, **kwargs: original(fn, *args, **{**kwargs, "preserve_rng_state": False}))


def test_checkpointed_blocks_give_the_gradients_of_the_run_without_dropout_included(monkeypatch):
    model, batch = lm(layers=2, width=32, dropout=0.2), tokens(8, 24)
    without = train(model, batch)
    assert max_param_diff(train(model, batch, **CHECKPOINTING), without) < 1e-6  # measured 0
    preserving_no_rng(monkeypatch)
    assert max_param_diff(train(model, batch, **CHECKPOINTING), without) > 1e-3


def test_checkpointing_drops_the_activation_bytes_saved_for_backward():
    model, batch = lm(layers=4, width=64), tokens(4, 96)
    without = saved_activation_bytes(model, model, batch)
    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(repeated_blocks(checkpointed))
    with_checkpointing = saved_activation_bytes(checkpointed, checkpointed, batch)
    # what is left: each block's input, the embeddings, the final norm and the logits
    assert with_checkpointing < 0.25 * without, (with_checkpointing, without)
    # autograd's saved-tensor hooks alone (what engine.memory.PeakMeter counts on CPU) see the
    # blocks' inputs too: the non-reentrant checkpoint saves them through autograd
    seen = {}

    def pack(tensor):
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    parameters = {p.untyped_storage().data_ptr() for p in checkpointed.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        lm_loss(checkpointed, batch)
    assert sum(n for pointer, n in seen.items() if pointer not in parameters) == with_checkpointing


# -- which blocks ------------------------------------------------------------------------------------
def test_blocks_auto_are_the_repeated_layers_or_a_hugging_face_models_no_split_modules():
    model = lm(layers=3)
    assert repeated_blocks(model) == list(model.blocks)
    model._no_split_modules = ["CausalSelfAttention"]
    assert repeated_blocks(model) == [block.attn for block in model.blocks]
    assert repeated_blocks(model, ("Block",)) == list(model.blocks)
    assert len(apply_activation_checkpointing(repeated_blocks(model, ("Block",)), every=2)) == 2


def test_unknown_block_classes_and_models_without_blocks_are_clear_errors():
    with pytest.raises(engine.ConfigError, match="no module of class Layer; its classes are .*Block"):
        engine.initialize(lm(), {"train_batch_size": 4, "activation_checkpointing": {"enabled": True, "blocks": ["Layer"]}},
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(engine.ConfigError, match="auto found no repeated blocks"):
        engine.initialize(torch.nn.Linear(4, 4), {"train_batch_size": 4, **CHECKPOINTING},
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


@pytest.mark.parametrize("section, message", [
    ({"enabled": "yes"}, "activation_checkpointing.enabled: expected true, false or auto"),
    ({"enabled": True, "blocks": "Block"}, "activation_checkpointing.blocks: expected auto or a list"),
    ({"enabled": True, "every": 0}, "activation_checkpointing.every: expected a positive integer"),
])
def test_bad_checkpointing_sections_are_refused(section, message):
    with pytest.raises(engine.ConfigError, match=message):
        engine.initialize(lm(), {"train_batch_size": 4, "activation_checkpointing": section},
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_deepspeed_checkpointing_keys_are_named_in_a_note_and_the_section_is_not_called_unused():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config({"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False}})
    notes = [str(w.message) for w in caught]
    assert len(notes) == 1, notes
    assert "cpu_checkpointing, partition_activations configure DeepSpeed's own checkpoint function" in notes[0]
    assert "set activation_checkpointing.enabled: true" in notes[0]


# -- every stage, two ranks ------------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_checkpointing_equals_the_run_without_it_at_every_stage():
    scenarios = every_stage_and_precision(checkpointing_case)
    for case, diffs in run_scenarios(scenarios, world_size=2, timeout=150).items():
        assert max(diffs) < 1e-6, (case, diffs)
