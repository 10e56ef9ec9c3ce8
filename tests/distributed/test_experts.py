"""Mixture-of-experts load balancing over the global batch (engine.experts) against the float64
full-batch reference, with the broken variants the promise rules out."""

from __future__ import annotations

import copy
import functools
import logging
import weakref
from types import SimpleNamespace

import pytest
import torch

import engine
from engine.experts.balance import micro_batch_term
from tests.support import broken
from tests.support.dist_utils import run_scenarios
from tests.support.moe_models import (OwnMoE, deepseek_v3, float64_term, full_batch_loss, hf_loss, hf_moe, lm_batches,
                              lm_sum_with_balance, own_mean_loss, own_sum_loss, train_with_bias_updates)
from tests.support.reference import max_param_diff, rank_slice, reference_train, sgd, state

pytest.importorskip("transformers")

TOL = 1e-10
# Hugging Face's routers compute their probabilities in float32 (``router_logits.float()``): the routing
# weights' gradient rounds there, by an amount that depends on the loss's scale, which with padding
# differs between a micro-batch and the full batch (dense batches happen to scale by powers of two).
TOL_FLOAT32_ROUTER = 1e-8
MISSES = 1e3 * TOL  # a broken variant is at least this far
# A Hugging Face model's own ``.loss`` is read as its sum over the micro-batch's tokens
# (engine.window.model_loss): transformers' float32 cross entropy is scaled by the count and then by
# 1 / U, where the full batch divides by U at once (measured 3.3e-9 after two steps).
HF_TOL = TOL_FLOAT32_ROUTER


def reference(model, batches, loss_fn):
    with float64_term(model):
        return state(reference_train(model, batches, loss_fn, sgd))


def moe_engine(model, global_batch=8, accumulation=4, **config):
    return engine.initialize(model, {"train_batch_size": global_batch, "gradient_accumulation_steps": accumulation,
                                     **config}, optimizer=sgd)


def trained(model, batches, loss_fn, breaking=broken.intact, **config):
    eng = breaking(moe_engine(copy.deepcopy(model), **config))
    for batch in batches:
        eng.train_batch(rank_slice(batch, eng.plan), loss_fn)
    return eng


@pytest.mark.parametrize("kind", ["mixtral", "olmoe", "qwen2_moe"])
@pytest.mark.parametrize("counts", ["count_forward", "hold_forwards"])
def test_accumulation_4_equals_the_full_batch_load_balancing_included(kind, counts):
    model, batches = hf_moe(kind), lm_batches(2, 8)
    expected = reference(model, batches, hf_loss)
    eng = trained(model, batches, hf_loss, moe={"global_counts": counts})
    assert eng.experts.global_counts == counts
    # .loss is read as its sum over the micro-batch's tokens (engine.window.model_loss): transformers'
    # float32 cross entropy is then scaled by the count, not by 1 / U at once as in the full batch
    assert max_param_diff(eng.full_state_dict(), expected) < TOL_FLOAT32_ROUTER
    if counts == "count_forward":  # the reported loss is the full batch's, its term included
        with float64_term(model):
            first = float(reference_train(model, batches[:1], hf_loss, sgd)(**batches[1]).loss.detach())
        assert float(eng.last_window.loss) == pytest.approx(first, rel=1e-6)
    per_micro_batch = trained(model, batches, hf_loss, broken.moe_micro_batch_term)
    assert max_param_diff(per_micro_batch.full_state_dict(), expected) > MISSES
    if counts == "count_forward":
        running = trained(model, batches, hf_loss, broken.moe_running_average)
        assert max_param_diff(running.full_state_dict(), expected) > MISSES


def test_the_definition_is_hugging_faces_own():
    """The float64 reference's term is transformers' (which accumulates in float32) to float32 rounding."""
    model, batches = hf_moe(), lm_batches(2, 8)
    eng = trained(model, batches, hf_loss)
    transformers_own = state(reference_train(model, batches, hf_loss, sgd))
    assert max_param_diff(eng.full_state_dict(), transformers_own) < 1e-7
    batch = lm_batches(1, 8, padded=True)[0]
    out = model(**batch)
    ours = micro_batch_term(out.router_logits, 4, 2, batch["attention_mask"])
    assert abs(float(ours.detach()) - float(out.aux_loss.detach())) < 1e-6 * float(out.aux_loss.detach())


@pytest.mark.parametrize("counts", ["count_forward", "hold_forwards"])
def test_padded_rows_with_the_sum_count_form(counts):
    """Padding excluded through the attention mask from the term and from the token count, as the
    full batch's ``.loss`` does; the language-model part as (sum, count)."""
    model, batches = hf_moe(), lm_batches(2, 8, padded=True)
    expected = reference(model, batches, full_batch_loss(model.config.router_aux_loss_coef))
    loss_fn = lm_sum_with_balance(model.config.router_aux_loss_coef)
    eng = trained(model, batches, loss_fn, moe={"global_counts": counts})
    assert max_param_diff(eng.full_state_dict(), expected) < TOL_FLOAT32_ROUTER
    if counts == "count_forward":  # (sum, count): the term counts once in the reported loss too
        with float64_term(model):
            stepped = reference_train(model, batches[:1], full_batch_loss(model.config.router_aux_loss_coef), sgd)
            first = float(full_batch_loss(model.config.router_aux_loss_coef)(stepped, batches[1]))
        assert float(eng.last_window.loss) == pytest.approx(first, rel=1e-9)
    per_micro_batch = trained(model, batches, loss_fn, broken.moe_micro_batch_term)
    assert max_param_diff(per_micro_batch.full_state_dict(), expected) > 1e3 * TOL_FLOAT32_ROUTER
    # The same in float64 throughout (a router of one's own): exact.
    own, padded = OwnMoE(), lm_batches(2, 8, padded=True)
    expected = state(reference_train(own, padded, own_mean_loss, sgd))
    eng = trained(own, padded, own_sum_loss, moe={"global_counts": counts})
    assert max_param_diff(eng.full_state_dict(), expected) < TOL
    per_micro_batch = trained(own, padded, own_sum_loss, broken.moe_micro_batch_term)
    assert max_param_diff(per_micro_batch.full_state_dict(), expected) > MISSES


