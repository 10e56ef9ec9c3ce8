import os

# Multi-process tests run 2 ranks on 2 cores: one intra-op thread each keeps them honest.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
