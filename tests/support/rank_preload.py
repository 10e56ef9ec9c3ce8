"""Imported once by run_distributed's fork server (tests/support/dist_utils.py), so that every rank
forked from it starts with what most ranks import anyway, instead of each importing it again.

Measured on the 2-core machine under load, per process: engine's core (``engine.build``:
torch.distributed.tensor, pydantic, sympy) 3.5 s; deepspeed 2.2 s; torch's inductor 5 s, which
DeepSpeed's initialize imports through its Muon optimizer's ``torch.compile`` decorator;
transformers' model base 1.6 s (the Hugging Face models of the doors' and pipelines' tests).
Each rank of each run used to pay these; now the fork server pays them once per pytest worker.

Nothing here may raise: a fork server whose preload raises anything but ImportError dies, and every
later run of that worker with it. A package that is missing or broken is left to the rank that needs
it (which then fails as before, with the rank's traceback). Nothing starts a thread or a process: a
fork of a process with threads could deadlock.
"""
import importlib

PRELOADED = ("engine.build", "torch._inductor.compile_fx", "deepspeed", "transformers.modeling_utils")

for _name in PRELOADED:
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - see the module's doc: the rank that needs it reports it
        pass
