"""DeepSpeed's offload keys on the torch backend: FSDP2's CPU offload where it can carry out
the request, a clear error naming ``backend: deepspeed`` where it cannot, never dropped.

Two gloo ranks on CPU: every FSDP2 unit is sharded with ``CPUOffloadPolicy`` (not pinned
without an accelerator), every tensor the strategy holds for training is on the host, and the
result equals the float64 full-batch reference. One process without a launcher offloads too
(FSDP2 on a one-rank group instead of the unsharded single-process strategy). On a CPU-only
machine every tensor is on the host with or without offload, so where offload puts them is
checked on a GPU only (skipped elsewhere): shards, gradients and optimizer state on the host,
compute on the device, fp32 / bf16 / fp16 with clipping and both defer settings equal to the
same run without offload, a checkpoint round trip."""

import functools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

import engine
from engine.adapters.torch_internals import fsdp_offload_policies
from engine.cli import main
from engine.config.checks import check_without_model
from engine.config.offload import torch_offload
from engine.distributed.process_group import DistInfo
from engine.config.setup import resolve_setup
from engine.strategies import make_strategy
from tests.distributed.test_context_parallel import GPT_TOL, gpt_script
from tests.distributed.test_expert_parallel import differences, reference
from tests.support import broken
from tests.support.dist_utils import repo_first_on_path, run_scenarios
from tests.support.moe_models import hf_loss, hf_moe, lm_batches
from tests.support.pipeline_helpers import mse_outputs
from tests.support.reference import max_param_diff, mlp, mse, rank_slice, reference_train, regression_batches, sgd, state

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-10
CPU = {"device": "cpu", "pin_memory": True}  # pin_memory as DeepSpeed configs write it
BOTH = {"offload_param": CPU, "offload_optimizer": CPU}


def load(zero, backend="torch"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = engine.load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                     "backend": backend, "zero_optimization": zero})
    return config, [str(w.message) for w in caught]


# -- what the torch backend makes of each request ------------------------------------------------
def _use_cpu(zero):
    return {**zero, "offload_param": {**zero["offload_param"], "device": "cpu"}}


def _without(section, key):
    def fix(zero):
        return {**zero, section: {k: v for k, v in zero[section].items() if k != key}}
    return fix


# Each refusal, the fix its message advises (within the torch backend), and that the fix passes.
@pytest.mark.parametrize("zero, problem, advice, fix", [
    ({"stage": 3, **BOTH, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}, "offload_param.device: nvme",
     "use device: cpu", _use_cpu),
    ({"stage": 0, **BOTH, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}, "offload_param.device: nvme",
     "use device: cpu", lambda zero: {**_use_cpu(zero), "stage": 1}),  # both problems at once, both fixed
    ({"stage": 0, "cpu_offload": True, "cpu_offload_param": True}, "offloading needs ZeRO",
     "set zero_optimization.stage: 1, 2 or 3", lambda zero: {**zero, "stage": 1}),
    ({"stage": 0, "offload_optimizer": CPU}, "offloading needs ZeRO", "set zero_optimization.stage: 1, 2 or 3",
     lambda zero: {**zero, "stage": 2}),
    ({"stage": 3, **BOTH, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}, "offload_optimizer.ratio: 0.3",
     "remove ratio", _without("offload_optimizer", "ratio")),
    ({"stage": 2, **BOTH, "offload_optimizer": {"device": "cpu", "super_offload": True}}, "super_offload",
     "remove it", _without("offload_optimizer", "super_offload")),
    ({"stage": 3, "offload_param": {"device": "gpu"}}, "expected cpu, nvme or none, got 'gpu'", "expected cpu",
     lambda zero: {**zero, "offload_param": CPU}),
    ({"stage": 3, "offload_param": "cpu"}, "expected a section", "{device: cpu",
     lambda zero: {**zero, "offload_param": CPU}),
])
def test_what_fsdp2_cannot_do_is_an_error_whose_advice_works(zero, problem, advice, fix):
    config, _ = load(zero)
    problems = check_without_model(config)
    assert problems and problem in problems[0] and all(advice in p or "offloading needs ZeRO" in p
                                                       for p in problems), problems
    assert all("backend: deepspeed" in p for p in problems) or "expected" in problem
    with pytest.raises(engine.ConfigError, match="zero_optimization"):
        engine.initialize(mlp(), config, optimizer=sgd)  # refused before any process group
    fixed, _ = load(fix(zero))
    assert check_without_model(fixed) == [], "the advice leads to another error"
    # the DeepSpeed backend takes the same keys as they are (when the config is one DeepSpeed accepts)
    if "expected" not in problem and zero["stage"] > 0:
        ds_config, _ = load(zero, backend="deepspeed")
        assert not any("offload" in p for p in check_without_model(ds_config))