def test_a_router_of_ones_own():
    model, batches = OwnMoE(), lm_batches(2, 8)
    expected = state(reference_train(model, batches, own_mean_loss, sgd))
    loss_fn = own_mean_loss
    eng = trained(model, batches, loss_fn)
    assert eng.experts is not None and eng.experts.own_terms
    assert max_param_diff(eng.full_state_dict(), expected) < TOL
    per_micro_batch = trained(model, batches, loss_fn, broken.moe_micro_batch_term)
    assert max_param_diff(per_micro_batch.full_state_dict(), expected) > MISSES


def test_micro_batch_reproduces_what_the_model_computes_per_forward():
    """moe.load_balance: micro_batch is a plain accumulation of each forward's own ``.loss``."""
    model, batches = hf_moe(), lm_batches(2, 8)
    by_hand = copy.deepcopy(model)
    optimizer = sgd(by_hand.parameters())
    for batch in batches:
        optimizer.zero_grad()
        for k in range(4):
            (by_hand(**{key: value[2 * k:2 * k + 2] for key, value in batch.items()}).loss / 4).backward()
        optimizer.step()
    eng = trained(model, batches, hf_loss, moe={"load_balance": "micro_batch"})
    assert max_param_diff(eng.full_state_dict(), state(by_hand)) < HF_TOL


def test_router_jitter_is_drawn_again_in_the_training_forwards(caplog):
    """Randomness in the forward (Mixtral's router jitter): the counting forward's generators are
    restored, so the training forwards route alike, and both ways of counting agree."""
    model, batches = hf_moe(router_jitter_noise=0.5), lm_batches(2, 8)
    for block in model.model.layers:
        block.mlp.jitter_noise = 0.5
    torch.manual_seed(7)
    counted = trained(model, batches, hf_loss, moe={"global_counts": "count_forward"})
    torch.manual_seed(7)
    held = trained(model, batches, hf_loss, moe={"global_counts": "hold_forwards"})
    assert counted.experts.routing_differences == 0
    assert max_param_diff(counted.full_state_dict(), held.full_state_dict()) < TOL


def test_the_manual_loop_refuses_global_balance_and_names_train_batch():
    model, batch = hf_moe(), lm_batches(1, 8)[0]
    eng = moe_engine(model)
    with pytest.raises(engine.EngineUsageError, match=r"eng.train_batch\(batch, loss_fn\).*micro_batch"):
        eng(**{key: value[:2] for key, value in batch.items()})
    eng = moe_engine(hf_moe(), moe={"load_balance": "micro_batch"})
    for k in range(4):
        eng.backward(eng(**{key: value[2 * k:2 * k + 2] for key, value in batch.items()}).loss)
        eng.step()
    assert eng.global_steps == 1


def test_router_logits_asked_for_per_call_without_the_config_are_refused():
    model, batch = hf_moe(output_router_logits=False), lm_batches(1, 8)[0]
    eng = moe_engine(model)
    assert not eng.experts.computes_terms
    with pytest.raises(engine.EngineUsageError, match="output_router_logits = True before engine.initialize"):
        eng.train_batch(batch, lambda m, b: m(**b, output_router_logits=True).loss)
    eng.train_batch(batch, hf_loss)  # no term: trains as any model
    assert eng.global_steps == 1


def test_a_term_of_another_definition_is_refused_under_global():
    import transformers
    config = transformers.SwitchTransformersConfig(vocab_size=32, d_model=16, d_kv=4, d_ff=16, num_layers=2,
                                                   num_decoder_layers=2, num_heads=2, num_experts=4, expert_capacity=4)
    model = transformers.SwitchTransformersForConditionalGeneration(config)
    with pytest.raises(engine.EngineUsageError, match="switch_transformers.*load_balancing_loss_func.*micro_batch"):
        moe_engine(model)
    assert not moe_engine(model, moe={"load_balance": "micro_batch"}).experts.routes


class _Holder:
    """What expert_balance asks of a strategy: whether it can hold a window's forwards, and to do so."""

    def __init__(self, can: bool):
        self.can_hold_forwards, self.holding = can, False

    def capabilities(self):
        return SimpleNamespace(can_hold_forwards=self.can_hold_forwards)

    def hold_forwards(self):
        self.holding = True

    @staticmethod
    def all_reduce_sum(tensor):
        return tensor


