"""What the pipeline tests share (tests/distributed/test_pipeline.py, test_pipeline_auto.py,
test_mesh3d.py, and through tests/support/hf_models.py the Hugging Face ones): losses in the
pipeline's (outputs, labels) convention, token batches as (input_ids, labels), a data-parallel
rank's share of a global batch, the full-batch reference run, and an fp16 overflow injected in
the second window."""

import copy

import torch
import torch.nn.functional as F

import engine
from tests.support.reference import max_param_diff, sgd, state
from tests.support.reference import token_batches as reference_token_batches

VOCAB = 11


def mse_outputs(outputs, labels):
    """The pipeline's loss_fn: (outputs of the last stage, labels) -> the micro-batch mean."""
    return F.mse_loss(outputs, labels)


def reference_mse(model, batch):
    return F.mse_loss(model(batch[0]), batch[1])


def token_batches(steps, global_batch, seq=6, seed=2, vocab=VOCAB, dense=False):
    """tests.support.reference's token batches as (input_ids, labels), the pipeline's convention."""
    return [(batch["tokens"], batch["labels"])
            for batch in reference_token_batches(steps, global_batch, seq, vocab, seed, dense=dense)]


def token_sum(outputs, labels):
    """(Σ over valid tokens, their count): weighted by the window's tokens over every rank."""
    loss = F.cross_entropy(outputs.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def data_share(batch, eng):
    """This data-parallel rank's contiguous share (every stage of a replica gets the same)."""
    plan = eng.plan
    sizes = engine.batching.plan.split_evenly(batch[0].shape[0], plan.world_size)
    start = sum(sizes[:plan.rank])
    return tuple(t[start:start + sizes[plan.rank]] for t in batch)


def reference_run(model, batches, loss_fn, clip):
    """The full-batch reference (SGD with momentum): the trained copy and each step's loss."""
    model = copy.deepcopy(model)
    optimizer, losses = sgd(model.parameters()), []
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        losses.append(float(loss.detach()))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model, losses


def overflow_in_second_window(eng, here: bool) -> None:
    """An inf in this rank's gradient (when ``here``) at the second window's step (injected)."""
    strategy, calls = eng.strategy, []
    gradients = strategy.local_gradients

    def overflowing():
        grads = gradients()
        calls.append(1)
        if len(calls) == 2 and here:
            grads[0].view(-1)[0] = float("inf")
        return grads

    strategy.local_gradients = overflowing


def overflow_result(eng, expected) -> dict:
    """After an overflow run: against the reference, the windows skipped and taken, the loss scale."""
    result = {"diff": max_param_diff(eng.full_state_dict(), state(expected)), "skipped": eng.skipped_steps,
              "steps": eng.global_steps, "scale": eng.strategy.loss_scaler.scale}
    eng.close()
    return result
