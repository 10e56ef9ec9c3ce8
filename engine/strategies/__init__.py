"""The holder a resolved ``engine.config.setup.Setup`` asks for, built on the joined process group.

One holder per way the data dimension holds the model, each composing the model-parallel
dimensions the same way (``engine.strategies.parallelize``) on the mesh's groups:

* ``DataParallel`` (``ddp.py``): DDP, gradients all-reduced in the window's closing backward
  (ZeRO 0; ZeRO 1 with the optimizer state owned, ``zero1.py``), on a mesh of data ranks;
* ``Replicas`` (``replicas.py``): replicas averaged after the window (one process, low-precision
  parameters at ZeRO 0 / 1, a tensor dimension at ZeRO 0 / 1);
* ``FullyShardedDataParallel`` (``fsdp.py``): FSDP2 over the data dimension, reducing per
  micro-step or deferred (ZeRO 2 / 3, offload), tensor-split layers included;
* ``PipelineParallel`` (``pipeline.py``): stages on a schedule, each whole or sharded on its data
  replicas, tensor-split or not;
* ``DeepSpeedStrategy`` (``deepspeed.py``): DeepSpeed's own engine.
"""

from __future__ import annotations

import logging

from engine.distributed.process_group import DistInfo
from engine.config.setup import Setup

log = logging.getLogger("engine")

__all__ = ["make_strategy"]


def make_strategy(setup: Setup, dist_info: DistInfo):
    """The holder ``setup.holder`` names (imported lazily: ``import engine`` never imports
    DeepSpeed or FSDP)."""
    if setup.holder == "replicas" and setup.mesh.world_size == 1 and setup.stage > 0:
        log.info("ZeRO stage %d has nothing to shard in a single process; running unsharded", setup.stage)
    if setup.holder == "deepspeed":
        from engine.strategies.deepspeed import DeepSpeedStrategy as chosen
    elif setup.holder == "pipeline":
        from engine.strategies.pipeline import PipelineParallel as chosen
    elif setup.holder == "fsdp":
        from engine.strategies.fsdp import FullyShardedDataParallel as chosen
    elif setup.holder == "ddp":
        from engine.strategies.ddp import DataParallel as chosen
    else:
        from engine.strategies.replicas import Replicas as chosen
    return chosen(setup, dist_info)