def test_a_pipeline_refuses_a_term_of_ones_own_and_a_holder_that_cannot_refuses_held_forwards():
    from engine.config.schema import MoeConfig
    from engine.experts.window import expert_balance
    # a Hugging Face model's term is counted over the stages by the pipeline's runner
    assert expert_balance(hf_moe(), MoeConfig(), strategy=_Holder(True), checkpointing=False,
                          stages_run_micro_steps=True).routes
    with pytest.raises(engine.EngineUsageError, match="LoadBalancingLoss of the model's own .*under a pipeline"):
        expert_balance(OwnMoE(), MoeConfig(), strategy=_Holder(True), checkpointing=False, stages_run_micro_steps=True)
    with pytest.raises(engine.EngineUsageError, match="bias_update_speed.*under a pipeline"):
        expert_balance(deepseek_v3(), MoeConfig(bias_update_speed=0.01), strategy=_Holder(True), checkpointing=False,
                       stages_run_micro_steps=True)
    assert expert_balance(hf_moe(), MoeConfig(load_balance="micro_batch"), strategy=_Holder(True),
                          checkpointing=False, stages_run_micro_steps=True).routes
    with pytest.raises(engine.EngineUsageError, match="hold_forwards .* DeepSpeed's engine on several ranks"):
        expert_balance(hf_moe(), MoeConfig(global_counts="hold_forwards"), strategy=_Holder(False),
                       checkpointing=False, stages_run_micro_steps=False)
    # under a pipeline that can hold (GPipe), auto holds without checkpointing: GPipe keeps every forward anyway
    assert expert_balance(hf_moe(), MoeConfig(), strategy=_Holder(True), checkpointing=False,
                          stages_run_micro_steps=True).holds_forwards
    assert not expert_balance(hf_moe(), MoeConfig(), strategy=_Holder(True), checkpointing=False,
                              stages_run_micro_steps=False).holds_forwards
    # auto under checkpointing: held where the holder can hold, which it is then told
    for can, counts in ((True, "hold_forwards"), (False, "count_forward")):
        holder = _Holder(can)
        assert expert_balance(hf_moe(), MoeConfig(), strategy=holder, checkpointing=True,
                              stages_run_micro_steps=False).global_counts == counts
        assert holder.holding == can


def test_gpipe_is_chosen_for_global_balance_only_where_no_schedule_was_set_and_it_holds_no_more():
    from engine.experts.stages import schedule_for_global_balance

    def chosen(model=None, checkpointing=True, **config):
        config = engine.load_config({"train_batch_size": 8, **config})
        return schedule_for_global_balance(model or hf_moe(), config, checkpointing)

    two = {"pipeline": {"stages": 2}}
    assert chosen(**two) == "gpipe"  # checkpointed: the held forwards keep their checkpoints only
    assert chosen(checkpointing=False, gradient_accumulation_steps=2, **two) == "gpipe"  # as many as 1F1B keeps
    assert chosen(checkpointing=False, gradient_accumulation_steps=4, **two) is None  # more: 1F1B counts first
    assert chosen(pipeline={"stages": 2, "schedule": "1f1b"}) is None  # the user's schedule stays
    assert chosen(moe={"global_counts": "count_forward"}, **two) is None
    assert chosen(moe={"load_balance": "micro_batch"}, **two) is None
    dense = hf_moe()
    dense.config.output_router_logits = False
    assert chosen(dense, **two) is None
    assert chosen() is None  # no pipeline


