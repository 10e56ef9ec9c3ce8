"""Launcher smoke test: join the group, all-reduce the ranks, report, exit cleanly.

Run it under any launcher, e.g. ``python -m launch --nproc-per-node 2 examples/_launch_probe.py``.
Each rank prints ``rank R/W local_rank L sum S`` where S = 0 + 1 + ... + (W - 1).
"""
import os
import sys

# Runnable from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine.distributed import init_distributed, shutdown, strip_local_rank_arg  # noqa: E402


def main() -> None:
    strip_local_rank_arg()
    if len(sys.argv) > 1:
        raise SystemExit(f"unexpected arguments: {sys.argv[1:]}")
    info = init_distributed(timeout_seconds=60)
    total = torch.tensor([info.rank], device=info.device)
    if info.world_size > 1:
        dist.all_reduce(total)
    # One write per line: under `python -u` print() writes the newline separately, and
    # the ranks' lines would interleave.
    sys.stdout.write(
        f"rank {info.rank}/{info.world_size} local_rank {info.local_rank} sum {int(total)}\n"
    )
    sys.stdout.flush()
    shutdown()


if __name__ == "__main__":
    main()
