import os

# Multi-process tests run 2 ranks on 2 cores: one intra-op thread each keeps them honest.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

# A launch environment a library may write into this process: accelerate's state (a real Accelerator,
# transformers' TrainingArguments, TRL) sets RANK / WORLD_SIZE / LOCAL_RANK for a CPU run where a process
# group exists, and the next test of the same worker would read a half-set launch environment.
LAUNCH_ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def launch_environment_as_it_was():
    before = {name: os.environ.get(name) for name in LAUNCH_ENVIRONMENT}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