def test_a_model_without_routers_runs_its_windows_as_before():
    eng = engine.initialize(torch.nn.Linear(2, 2), {"train_batch_size": 4, "gradient_accumulation_steps": 2},
                            optimizer=sgd)
    assert not eng.experts.routes
    eng.train_batch((torch.ones(4, 2), torch.zeros(4, 2)), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    assert (eng.global_steps, eng.last_window.micro_steps, eng.last_window.samples) == (1, 2, 4)
    assert (eng.experts.last_load, eng.experts.routing_differences) == (None, 0)  # what docs/moe.md reads


def test_moe_config_keys():
    config = engine.load_config({"train_batch_size": 8})
    assert (config.moe.load_balance, config.moe.global_counts) == ("global", "auto")
    with pytest.raises(engine.ConfigError, match="moe.load_balance"):
        engine.load_config({"train_batch_size": 8, "moe": {"load_balance": "per_rank"}})
    with pytest.raises(engine.ConfigError, match="expert_parallel.size 2 does not divide the data 1 × context 1"):
        engine.initialize(torch.nn.Linear(2, 2), {"train_batch_size": 4, "expert_parallel": {"size": 2}},
                          optimizer=sgd)
    deepspeed_autoep = engine.load_config({"train_batch_size": 8, "expert_parallel": {"enabled": True, "autoep_size": 4}})
    assert deepspeed_autoep.expert_parallel.size == 4
    with pytest.raises(engine.ConfigError, match="autoep_size 4 .* conflicts with size: 2"):
        engine.load_config({"train_batch_size": 8, "expert_parallel": {"enabled": True, "autoep_size": 4, "size": 2}})


def test_auto_holds_the_forwards_under_activation_checkpointing_in_one_process():
    plain = moe_engine(hf_moe())
    assert plain.experts.global_counts == "count_forward"
    checkpointed = moe_engine(hf_moe(), activation_checkpointing={"enabled": True})
    assert checkpointed.experts.global_counts == "hold_forwards"


def test_activation_checkpointing_holds_only_checkpoints_and_stays_exact():
    model, batches = hf_moe(), lm_batches(2, 8)
    expected = reference(model, batches, hf_loss)
    eng = trained(model, batches, hf_loss, activation_checkpointing={"enabled": True})
    assert eng.experts.global_counts == "hold_forwards"
    assert max_param_diff(eng.full_state_dict(), expected) < HF_TOL


def out_of_memory_above(rows: int):
    """A forward pre-hook for the embedding: a micro-batch of more than ``rows`` rows raises the error
    CUDA raises when it runs out of memory."""
    def hook(module, args):
        if args[0].shape[0] > rows:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {args[0].shape[0]} MiB")
    return hook


def test_global_balance_stays_exact_when_the_automatic_micro_size_shrinks():
    """train_micro_batch_size_per_gpu: auto starts at the whole batch; the window that runs out of memory
    is discarded (its counts and terms with it) and re-run at half the size until it fits."""
    model, batches = hf_moe(), lm_batches(2, 8)
    expected = reference(model, batches, hf_loss)
    results = {}
    for name, breaking in (("exact", broken.intact), ("per micro-batch", broken.moe_micro_batch_term)):
        tripped = copy.deepcopy(model)
        tripped.model.embed_tokens.register_forward_pre_hook(out_of_memory_above(2))
        eng = breaking(engine.initialize(tripped, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto",
                                                   "activation_checkpointing": {"enabled": True}}, optimizer=sgd))
        for batch in batches:
            eng.train_batch(batch, hf_loss)
        results[name] = max_param_diff(eng.full_state_dict(), expected)
        if name == "exact":
            assert eng.plan.micro_batch_sizes_for_rank(0) == (2, 2, 2, 2) and eng.micro_batch_tuner.changes
            assert eng.experts.global_counts == "hold_forwards"
    assert results["exact"] < HF_TOL and results["per micro-batch"] > MISSES, results


class HeldAtCounts:
    """Bytes a window holds when its counts are all-reduced (every forward held, no backward run yet):
    the tensors saved for backward and the tensors of the forwards' outputs still alive, each storage
    once, parameters excluded."""

    def __init__(self, eng):
        self.eng = eng
        self.parameters = {p.untyped_storage().data_ptr() for p in eng.module.parameters()}
        self.saved: dict[int, list] = {}  # storage address -> [bytes, saved tensors alive on it]
        self.outputs: list = []  # weak references to the forwards' output tensors
        self.held = None
        all_reduce = eng.experts._all_reduce_sum

        def measured(counts):
            self.held = self.now()
            return all_reduce(counts)

        eng.experts._all_reduce_sum = measured

    def pack(self, tensor):
        address = tensor.untyped_storage().data_ptr()
        if address not in self.parameters:
            entry = self.saved.setdefault(address, [tensor.untyped_storage().nbytes(), 0])
            entry[1] += 1
            weakref.finalize(tensor, self._release, address)
        return tensor

    def _release(self, address):
        self.saved[address][1] -= 1
        if not self.saved[address][1]:
            del self.saved[address]

    def loss_fn(self, model, batch):
        """The model's whole output, its tensors watched."""
        out = model(**batch)
        self.outputs += [weakref.ref(t) for t in out.values() if torch.is_tensor(t)]
        self.outputs += [weakref.ref(t) for t in out.router_logits]
        return out

    def now(self) -> int:
        alive = {address: size for address, (size, _) in self.saved.items()}
        for ref in self.outputs:
            if ref() is not None:
                alive[ref().untyped_storage().data_ptr()] = ref().untyped_storage().nbytes()
        return sum(size for address, size in alive.items() if address not in self.parameters)

    def window(self, batch):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
            self.eng.train_batch(batch, self.loss_fn)
        return self.held


def test_a_held_forward_keeps_its_loss_and_the_norms_input_not_the_logits_or_log_probabilities():
    """Held forwards under activation checkpointing: the final norm, the output head and its cross entropy
    are recomputed at the backward from the norm's input (engine.experts.held_forward), and the output is
    dropped but for its loss; counted in bytes at the counts' all-reduce, the cut is at least the logits,
    the log-probabilities (each tokens × vocabulary) and the head's input of every held micro-batch; the
    parameters are bitwise
    those of held forwards that keep everything, and exact with a loss read from .logits as well."""
    model, batches = hf_moe(), lm_batches(2, 8)
    held = {}
    for name, breaking in [("kept", broken.intact), ("everything", broken.moe_held_forward_keeps_everything)]:
        eng = breaking(moe_engine(copy.deepcopy(model), activation_checkpointing={"enabled": True}))
        held[name] = HeldAtCounts(eng).window(batches[0])
    tokens, vocab = 2 * batches[0]["input_ids"].shape[1], model.config.vocab_size  # a micro-batch: 2 rows
    logits = tokens * vocab * model.dtype.itemsize
    log_probabilities = tokens * vocab * torch.float32.itemsize  # transformers' cross entropy runs in float32
    head_input = tokens * model.config.hidden_size * model.dtype.itemsize  # the region starts at the norm's input
    assert held["everything"] - held["kept"] >= 4 * (logits + log_probabilities + head_input), held  # 4 held
    checkpointed = {"activation_checkpointing": {"enabled": True}}
    plain = trained(model, batches, hf_loss, broken.moe_held_forward_keeps_everything, **checkpointed)
    recomputed = trained(model, batches, hf_loss, **checkpointed)
    assert max_param_diff(recomputed.full_state_dict(), plain.full_state_dict()) == 0  # the same operations

    def with_logits(model, batch):  # the logits' own graph reaches the head beside the recomputed loss
        out = model(**batch)
        return out.loss + 0.1 * out.logits.pow(2).mean()

    for loss_fn, full_batch_loss_fn in ((lambda model, batch: model(**batch), hf_loss), (with_logits, with_logits)):
        expected = reference(model, batches, full_batch_loss_fn)
        eng = trained(model, batches, loss_fn, **checkpointed)
        assert eng.experts.global_counts == "hold_forwards"
        assert max_param_diff(eng.full_state_dict(), expected) < HF_TOL


