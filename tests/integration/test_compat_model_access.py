"""Getting the model out, as DeepSpeed scripts do, through ``engine.compat.deepspeed``:

* ZeRO 0-2: ``model_engine.module.state_dict()`` on one rank alone is whole, plain tensors (DeepSpeed
  keeps whole parameters on every rank there), which ``torch.load(weights_only=True)`` reads
  into a plain model;
* ZeRO-3: ``deepspeed.zero.GatheredParameters`` (reading, and writing back from a modifier rank:
  training then goes on from the written values, equal to the float64 reference),
  ``save_16bit_model``, and ``zero_to_fp32`` joining a sharded checkpoint into one file (function
  and command line) without the model or a process group.
"""
from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine.compat.deepspeed as deepspeed
from engine.compat.deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from tests.support.dist_utils import repo_first_on_path, run_scenarios
from tests.support.reference import max_param_diff, mlp, regression_batches

REPO = Path(__file__).resolve().parents[2]
LR, MOMENTUM, STEPS = 0.1, 0.9, 2


def config(stage: int, **extra) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
            "zero_optimization": {"stage": stage, **extra.pop("zero", {})}, **extra}


def train(model_engine, batches):
    rank, world = model_engine.global_rank, model_engine.world_size
    for x, y in batches:
        share = len(x) // world
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        for k in range(model_engine.gradient_accumulation_steps()):
            part = slice(2 * k, 2 * k + 2)
            model_engine.backward(F.mse_loss(model_engine(x[part]), y[part]))
            model_engine.step()