def test_the_deepspeed_advice_needs_deepspeed_installed(monkeypatch):
    """Without DeepSpeed the way to its backend starts with installing it."""
    import engine.config.offload as offload

    monkeypatch.setattr(offload, "find_spec", lambda name: None)
    config, _ = load({"stage": 0, "offload_optimizer": CPU})
    assert "install DeepSpeed (pip install 'microstep[deepspeed]') and set backend: deepspeed" in \
        check_without_model(config)[0]


@pytest.mark.parametrize("zero, pinned, note", [
    ({"stage": 2, **BOTH}, True, None),
    ({"stage": 2, "offload_optimizer": CPU}, True, "the sharded parameters and gradients are held on the host too"),
    ({"stage": 1, "offload_optimizer": {"device": "cpu"}}, True, "at ZeRO stage 1: the torch backend offloads with "
                                                                 "FSDP2"),  # HelloDeepSpeed's
    ({"stage": 1, **BOTH}, True, "at ZeRO stage 1"),
    ({"stage": 3, **BOTH}, True, None),
    ({"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False}, "offload_optimizer": CPU}, False, None),
    ({"stage": 3, "offload_param": CPU}, True, "gradients and optimizer state are held on the host too"),
    ({"stage": 2, "cpu_offload": True, "cpu_offload_param": True}, False, None),  # legacy switches, unpinned
    ({"stage": 3, **BOTH, "offload_param": {"device": "cpu", "buffer_count": 5, "max_in_cpu": 10**9}}, True,
     "buffer_count, max_in_cpu not used by the torch backend's CPU offload"),
])
def test_what_fsdp2_can_do_is_host_offload(zero, pinned, note):
    config, warned = load(zero)
    assert check_without_model(config) == []
    offload = torch_offload(config.zero_optimization)
    assert offload.to_host and offload.pin_memory == pinned
    # nothing written is called unused: the keys are read, or named by a note
    assert not any("not used by the torch backend; they are kept" in w and "offload" in w for w in warned), warned
    if note:
        assert any(note in w for w in warned), warned


def test_no_offload_device_is_no_offload():
    config, warned = load({"stage": 3, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"}})
    assert check_without_model(config) == [] and not torch_offload(config.zero_optimization).to_host
    config, warned = load({"stage": 2, "overlap_comm": True})  # other DeepSpeed keys still get their warning
    assert any("zero_optimization.overlap_comm are not used by the torch backend" in w for w in warned), warned


def test_one_process_offloads_with_fsdp2():
    config, _ = load({"stage": 3, **BOTH})
    one = DistInfo(0, 0, 1, 1, torch.device("cpu"), None)
    assert make_strategy(resolve_setup(config, one), one).name == "fsdp"
    plain, _ = load({"stage": 3})
    assert make_strategy(resolve_setup(plain, one), one).name != "fsdp"


def test_validate_names_the_problem(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 0,\n'
                    ' "offload_optimizer": {"device": "cpu"}}}')
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: zero_optimization.offload_optimizer:" in err and "backend: deepspeed" in err


# -- training with offload equals the reference -----------------------------------------------------
STEPS, GLOBAL = 3, 8


def offloaded_run(rank, world_size, stage, offload=BOTH, mesh=None):
    """``mesh``: a tensor or pipeline dimension's section (the tensor split's DTensors sharded and
    offloaded by FSDP2; each pipeline stage sharded and offloaded)."""
    eng = engine.initialize(mlp(), {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": 2,
                                    "zero_optimization": {"stage": stage, "shard_unit_size": 100, **offload},
                                    **(mesh or {})},
                            optimizer=sgd)  # small units: the policy is checked on several
    loss_fn = mse_outputs if "pipeline" in (mesh or {}) else mse
    for batch in regression_batches(STEPS, GLOBAL):
        eng.train_batch(rank_slice(batch, eng.plan), loss_fn)
    policy = eng.strategy.offload_policy
    roots = [eng.module, *getattr(eng.strategy, "stage_modules", [])]  # a pipeline shards its stages
    units = list({id(m): m for root in roots for m in root.modules() if isinstance(m, FSDPModule)}.values())
    held = [t for t in eng.strategy.held_tensors() if t is not None]
    local = [getattr(t, "_local_tensor", t) for t in held]  # DTensor shards: their local storage
    optimizer_state = [v for s in eng.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    result = {"policy": (type(policy).__name__, getattr(policy, "pin_memory", None)),
              "unit_policies": [(type(p).__name__, getattr(p, "pin_memory", None))
                                for p in fsdp_offload_policies(units)],
              "devices": sorted({t.device.type for t in local}),
              "optimizer_state": (len(optimizer_state), sorted({t.device.type for t in optimizer_state})),
              # the shards the optimizer steps (stages 1-2 hold gathered copies in the module between windows)
              "param_devices": sorted({p.to_local().device.type for g in eng.optimizer.param_groups for p in g["params"]}),
              "state": eng.full_state_dict()}
    eng.close()
    return result


@pytest.fixture(scope="module")
def offloaded():
    scenarios = {f"stage{s}": functools.partial(offloaded_run, stage=s) for s in (2, 3)}
    # DeepSpeed's ZeRO-Offload as configs write it (HelloDeepSpeed's): the optimizer alone, ZeRO-1
    scenarios["stage1 offload_optimizer"] = functools.partial(offloaded_run, stage=1,
                                                              offload={"offload_optimizer": {"device": "cpu"}})
    scenarios["tensor 2, stage3"] = functools.partial(offloaded_run, stage=3, mesh={"tensor_parallel": {"size": 2}})
    scenarios["pipeline 2, stage3"] = functools.partial(offloaded_run, stage=3, mesh={"pipeline": {"stages": 2}})
    scenarios["pipeline 2, stage1 offload_optimizer"] = functools.partial(
        offloaded_run, stage=1, offload={"offload_optimizer": {"device": "cpu"}}, mesh={"pipeline": {"stages": 2}})
    scenarios["experts 2, stage3"] = offloaded_experts
    # context 2 (the GPT of the context tests), its blocks checkpointed
    scenarios["context 2, stage3, checkpointing"] = functools.partial(gpt_script, stage=3, extra={
        "zero_optimization": {"stage": 3, **BOTH}, "activation_checkpointing": {"enabled": True}})
    return run_scenarios(scenarios, world_size=2, timeout=180)


def offloaded_experts(rank, world_size):
    """A Mixtral (its own loss, the global router term) with its experts split over the 2 ranks: FSDP2
    shards and offloads the dense part, the experts' slices stay where expert_parallel put them."""
    model, batches = hf_moe(), lm_batches(2, 8)
    return differences(model, batches, hf_loss, reference(model, batches, hf_loss), [("exact", broken.intact)],
                       zero_optimization={"stage": 3, **BOTH})


@pytest.mark.parametrize("name", ["stage2", "stage3", "stage1 offload_optimizer", "tensor 2, stage3",
                                  "pipeline 2, stage3", "pipeline 2, stage1 offload_optimizer"])
def test_offloaded_training_holds_everything_on_the_host_and_equals_the_reference(offloaded, name):
    expected = state(reference_train(mlp(), regression_batches(STEPS, GLOBAL), mse, sgd))
    for result in offloaded[name]:
        assert result["policy"] == (CPUOffloadPolicy.__name__, False)  # no accelerator: not pinned
        # what FSDP2 acts on: every unit sharded with it (on a CPU machine the devices below hold either way;
        # a pipeline stage is one unit)
        assert len(result["unit_policies"]) >= (1 if name.startswith("pipeline") else 2)
        assert set(result["unit_policies"]) == {(CPUOffloadPolicy.__name__, False)}
        assert result["devices"] == ["cpu"] and result["param_devices"] == ["cpu"]
        assert result["optimizer_state"][0] > 0 and result["optimizer_state"][1] == ["cpu"]
        assert max_param_diff(result["state"], expected) < TOL


ONE_PROCESS = """
import torch, engine
from tests.support.reference import max_param_diff, mlp, mse, reference_train, regression_batches, sgd, state
eng = engine.initialize(mlp(), {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}},
    optimizer=sgd)
batches = regression_batches(3, 8)
for batch in batches:
    eng.train_batch(batch, mse)
diff = max_param_diff(eng.full_state_dict(), state(reference_train(mlp(), batches, mse, sgd)))
print(eng.strategy.name, type(eng.strategy.offload_policy).__name__, diff < 1e-10)
eng.close()
"""


def test_offload_with_experts_split_offloads_the_rest_and_equals_the_reference(offloaded):
    assert all(result["exact"] < 1e-8 for result in offloaded["experts 2, stage3"]), offloaded["experts 2, stage3"]


def test_offload_under_context_parallelism_with_checkpointing_equals_the_reference(offloaded):
    results = offloaded["context 2, stage3, checkpointing"]
    assert all(result["diff"] < GPT_TOL for result in results), results


def test_one_process_without_a_launcher_offloads_and_equals_the_reference():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    # the repository first, then whatever the machine already needs (a GPU machine's extra packages)
    env.update(PYTHONPATH=repo_first_on_path(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", ONE_PROCESS], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["fsdp", "CPUOffloadPolicy", "True"], result.stdout


# -- on a GPU: what offload moves, and that it trains as without --------------------------------
CLIP = 0.5
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}}}


def _gpu_config(precision: str, defer: bool, offload: bool) -> dict:
    zero = {"stage": 3, "shard_unit_size": 100, "defer_reduction": defer, **(BOTH if offload else {})}
    return {"train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP,
            "zero_optimization": zero, **PRECISIONS[precision]}


def _device_types(tensors) -> list[str]:
    return sorted({getattr(t, "_local_tensor", t).device.type for t in tensors})


def _train_windows(eng, batches, record=None) -> None:
    """The manual loop; ``record`` gets the gradients' devices at each window's closing backward."""
    micro = eng.plan.train_micro_batch_size_per_gpu
    for x, y in batches:
        for k in range(eng.plan.gradient_accumulation_steps):
            part = slice(k * micro, (k + 1) * micro)
            eng.backward(mse(eng, (x[part].to(eng.device), y[part].to(eng.device))))
            if record is not None and eng.is_gradient_accumulation_boundary():
                record.append(_device_types(p.grad for p in eng.module.parameters() if p.grad is not None))
            eng.step()


def offload_on_one_gpu(root: str) -> dict:
    """Each precision and defer setting at ZeRO-3 with offload on this process's device (one
    rank): where parameters, gradients and optimizer state live, the clipped norms, the model
    against the same run without offload (and, in fp32, the float64 reference), and a checkpoint
    round trip. Run in a process of its own (it makes a one-rank process group)."""
    batches = [(x.float(), 4 * y.float()) for x, y in regression_batches(STEPS, GLOBAL)]
    expected = state(reference_train(mlp(), [(x.double(), y.double()) for x, y in batches[:2]], mse, sgd, clip=CLIP))
    out = {}
    for precision in PRECISIONS:
        for defer in (False, True):
            plain = engine.initialize(mlp(dtype=torch.float32), _gpu_config(precision, defer, offload=False),
                                      optimizer=sgd)
            _train_windows(plain, batches[:2])
            without = plain.full_state_dict()
            plain.close()
            eng = engine.initialize(mlp(dtype=torch.float32), _gpu_config(precision, defer, offload=True),
                                    optimizer=sgd)
            grads, norms = [], []
            for batch in batches[:2]:
                _train_windows(eng, [batch], grads)
                norms.append(float(eng.last_window.step.grad_norm or 0))
            trained = eng.full_state_dict()
            path = os.path.join(root, f"{precision}-{defer}")
            eng.save_checkpoint(path)
            _train_windows(eng, batches[2:])
            first = eng.full_state_dict()
            eng.load_checkpoint(path)
            after_load = _device_types(eng.module.parameters())
            _train_windows(eng, batches[2:])
            with torch.no_grad():
                output = eng(batches[0][0][:2].to(eng.device))
            out[f"{precision} defer={defer}"] = {
                "compute": eng.device.type, "output": output.device.type,
                "grads": grads, "params": _device_types(eng.module.parameters()), "params_after_load": after_load,
                "optimizer_state": _device_types(v for s in eng.optimizer.state.values() for v in s.values()
                                                 if torch.is_tensor(v) and v.dim() > 0),
                "norms": norms, "skipped": eng.skipped_steps,
                "vs_without_offload": max_param_diff(trained, without),
                "vs_reference": max_param_diff(trained, expected),
                "round_trip": max_param_diff(first, eng.full_state_dict())}
            eng.close()
    return out


CUDA_RUN = """
import json, sys
from tests.distributed.test_offload import offload_on_one_gpu
print("RESULT " + json.dumps(offload_on_one_gpu(sys.argv[1])))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device: on a CPU-only machine every tensor is on the host with or without "
                           "offload, so where offload puts them cannot be told apart there")
def test_offload_on_a_gpu_holds_shards_gradients_and_optimizer_state_on_the_host(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    # the repository first, then whatever the machine already needs (a GPU machine's extra packages)
    env.update(PYTHONPATH=repo_first_on_path(REPO), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", CUDA_RUN, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.split("RESULT ", 1)[1])
    for name, run in runs.items():
        assert (run["compute"], run["output"]) == ("cuda", "cuda"), name  # computed on the GPU
        assert run["params"] == run["params_after_load"] == ["cpu"], name  # shards on the host
        assert run["grads"] == [["cpu"], ["cpu"]], name  # reduced into host shards at each boundary
        assert run["optimizer_state"] == ["cpu"], name  # stepped on the host
        assert all(norm > CLIP for norm in run["norms"]), name  # clipping engaged
        assert run["vs_without_offload"] < 1e-6, name  # offload changes where, not what
        assert run["round_trip"] == 0, name
        assert run["skipped"] == 0, name  # (fp16 starts at loss scale 2**8: no window overflows)
        if name.startswith("fp32"):
            assert run["vs_reference"] < 1e-5, name