# -- two data ranks ----------------------------------------------------------------------------
def held_scenario(rank, world, stage, tensor=1):
    """Every forward of a window held before its backwards on 2 data ranks (ZeRO 0 / 1 reduce after the
    window, ZeRO 2 / 3 each backward into shards), under activation checkpointing where auto chooses it;
    or on 2 tensor ranks, whose output head gathers its logits (recomputed at the backward with the loss:
    engine.experts.held_forward)."""
    model, batches = hf_moe(kv_heads=tensor), lm_batches(2, 8)
    expected = reference(model, batches, hf_loss)
    split = {"tensor_parallel": {"size": tensor}} if tensor > 1 else {}
    settings = dict(accumulation=2, zero_optimization={"stage": stage}, activation_checkpointing={"enabled": True},
                    **split)
    eng = trained(model, batches, hf_loss, **settings)
    result = {"counts": eng.experts.global_counts, "exact": max_param_diff(eng.full_state_dict(), expected)}
    if stage >= 2:  # held forwards whose counts stay this rank's miss
        alone = trained(model, batches, hf_loss, broken.moe_counts_of_this_part, **settings)
        result["this rank's counts"] = max_param_diff(alone.full_state_dict(), expected)
        # held windows reduce as any window does: after every backward, or deferred, once at the boundary
        settings["zero_optimization"]["defer_reduction"] = True
        deferred = trained(model, batches[:1], hf_loss, **settings)
        result["reductions"] = [reductions_in_a_window(e, batches[1]) for e in (eng, deferred)]
        result["deferred"] = max_param_diff(deferred.full_state_dict(), expected)  # both batches trained
    return result


def reductions_in_a_window(eng, batch) -> int:
    """The gradient reductions of one train_batch at ZeRO 2 / 3 on gloo (FSDP2's reduce-scatter is an
    all-to-all there; a model without expert parallelism makes no other)."""
    calls = [0]
    original = torch.distributed.all_to_all_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    torch.distributed.all_to_all_single = counted
    try:
        eng.train_batch(rank_slice(batch, eng.plan), hf_loss)
    finally:
        torch.distributed.all_to_all_single = original
    return calls[0]


def data_parallel_scenario(rank, world, stage, padded):
    model, batches = hf_moe(), lm_batches(2, 8, padded=padded)
    coef = model.config.router_aux_loss_coef
    loss_fn = lm_sum_with_balance(coef) if padded else hf_loss
    expected = reference(model, batches, full_batch_loss(coef) if padded else hf_loss)
    results = {}
    for name, breaking in [("exact", broken.intact), ("per micro-batch", broken.moe_micro_batch_term),
                           ("running average", broken.moe_running_average)]:
        eng = trained(model, batches, loss_fn, breaking, accumulation=2, zero_optimization={"stage": stage})
        results[name] = max_param_diff(eng.full_state_dict(), expected)
        results["load"] = eng.experts.last_load.per_expert().tolist()
        eng.close()
    return results


def bias_scenario(rank, world, stage):
    model, batches = deepseek_v3(), lm_batches(3, 8)
    expected = state(train_with_bias_updates(model, batches, hf_loss, 0.01, sgd))
    results = {}
    for name, breaking in [("exact", broken.intact), ("this rank's load", broken.moe_bias_from_this_rank)]:
        eng = trained(model, batches, hf_loss, breaking, accumulation=2, zero_optimization={"stage": stage},
                      moe={"bias_update_speed": 0.01})
        results[name] = max_param_diff(eng.full_state_dict(), expected)
        eng.close()
    return results


def short_data_scenario(rank, world):
    """Rank 1's data ends a window early: under count_forward at ZeRO-3 the ranks compare positions
    before the counting forward's gathers, so both raise at once instead of waiting in a collective."""
    import time
    model, batches = hf_moe(), lm_batches(3, 8)
    eng = moe_engine(model, accumulation=2, zero_optimization={"stage": 3})
    started = time.monotonic()
    try:
        for batch in batches[:2 if rank == 1 else 3]:
            eng.train_batch(rank_slice(batch, eng.plan), hf_loss)
        eng.close()
    except engine.RankDisagreementError as error:
        eng.close()
        return str(error), time.monotonic() - started
    return None, time.monotonic() - started


