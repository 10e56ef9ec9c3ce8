"""engine.compat.deepspeed as a DeepSpeed script meets it, run as such a script runs:

    python -m launch --nproc-per-node 2 tests/support/deepspeed_facade_checks.py OUT_DIR

with deepspeed and accelerate absent (tests/integration/test_compat_deepspeed_zero3.py). Its parser
never declares ``--local_rank`` (``add_config_arguments`` must not need it). At ZeRO 3: the marks
of partitioned parameters, ``GatheredParameters`` gathering exactly the parameters given (reads,
writes with ``modifier_rank``, DeepSpeed-Chat's load into a submodule), the usual per-parameter
save, ``module_state_dict()`` and ``save_16bit_model`` (files left in OUT_DIR for the test to load), the model built under ``zero.Init``;
at ZeRO 0 the same script's branch without marks; ``HfDeepSpeedConfig`` and ``from_pretrained``;
every name of docs/migrating.md's survey table. Each rank writes OUT_DIR/rank<N>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch.distributed.tensor import DTensor

import engine.compat.deepspeed as deepspeed
from engine.compat.deepspeed.hf import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
from engine.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from tests.support.deepspeed_names import outcome, survey_rows
from tests.support.hf_models import llama_config

CONFIG = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
READ, OTHER, LOADED = "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"


def tiny_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(layers=2))


def train_one_step(ds_engine, rank: int) -> float:
    tokens = torch.randint(1, 16, (2, 6), generator=torch.Generator().manual_seed(rank))
    loss = ds_engine(input_ids=tokens, labels=tokens).loss
    ds_engine.backward(loss)
    ds_engine.step()
    return float(loss)


def is_sharded(param) -> bool:
    return hasattr(param, "ds_id") and param.ds_status == ZeroParamStatus.NOT_AVAILABLE


def save_by_pattern(module, rank: int, path: str) -> None:
    """The usual ZeRO-3 save: each parameter gathered alone, its ``.data`` copied to the host."""
    state = {}
    for name, param in module.named_parameters():
        if hasattr(param, "ds_id"):
            with deepspeed.zero.GatheredParameters([param] if is_sharded(param) else []):
                value = param.data.cpu()
        else:
            value = param.cpu()
        state[name] = value
    if rank == 0:
        torch.save(state, path)
    torch.distributed.barrier()


def written_by_rank0(ds_engine, param, rank: int) -> bool:
    """Rank 0's values written inside the block become every rank's; rank 1's are dropped."""
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        param.data.fill_(0.5 if rank == 0 else 9.0)
    return bool((ds_engine.module_state_dict()[READ] == 0.5).all())


def zero3(out: str, rank: int) -> dict:
    with deepspeed.zero.Init(config_dict_or_path={**CONFIG, "zero_optimization": {"stage": 3}}):
        model = tiny_llama()  # built whole: initialize shards it
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    ds_engine, *_ = deepspeed.initialize(model=model, config={**CONFIG, "zero_optimization": {"stage": 3}})
    module = ds_engine.module
    params = dict(module.named_parameters())
    found = {
        "sharded": all(isinstance(p, DTensor) for p in params.values()),
        "marked": all(is_sharded(p) and tuple(p.ds_shape) == tuple(initial[n].shape) and p.ds_numel == initial[n].numel()
                      for n, p in params.items()),
        "unique_ids": len({p.ds_id for p in params.values()}) == len(params),
    }
    read, other = params[READ], params[OTHER]
    with deepspeed.zero.GatheredParameters([read]):
        found["inside"] = {"status": read.ds_status.name, "whole": type(read.data) is torch.Tensor,
                           "value": torch.equal(read.data.cpu(), initial[READ]),
                           "other_status": other.ds_status.name, "other_sharded": isinstance(other.data, DTensor)}
    found["after"] = {"status": read.ds_status.name, "sharded": isinstance(read.data, DTensor)}
    found["loss"] = train_one_step(ds_engine, rank)
    trained = ds_engine.module_state_dict()  # collective at ZeRO 3
    if rank == 0:
        torch.save(trained, os.path.join(out, "zero3_module_state_dict.bin"))
    save_by_pattern(module, rank, os.path.join(out, "zero3_pattern.bin"))
    ds_engine.save_16bit_model(out, "zero3_16bit.bin")
    found["written"] = written_by_rank0(ds_engine, read, rank)
    found["others_untouched"] = torch.equal(ds_engine.module_state_dict()[OTHER], trained[OTHER])
    # DeepSpeed-Chat's load_state_dict_into_model at ZeRO 3: rank 0 loads a submodule's state in the block
    down = module.model.layers[0].mlp.down_proj
    with deepspeed.zero.GatheredParameters(list(down.parameters(recurse=False)), modifier_rank=0):
        if rank == 0:
            down._load_from_state_dict({"weight": torch.full_like(initial[LOADED], 0.25)}, "", {}, True, [], [], [])
    found["loaded"] = bool((ds_engine.module_state_dict()[LOADED] == 0.25).all())
    found["trains_after"] = train_one_step(ds_engine, rank)
    ds_engine.destroy()
    return found


def zero0(rank: int) -> tuple[dict, object]:
    ds_engine, *_ = deepspeed.initialize(model=tiny_llama(), config={**CONFIG, "zero_optimization": {"stage": 0}})
    params = dict(ds_engine.module.named_parameters())
    found = {"unmarked": not any(hasattr(p, "ds_id") for p in params.values()),
             "written": written_by_rank0(ds_engine, params[READ], rank)}
    return found, ds_engine


def transformers_checks(out: str, rank: int) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.integrations import deepspeed as transformers_deepspeed

    model_dir = os.path.join(out, "model")
    if rank == 0:
        tiny_llama().save_pretrained(model_dir)
    torch.distributed.barrier()
    dschf = HfDeepSpeedConfig({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    found = {"zero3": is_deepspeed_zero3_enabled(), "stage": dschf.get_value("zero_optimization.stage"),
             "offload": dschf.is_offload(), "transformers_zero3": transformers_deepspeed.is_deepspeed_zero3_enabled()}
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    found["whole"] = all(type(p) is torch.nn.Parameter and p.numel() > 0 for p in model.parameters())
    del dschf
    found["zero3_after"] = is_deepspeed_zero3_enabled()
    try:  # the control: transformers' own class needs the packages this interpreter lacks
        transformers_deepspeed.HfDeepSpeedConfig({"zero_optimization": {"stage": 3}})
        found["transformers_class"] = "built"
    except Exception as error:  # noqa: BLE001 -- whatever transformers raises is the finding
        found["transformers_class"] = type(error).__name__
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = deepspeed.add_config_arguments(parser).parse_args()
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    declared = argparse.ArgumentParser()
    declared.add_argument("--local_rank", type=int, default=-1)
    found = {"local_rank": {"environment": int(os.environ["LOCAL_RANK"]), "undeclared": args.local_rank,
                            "declared": deepspeed.add_config_arguments(declared).parse_args([]).local_rank}}
    found["zero3"] = zero3(args.out, rank)
    found["zero0"], ds_engine = zero0(rank)
    found["names"] = {name: outcome(name, refused, ds_engine) for name, refused in survey_rows()}
    found["transformers"] = transformers_checks(args.out, rank)
    found["modules"] = {name: name in sys.modules for name in ("deepspeed", "accelerate")}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    main()
