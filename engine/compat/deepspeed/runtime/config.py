"""``deepspeed.runtime.config``: the optimizer names ``model_engine.optimizer_name()`` answers
with, as scripts compare them (``optimizer_name() == deepspeed.runtime.config.LAMB_OPTIMIZER``).
DeepSpeed's ``DeepSpeedConfig`` object is not provided: its name says what to use."""
from engine.compat.deepspeed.not_provided import refusal

__all__ = ["ADAGRAD_OPTIMIZER", "ADAM_OPTIMIZER", "ADAMW_OPTIMIZER", "LAMB_OPTIMIZER", "ONEBIT_ADAM_OPTIMIZER",
           "ZERO_ONE_ADAM_OPTIMIZER", "ONEBIT_LAMB_OPTIMIZER", "LION_OPTIMIZER", "MUON_OPTIMIZER"]

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ONEBIT_ADAM_OPTIMIZER = "onebitadam"
ZERO_ONE_ADAM_OPTIMIZER = "zerooneadam"
ONEBIT_LAMB_OPTIMIZER = "onebitlamb"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"


def __getattr__(name: str):
    if name == "DeepSpeedConfig":
        raise refusal("deepspeed.runtime.config.DeepSpeedConfig")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