def pipeline_scenario(rank, world, schedule="1f1b", **extra):
    """Pipeline 2 (one Mixtral layer per stage) under global balance, the model's own loss on right-padded
    rows: the stages exchange their router counts before the window's first backward (1F1B: after a
    counting schedule; GPipe: between the training schedule's forwards and its backwards; no schedule set,
    ``extra`` checkpointing the layers: GPipe chosen)."""
    model, batches = hf_moe(), lm_batches(2, 8, padded=True)
    expected = reference(model, batches, hf_loss)
    with float64_term(model), torch.no_grad():
        first_loss = float(hf_loss(copy.deepcopy(model), batches[0]))
    trained = copy.deepcopy(model)
    trained.load_state_dict(expected)
    with float64_term(trained), torch.no_grad():  # the whole batch's own loss, its term over every row
        results = {"expected eval": float(hf_loss(trained, batches[0]))}
    for name, breaking in [("exact", broken.intact), ("per stage", broken.moe_term_per_stage)]:
        pipeline = {"stages": 2, **({"schedule": schedule} if schedule else {})}
        eng = breaking(moe_engine(copy.deepcopy(model), pipeline=pipeline, **extra))
        results["counts"], results["schedule"] = eng.experts.global_counts, eng.config.pipeline.schedule
        losses = [eng.train_batch(rank_slice(batch, eng.plan), hf_loss) for batch in batches]
        results[name] = max_param_diff(eng.full_state_dict(), expected)
        results[f"{name} loss"] = abs(losses[0] - first_loss)
        results[f"{name} load"] = eng.experts.last_load.per_expert().tolist()  # the monitor's expert_load
        results[f"{name} eval"] = eng.eval_batch(rank_slice(batches[0], eng.plan), hf_loss)
        if name == "exact":  # a loss made of the own loss would still get the term's gradient: refused
            try:
                eng.train_batch(rank_slice(batches[0], eng.plan), lambda model, b: model(**b).loss * 1.0)
            except engine.EngineUsageError as error:
                results["not the own loss"] = str(error)
        eng.close()
    return results


def pipeline_shrinking_scenario(rank, world, from_window: int):
    """Pipeline 2 under global balance, 1F1B (a counting run first), the automatic micro size: from window
    ``from_window`` on, the first stage runs out of memory above 2 rows, in the counting run. Its stage stands
    in (window 0: with the shapes of one row's forward, its routers not counting that row; later: with the
    shapes of the earlier windows' forwards); every rank leaves the window to the vote, which shrinks the
    micro size on both, and the window runs again, exact."""
    model, batches = hf_moe(), lm_batches(2, 8)
    expected = reference(model, batches, hf_loss)
    tripped, windows = copy.deepcopy(model), []
    trip = out_of_memory_above(2)
    tripped.model.embed_tokens.register_forward_pre_hook(
        lambda module, args: trip(module, args) if len(windows) >= from_window else None)
    eng = engine.initialize(tripped, {"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto",
                                      "pipeline": {"stages": 2, "schedule": "1f1b"},
                                      "distributed": {"agreement_timeout_seconds": 60, "timeout_seconds": 60}},
                            optimizer=sgd)
    for batch in batches:
        eng.train_batch(batch, hf_loss)
        windows.append(batch)
    result = {"exact": max_param_diff(eng.full_state_dict(), expected), "counts": eng.experts.global_counts,
              "sizes": eng.plan.micro_batch_sizes_for_rank(0),
              "changes": [(change["old"], change["new"]) for change in eng.micro_batch_tuner.changes]}
    eng.close()
    return result


def example_scenario(rank, world):
    from examples import moe
    return moe.main([])["difference"]


@pytest.fixture(scope="module")
def two_ranks():
    scenarios = {(stage, padded): functools.partial(data_parallel_scenario, stage=stage, padded=padded)
                 for stage in (0, 1, 2, 3) for padded in (False, True) if not padded or stage in (0, 3)}
    scenarios |= {("bias", stage): functools.partial(bias_scenario, stage=stage) for stage in (0, 3)}
    scenarios |= {("held", stage): functools.partial(held_scenario, stage=stage) for stage in (0, 1, 2, 3)}
    scenarios[("held", "tensor 2")] = functools.partial(held_scenario, stage=0, tensor=2)
    scenarios["example"] = example_scenario
    scenarios["pipeline"] = pipeline_scenario
    scenarios["pipeline gpipe"] = functools.partial(pipeline_scenario, schedule="gpipe")
    scenarios["pipeline chosen"] = functools.partial(
        pipeline_scenario, schedule=None, activation_checkpointing={"enabled": True, "blocks": "auto"})
    scenarios["short data"] = short_data_scenario
    scenarios |= {("pipeline shrinking", window): functools.partial(pipeline_shrinking_scenario, from_window=window)
                  for window in (0, 1)}
    return run_scenarios(scenarios, world_size=2, timeout=400)


@pytest.mark.distributed
@pytest.mark.timeout(500)
@pytest.mark.parametrize("stage, padded", [(0, False), (1, False), (2, False), (3, False), (0, True), (3, True)],
                         ids=["stage 0", "stage 1", "stage 2", "stage 3", "stage 0 padded", "stage 3 padded"])