def reference(batches, modify=None):
    """Plain PyTorch on the whole batches; ``modify(model)`` after the first."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for i, (x, y) in enumerate(batches):
        if i == 1 and modify is not None:
            with torch.no_grad():
                modify(model)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


# -- ZeRO 0-2: module.state_dict() on one rank --------------------------------------------------
def state_dict_on_rank0_alone(rank, world, stage, directory, extra):
    model_engine, *_ = deepspeed.initialize(model=mlp(), config=config(stage, **copy.deepcopy(extra)))
    batches = regression_batches(STEPS, 8)
    train(model_engine, batches)
    result = {}
    if rank == 0:  # rank 1 does not take part: no collective may hide in it
        state = model_engine.module.state_dict()
        result["types"] = sorted({type(v).__name__ for v in state.values()})
        path = os.path.join(directory, f"stage{stage}.pt")
        torch.save(state, path)
        plain = mlp(seed=5)
        plain.load_state_dict(torch.load(path, weights_only=True))  # strict: every key, whole shapes
        result["diff"] = max_param_diff(plain.state_dict(), reference(batches))
    whole = model_engine.module_state_dict()  # collective, every rank
    result["agrees"] = max_param_diff(whole, reference(batches))
    model_engine.destroy()
    return result


CASES = {"stage 0": (0, {}), "stage 1": (1, {}), "stage 2": (2, {}),
         "stage 2 offload_optimizer": (2, {"zero": {"offload_optimizer": {"device": "cpu"}}}),
         "stage 1 offload_optimizer": (1, {"zero": {"offload_optimizer": {"device": "cpu"}}})}


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_module_state_dict_is_whole_on_one_rank_at_stages_0_to_2(tmp_path):
    scenarios = {name: functools.partial(state_dict_on_rank0_alone, stage=stage, directory=str(tmp_path), extra=extra)
                 for name, (stage, extra) in CASES.items()}
    for name, (first, second) in run_scenarios(scenarios, world_size=2, timeout=220).items():
        assert first["types"] == ["Tensor"], (name, first)
        assert first["diff"] < 1e-12 and first["agrees"] < 1e-12 and second["agrees"] < 1e-12, (name, first, second)


# -- ZeRO-3: GatheredParameters, save_16bit_model, zero_to_fp32 --------------------------------
def set_first_layer(model):
    model[0].weight.fill_(0.25)
    model[0].bias.zero_()


def zero3_tools(rank, world, directory, bf16):
    extra = {"bf16": {"enabled": True}} if bf16 else {}
    model_engine, *_ = deepspeed.initialize(model=mlp(), config=config(3, **extra))
    batches = regression_batches(STEPS, 8)
    model = model_engine.module
    result = {"sharded_outside": type(model[0].weight).__name__}
    train(model_engine, batches[:1])
    with deepspeed.zero.GatheredParameters(model.parameters()):
        result["gathered_shape"] = tuple(model[0].weight.shape)
        result["gathered_type"] = type(model[0].weight).__name__
    others_before = {k: v for k, v in model_engine.module_state_dict().items() if not k.startswith("0.")}
    with deepspeed.zero.GatheredParameters(list(model[0].parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                set_first_layer(model)  # rank 0's values become every rank's
        elif rank == 1:
            with torch.no_grad():
                model[0].weight.fill_(9.0)  # dropped: not the modifier
    result["after_type"] = type(model[0].weight).__name__
    result["written"] = model_engine.module_state_dict()["0.weight"]
    # what the modifier left alone keeps its fp32 masters (not rounded through bf16 copies)
    result["others_kept"] = all(torch.equal(model_engine.module_state_dict()[k], v) for k, v in others_before.items())
    train(model_engine, batches[1:])
    result["diff"] = max_param_diff(model_engine.module_state_dict(), reference(batches, set_first_layer))
    model_engine.save_16bit_model(directory, "model16.bin")
    model_engine.save_checkpoint(os.path.join(directory, "ckpt"), tag="final")
    result["whole"] = model_engine.module_state_dict()
    model_engine.destroy()
    return result


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("bf16", [False, True])
def test_zero3_gathered_parameters_16bit_model_and_zero_to_fp32(tmp_path, bf16):
    results = run_scenarios({"zero3": functools.partial(zero3_tools, directory=str(tmp_path), bf16=bf16)},
                            world_size=2, timeout=220)["zero3"]
    for result in results:
        assert result["sharded_outside"] == "DTensor" and result["after_type"] == "DTensor", result
        assert result["gathered_shape"] == (16, 8) and result["gathered_type"] == "Parameter", result
        assert torch.equal(result["written"], torch.full((16, 8), 0.25, dtype=result["written"].dtype))
        assert result["others_kept"]
        if not bf16:  # training went on from the written values: the reference modified alike
            assert result["diff"] < 1e-12, result["diff"]
    whole = results[0]["whole"]
    assert max_param_diff(whole, results[1]["whole"]) == 0
    saved16 = torch.load(tmp_path / "model16.bin", weights_only=True)
    assert {v.dtype for v in saved16.values()} == {torch.bfloat16 if bf16 else torch.float64}
    assert max_param_diff(saved16, whole) < (1e-2 if bf16 else 1e-15)
    # one process, no model, no process group: the checkpoint's shards joined
    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))  # `latest` names "final"
    assert consolidated.keys() == whole.keys() and max_param_diff(consolidated, whole) < 1e-6
    if bf16:
        return  # the command line once is enough
    command = [sys.executable, "-m", "engine.compat.deepspeed.utils.zero_to_fp32", str(tmp_path / "ckpt"),
               str(tmp_path / "fp32.bin")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": repo_first_on_path(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert max_param_diff(torch.load(tmp_path / "fp32.bin", weights_only=True), whole) < 1e-6


def test_zero_to_fp32_without_a_checkpoint_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "-m", "engine.compat.deepspeed.utils.zero_to_fp32", str(tmp_path),
                           str(tmp_path / "out.bin")], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": repo_first_on_path(REPO)})
    assert done.returncode == 2 and "no latest file" in done.stderr and "Traceback" not in done.stderr


def deepspeed_backend_gathered(rank, world):
    model_engine, *_ = deepspeed.initialize(model=mlp(dtype=torch.float32), config=config(3, backend="deepspeed"))
    batches = regression_batches(STEPS, 8, dtype=torch.float32)
    model = model_engine.module
    train(model_engine, batches[:1])
    with deepspeed.zero.GatheredParameters(model.parameters()):
        shape = tuple(model[0].weight.shape)
    others_before = {k: v for k, v in model_engine.module_state_dict().items() if not k.startswith("0.")}
    with deepspeed.zero.GatheredParameters(list(model[0].parameters()), modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                set_first_layer(model)
    written = model_engine.module_state_dict()["0.weight"]
    model_engine.destroy()
    return {"shape": shape, "written": bool(torch.all(written == 0.25))}


@pytest.mark.distributed
@pytest.mark.deepspeed
@pytest.mark.timeout(240)
@pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_gathered_parameters_on_the_deepspeed_backend():
    """backend deepspeed: the facade's GatheredParameters is DeepSpeed's own underneath."""
    results = run_scenarios({"ds": deepspeed_backend_gathered}, world_size=2, timeout=220,
                            env={"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                                        str(REPO / ".cache" / "torch_extensions"))})
    for result in results["ds"]:
        assert result == {"shape": (16, 8), "written": True}, result


def test_gathered_parameters_inside_a_window_is_refused():
    import engine

    eng = engine.initialize(mlp(), config(0))
    x, y = regression_batches(1, 8)[0]
    eng.backward(F.mse_loss(eng(x[:2]), y[:2]))
    with pytest.raises(engine.EngineUsageError, match="inside an accumulation window"):
        eng.gathered_parameters()
