"""``from engine.compat.accelerate import Accelerator``: a Hugging Face accelerate script, with that
one import line changed, trained by Microstep on the whole global batch's objective.

The script's own loop stays::

    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader,
                                                                           lr_scheduler)
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()

``prepare`` builds one :class:`engine.Engine` from the model and its optimizer. The prepared model's
forward is the engine's, which reads the model's own ``.loss`` as (sum, count) by the labels it was
handed; ``backward`` weights each micro-batch by its share of the whole window over every process
(never accelerate's fixed 1 / gradient_accumulation_steps); the engine owns the boundary, where the
script's ``optimizer.step()`` / ``zero_grad()`` / ``lr_scheduler.step()`` act (``boundary``,
``prepared``). A mixture of experts whose ``.loss`` adds its routers' term has its windows held and
run whole at their close, so that the term is the global batch's (``boundary``). Data loaders are
sharded per process as accelerate shards them (``data``). Where the
engine's config comes from, and which ``accelerate launch`` settings are honoured or refused:
``settings``. What differs from accelerate: docs/huggingface.md, section Accelerate.

accelerate itself is imported only where a script's objects need it (trackers, its process state for
``accelerate.logging``); the door trains without it.
"""

from engine.compat.accelerate.accelerator import Accelerator

__all__ = ["Accelerator"]