def test_two_data_ranks_equal_the_full_batch(two_ranks, stage, padded):
    results = two_ranks[(stage, padded)]
    for rank, result in enumerate(results):
        tolerance = HF_TOL
        assert result["exact"] < tolerance, (rank, result)
        assert result["per micro-batch"] > 1e3 * tolerance, (rank, result)
        assert result["running average"] > 1e3 * tolerance, (rank, result)
    assert results[0]["load"] == results[1]["load"]  # the window's load over both ranks


@pytest.mark.distributed
@pytest.mark.timeout(500)
@pytest.mark.parametrize("scenario, schedule, counts", [("pipeline", "1f1b", "count_forward"),
                                                        ("pipeline gpipe", "gpipe", "hold_forwards"),
                                                        ("pipeline chosen", "gpipe", "hold_forwards")])
def test_pipeline_2_counts_every_stage_before_the_first_backward(two_ranks, scenario, schedule, counts):
    """Last: no schedule set and the layers checkpointed, GPipe is chosen (it holds their checkpoints only)."""
    last = lm_batches(2, 8, padded=True)[1]
    model = hf_moe()
    assignments = model.config.num_experts_per_tok * model.config.num_hidden_layers * int(last["attention_mask"].sum())
    for rank, result in enumerate(two_ranks[scenario]):
        # 1F1B starts backwards before the last forwards: a counting schedule first; GPipe holds them
        assert (result["schedule"], result["counts"]) == (schedule, counts), (rank, result["counts"])
        assert result["exact"] < HF_TOL, (rank, result)
        # the monitor's expert load: every real token's top-k choices in every layer of both stages, on each rank
        assert sum(result["exact load"]) == assignments, (rank, result["exact load"], assignments)
        # eval_batch with the own loss: the batch's mean token loss plus λ · aux over the whole batch
        assert result["exact eval"] == pytest.approx(result["expected eval"], rel=1e-6), (rank, result)
        assert result["per stage"] > 1e3 * HF_TOL, (rank, result)
        # the reported loss is the full batch's, its term the window's (transformers' float32 cross entropy)
        assert result["exact loss"] < 1e-6, (rank, result)
        assert "returned something else than the model's .loss" in result["not the own loss"], (rank, result)


@pytest.mark.distributed
@pytest.mark.timeout(500)
@pytest.mark.parametrize("window", [0, 1], ids=["first window", "a later window"])
def test_an_out_of_memory_in_a_pipelines_counting_run_shrinks_every_rank(two_ranks, window):
    for rank, result in enumerate(two_ranks[("pipeline shrinking", window)]):
        assert result["counts"] == "count_forward" and result["exact"] < HF_TOL, (rank, result)
        assert result["sizes"] == (2, 2, 2, 2) and result["changes"] == [(8, 4), (4, 2)], (rank, result)


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_two_ranks_hold_the_forwards_under_checkpointing_at_every_zero_stage(two_ranks):
    for stage in (0, 1, 2, 3, "tensor 2"):
        for rank, result in enumerate(two_ranks[("held", stage)]):
            assert result["counts"] == "hold_forwards" and result["exact"] < HF_TOL, (stage, rank, result)
            assert result.get("this rank's counts", MISSES) >= MISSES, (stage, rank, result)
            if "reductions" in result:  # accumulation 2: deferring reduces once a window
                every, deferred = result["reductions"]
                assert deferred > 0 and every == 2 * deferred and result["deferred"] < HF_TOL, (stage, rank, result)


# -- aux-loss-free balancing ------------------------------------------------------------------
def test_aux_loss_free_bias_moves_with_the_window_load():
    model, batches = deepseek_v3(), lm_batches(3, 8)
    expected = state(train_with_bias_updates(model, batches, hf_loss, 0.01, sgd))
    eng = trained(model, batches, hf_loss, moe={"bias_update_speed": 0.01})
    assert max_param_diff(eng.full_state_dict(), expected) < HF_TOL
    bias = [v for k, v in eng.full_state_dict().items() if k.endswith("e_score_correction_bias")]
    assert len(bias) == 2 and all(b.abs().sum() > 0 for b in bias)
    assert eng.experts.last_load.per_expert().sum() == 2 * 2 * 8 * 6  # layers x top-k x rows
    one_micro_batch = trained(model, batches, hf_loss, broken.moe_bias_from_one_micro_batch,
                              moe={"bias_update_speed": 0.01})
    assert max_param_diff(one_micro_batch.full_state_dict(), expected) > MISSES
    untouched = trained(model, batches, hf_loss)  # speed 0: the bias stays as transformers leaves it
    assert all(v.abs().sum() == 0 for k, v in untouched.full_state_dict().items()
               if k.endswith("e_score_correction_bias"))


def test_aux_loss_free_bias_does_not_move_on_a_discarded_window():
    model, batch = deepseek_v3(), lm_batches(1, 8)[0]
    eng = moe_engine(model, moe={"bias_update_speed": 0.01})
    eng.train_batch(batch, lambda m, b: m(**b).loss * float("nan"))
    assert eng.skipped_steps == 1
    assert all(v.abs().sum() == 0 for k, v in eng.full_state_dict().items() if k.endswith("e_score_correction_bias"))
    with pytest.raises(engine.EngineUsageError, match="bias_update_speed.*eng.train_batch"):
        eng(**{key: value[:2] for key, value in batch.items()})


@pytest.mark.distributed
@pytest.mark.timeout(500)
@pytest.mark.parametrize("stage", [0, 3])
def test_two_data_ranks_move_the_bias_by_the_load_of_both(two_ranks, stage):
    for rank, result in enumerate(two_ranks[("bias", stage)]):
        assert result["exact"] < HF_TOL, (rank, result)
        assert result["this rank's load"] > MISSES, (rank, result)


# -- seeing the router ------------------------------------------------------------------------
def test_monitor_records_the_window_load_and_plots_it(tmp_path):
    model, batches = hf_moe(), lm_batches(3, 8)
    jsonl, csv_path = tmp_path / "metrics.jsonl", tmp_path / "metrics.csv"
    eng = trained(model, batches, hf_loss, monitor={"enabled": True, "progress": False, "jsonl": str(jsonl),
                                                     "csv": str(csv_path)})
    record = eng.monitor.history[-1]
    # Every layer's top-2 choice of every real row of the window: 2 layers x 2 x 48 rows.
    assert sum(record["expert_load"]) == 2 * 2 * 48 and len(record["expert_load"]) == 4
    per_layer = eng.experts.last_load.assignments[0]
    assert record["expert_imbalance"] == pytest.approx(float((per_layer.max(1).values / per_layer.mean(1)).max()))
    assert record["expert_imbalance"] >= 1
    eng.monitor.close()
    assert csv_path.read_text().splitlines()[1].split(",")[-2].count(" ") == 3  # four loads in one cell
    from engine.cli import main
    pytest.importorskip("matplotlib")
    assert main(["plot", str(jsonl), "--out", str(tmp_path / "load.png")]) == 0
    assert (tmp_path / "load.png").stat().st_size > 0
    plain = engine.initialize(torch.nn.Linear(2, 2), {"train_batch_size": 2, "monitor": {"enabled": True,
                                                                                         "progress": False}},
                              optimizer=sgd)
    plain.train_batch((torch.ones(2, 2), torch.ones(2, 2)), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    assert plain.monitor.history[-1]["expert_load"] is None


def test_the_example_trains_as_the_full_batch(capsys):
    from examples import moe
    result = moe.main([])
    assert result["difference"] < TOL_FLOAT32_ROUTER
    out = capsys.readouterr().out
    assert "max |weight - full-batch weight|" in out
    # Its docstring's numbers are what it prints (one process) and what its plan is on two.
    assert "on 1 data rank(s) x accumulation 8:" in out and "# accumulation 8, one process" in moe.__doc__
    two = engine.resolve_batch_plan(2, train_batch_size=moe.GLOBAL_BATCH, train_micro_batch_size_per_gpu=2)
    assert f"# data 2 x accumulation {two.gradient_accumulation_steps}\n" in moe.__doc__
    assert all(record["expert_imbalance"] >= 1 for record in result["records"])
    assert moe.main(["--set", "moe.load_balance=micro_batch"])["difference"] > 1e3 * TOL_FLOAT32_ROUTER


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_a_rank_whose_data_ended_stops_both_before_the_counting_forward(two_ranks):
    (first, _), (second, _) = two_ranks["short data"]
    assert first is not None and first == second
    assert "rank 1: closing the engine after global step 2" in first


@pytest.mark.distributed
@pytest.mark.timeout(500)
def test_the_example_on_two_ranks(two_ranks):
    assert all(difference < TOL_FLOAT32_ROUTER for difference in two_ranks["example"])


# -- four data ranks ---------------------------------------------------------------------------
def four_ranks_scenario(rank, world):
    model, batches = hf_moe(), lm_batches(2, 8)
    expected = reference(model, batches, hf_loss)
    results = {}
    for name, breaking in [("exact", broken.intact), ("per micro-batch", broken.moe_micro_batch_term)]:
        eng = trained(model, batches, hf_loss, breaking, accumulation=2, zero_optimization={"stage": 3})
        results[name] = max_param_diff(eng.full_state_dict(), expected)
        eng.close()
    return results


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_four_data_ranks_at_zero_3_equal_the_full_batch():
    for rank, result in enumerate(run_scenarios({"four": four_ranks_scenario}, world_size=4, timeout=500)["four"]):
        assert result["exact"] < HF_TOL, (rank, result)
        assert result["per micro-batch"] > MISSES, (rank, result)


# -- the DeepSpeed backend ---------------------------------------------------------------------
def deepspeed_scenario(rank, world):
    model, batches = hf_moe().float(), lm_batches(2, 8)  # DeepSpeed trains float32 at most
    expected = reference(model, batches, hf_loss)
    results = {}
    for stage in (0, 2):
        for name, breaking in [("exact", broken.intact), ("per micro-batch", broken.moe_micro_batch_term)]:
            eng = trained(model, batches, hf_loss, breaking, accumulation=4 // world, backend="deepspeed",
                          zero_optimization={"stage": stage})
            results[(stage, name)] = max_param_diff(eng.full_state_dict(), expected)
            eng.close()
    return results


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(600)
def test_the_deepspeed_backend_balances_over_the_global_batch_too():
    pytest.importorskip("deepspeed")
    for result in run_scenarios({"deepspeed": deepspeed_scenario}, world_size=2, timeout=500)["deepspeed"]:
        for stage in (0, 2):
            assert result[(stage, "exact")] < 1e-6, result  # float32 against the float64 reference
            assert result[(stage, "per micro-batch")] > 1e-5, result
