"""``from engine.compat.accelerate import Accelerator``: an accelerate script with that one import line
changed trains the whole global batch's objective, against the float64 full-batch reference, while
accelerate's own Accelerator on the same script (the control) misses: a tiny Llama on padded rows of 2 to
12 real tokens, accumulation 4, on 1 and 2 processes (and ZeRO 3 from a Microstep config), and a Mixtral
whose .loss adds its router term (the window's, as the full batch's); the scheduler
steps as accelerate's; save_state / load_state continue as if uninterrupted; gather_for_metrics,
split_between_processes, reduce answer as accelerate's; what accelerate launch sets is honoured or
refused by name; examples/accelerate_clm.py (run_clm_no_trainer's shape) under ``python -m launch`` and
``accelerate launch``."""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from engine.compat.accelerate import Accelerator
from engine.compat.accelerate.settings import read_settings
from engine.errors import ConfigError, EngineUsageError
from tests.support import accelerate_scripts as scripts
from tests.support.dist_utils import repo_first_on_path, run_scenarios
from tests.support.hf_models import TOL
from tests.support.moe_models import hf_moe

REPO = Path(__file__).resolve().parents[2]
ROWS = 24  # three global batches of 8
MISSES = 1e-3  # accelerate's mean of micro-batch means is off by 1e-2 here


def _exact_and_control(processes: int, **door_kwargs) -> dict:
    rows = scripts.padded_rows(ROWS)
    expected = scripts.reference(rows, processes)
    door = scripts.run_script(True, rows, processes, **door_kwargs)
    control = scripts.run_script(False, rows, processes)
    return {"door": scripts.distance(door["state"], expected), "control": scripts.distance(control["state"], expected),
            "scheduler": (door["scheduler_steps"], control["scheduler_steps"]),
            "lr": (door["last_lr"], control["last_lr"])}


def _check_exact(result: dict, processes: int) -> None:
    assert result["door"] < TOL, result
    assert result["control"] > MISSES, result  # accelerate: each micro-batch's mean / 4, averaged over processes
    # 3 updates, each num_processes scheduler steps (torch's count starts at 1), as accelerate steps it
    assert result["scheduler"] == (1 + 3 * processes,) * 2, result
    assert result["lr"][0] == result["lr"][1] == pytest.approx(scripts.LR * scripts.decay(3 * processes))


def test_one_process_exact_where_accelerate_misses():
    _check_exact(_exact_and_control(1), 1)


def test_own_mean_loss_and_a_short_last_window():
    """10 rows in micro-batches of 3, accumulation 2: the last window holds 3 + 1 rows, each weighted by
    its rows; accelerate halves each micro-batch's mean."""
    rows = scripts.regression_rows(10)
    expected = scripts.mean_loss_reference(rows, window_rows=6)
    assert scripts.distance(scripts.run_mean_loss_script(True, rows), expected) < 1e-12
    assert scripts.distance(scripts.run_mean_loss_script(False, rows), expected) > MISSES


def test_clip_grad_norm_clips_the_whole_window():
    """clip_grad_norm_ at the syncing micro-step: the norm before clipping is the whole global batch's
    gradient's, and the update is the full batch's clipped one."""
    rows = scripts.padded_rows(scripts.GLOBAL_BATCH)
    accelerator, model, optimizer, loader, _ = scripts.build(True, rows, 1)
    norms = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.1))
            optimizer.step()
            optimizer.zero_grad()
    reference = scripts.llama(layers=2)
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    reference(**batch).loss.backward()
    full_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    torch.optim.SGD(reference.parameters(), lr=scripts.LR, momentum=scripts.MOMENTUM).step()
    assert len(norms) == 1 and float(norms[0]) == pytest.approx(float(full_norm), rel=TOL)
    assert scripts.distance(accelerator.get_state_dict(model), reference.state_dict()) < TOL
    accelerator.free_memory()


def test_save_model_loads_with_from_pretrained(tmp_path):
    from transformers import LlamaForCausalLM

    accelerator, model, *rest = scripts.build(True, scripts.padded_rows(scripts.GLOBAL_BATCH), 1)
    scripts.train_epoch(accelerator, model, *rest)
    accelerator.save_model(model, tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).state_dict()
    trained = accelerator.get_state_dict(model)
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)
    accelerator.free_memory()


def test_automatic_checkpoint_naming_keeps_total_limit(tmp_path):
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(gradient_accumulation_steps=4, project_config=project)
    _prepared(accelerator)
    for _ in range(3):
        accelerator.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    accelerator.load_state()  # the newest
    assert accelerator.save_state().endswith("checkpoint_3")
    accelerator.free_memory()


# -- two processes: one spawn, several scenarios ----------------------------------------------------
def _two_processes(rank, world_size):
    return _exact_and_control(world_size)


def _zero3(rank, world_size):
    rows = scripts.padded_rows(ROWS)
    trained = scripts.run_script(True, rows, world_size,
                                 microstep_config={"zero_optimization": {"stage": 3}})
    return scripts.distance(trained["state"], scripts.reference(rows, world_size))


def _resume(rank, world_size, folder):
    """Two epochs straight, against one epoch, save_state, a fresh script (another initialisation) that
    load_state's and runs the second epoch."""
    rows = scripts.padded_rows(ROWS)
    accelerator, *parts = scripts.build(True, rows, world_size)
    scripts.train_epoch(accelerator, *parts)
    accelerator.save_state(folder)
    scripts.train_epoch(accelerator, *parts)
    straight = accelerator.get_state_dict(parts[0])
    straight_lr = parts[3].get_last_lr()
    accelerator.free_memory()
    resumed, *again = scripts.build(True, rows, world_size, seed=7)
    resumed.load_state(folder)
    scripts.train_epoch(resumed, *again)
    after = resumed.get_state_dict(again[0])
    return max(float((straight[k] - after[k]).abs().max()) for k in straight), straight_lr, again[3].get_last_lr()


def _router_term_two(rank, world_size):
    return _router_term(world_size)


def _collectives(door: bool):
    """What an evaluation loop gathers: 5 samples, 2 per process (the last global batch completed with
    the first samples, which gather_for_metrics drops), and the other helpers' answers."""
    accelerator = scripts.accelerator_class(door)()
    loader = accelerator.prepare(DataLoader([torch.tensor([i]) for i in range(5)], batch_size=2))
    seen, gathered = [], []
    for batch in loader:
        seen.append(batch.flatten().tolist())
        gathered.append(accelerator.gather_for_metrics(batch).flatten().tolist())
    objects = accelerator.gather_for_metrics([f"row{i}" for i in seen[-1]], use_gather_object=True)
    with accelerator.split_between_processes(list(range(5))) as part:
        split = part
    with accelerator.split_between_processes({"a": list(range(3)), "b": list("xyz")}, apply_padding=True) as part:
        padded = part
    total = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0]), reduction="sum").tolist()
    return {"seen": seen, "gathered": gathered, "objects": objects, "split": split, "padded": padded, "sum": total,
            "gather": accelerator.gather(torch.tensor([accelerator.process_index])).tolist()}


def _sharding(door: bool, split_batches: bool, drop_last: bool):
    """The batches each process gets of 7 samples in batches of 4 (split_batches: each cut in two)."""
    from accelerate import DataLoaderConfiguration

    loading = DataLoaderConfiguration(split_batches=split_batches)
    accelerator = scripts.accelerator_class(door)(dataloader_config=loading)
    loader = accelerator.prepare(DataLoader([torch.tensor([i]) for i in range(7)], batch_size=4, drop_last=drop_last))
    return [(batch.flatten().tolist(), accelerator.gather_for_metrics(batch).flatten().tolist()) for batch in loader]


def _collectives_alike(rank, world_size):
    shardings = [(split, drop) for split in (False, True) for drop in (False, True)]
    return ((_collectives(True), *[_sharding(True, *case) for case in shardings]),
            (_collectives(False), *[_sharding(False, *case) for case in shardings]))


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_processes(tmp_path):
    results = run_scenarios({
        "exact": _two_processes,
        "router term": _router_term_two,
        "zero3": _zero3,
        "resume": functools.partial(_resume, folder=str(tmp_path / "state")),
        "collectives": _collectives_alike,
    }, world_size=2, timeout=200)
    for result in results["exact"]:
        _check_exact(result, 2)
    for result in results["router term"]:
        _check_router_term(result)
    assert all(distance < TOL for distance in results["zero3"]), results["zero3"]
    for difference, straight_lr, resumed_lr in results["resume"]:
        assert difference == 0.0 and straight_lr == resumed_lr, results["resume"]
    for door, control in results["collectives"]:
        assert door == control
    assert results["collectives"][0][0][0]["gathered"] == [[0, 1, 2, 3], [4]]


# -- settings: honoured or refused by name ---------------------------------------------------------
def _prepared(accelerator, model=None):
    model = model if model is not None else scripts.llama(layers=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def test_accumulation_and_config_from_the_environment(tmp_path, monkeypatch):
    config = tmp_path / "microstep.yaml"
    config.write_text("gradient_clipping: 0.5\nzero_optimization:\n  stage: 1\n")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")  # accelerate launch's
    monkeypatch.setenv("MICROSTEP_CONFIG", str(config))
    accelerator = Accelerator()
    assert accelerator.gradient_accumulation_steps == 2
    _prepared(accelerator)
    eng = accelerator.engine
    assert eng.plan.gradient_accumulation_steps == 2
    assert eng.gradient_clipping == 0.5 and eng.config.zero_optimization.stage == 1
    accelerator.free_memory()


def test_deepspeed_launch_settings_become_the_config():
    environ = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
               "ACCELERATE_GRADIENT_CLIPPING": "1.0", "ACCELERATE_MIXED_PRECISION": "no",
               "ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DEBUG_MODE": "false"}
    settings = read_settings({"gradient_accumulation_steps": 4}, environ)
    assert settings.config.zero_optimization.stage == 2 and settings.config.gradient_clipping == 1.0
    assert settings.accumulation == 4 and settings.mixed_precision == "no"


@pytest.mark.parametrize("arguments, environ, named", [
    ({}, {"ACCELERATE_USE_FSDP": "true"}, "ACCELERATE_USE_FSDP"),
    ({}, {"ACCELERATE_MIXED_PRECISION": "fp8"}, "fp8"),
    ({}, {"ACCELERATE_DYNAMO_BACKEND": "aot_eager"}, "ACCELERATE_DYNAMO_BACKEND"),
    ({"fsdp_plugin": object()}, {}, "fsdp_plugin"),
    ({"kwargs_handlers": [object()]}, {}, "kwargs_handlers"),
    ({"gradient_accumulation_steps": 4, "microstep_config": {"gradient_accumulation_steps": 2}}, {},
     "gradient_accumulation_steps"),
    ({"microstep_config": {"train_batch_size": 8}}, {}, "train_batch_size"),
])
def test_refusals_name_the_setting(arguments, environ, named):
    with pytest.raises((ConfigError, EngineUsageError), match=named):
        read_settings(arguments, environ)


def _router_term(processes: int) -> dict:
    rows = scripts.moe_rows(ROWS)
    expected = scripts.moe_reference(rows)
    micro_batch_term = {"moe": {"load_balance": "micro_batch"}}
    return {"door": scripts.distance(scripts.run_moe_script(True, rows, processes), expected),
            "door, the term per micro-batch": scripts.distance(
                scripts.run_moe_script(True, rows, processes, microstep_config=micro_batch_term), expected),
            "control": scripts.distance(scripts.run_moe_script(False, rows, processes), expected)}


def _check_router_term(result: dict) -> None:
    assert result["door"] < TOL, result
    assert result["door, the term per micro-batch"] > 1e-4, result  # the window's term is what makes it exact
    assert result["control"] > MISSES, result


def test_router_term_one_process():
    """A Mixtral's .loss with its load-balancing term: the door holds each window and runs it whole."""
    _check_router_term(_router_term(1))


def test_router_term_window_takes_the_model_loss_unchanged():
    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, _ = _prepared(accelerator, hf_moe())
    batch = {key: value[None] for key, value in scripts.moe_rows(1)[0].items()}
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        with pytest.raises(EngineUsageError, match="unchanged"):
            accelerator.backward(loss * 2)
    accelerator.free_memory()


def test_backward_outside_accumulate_refused():
    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, _ = _prepared(accelerator)
    batch = scripts.padded_rows(2)[0]
    loss = model(**{key: value[None] for key, value in batch.items()}).loss
    with pytest.raises(EngineUsageError, match="accumulate"):
        accelerator.backward(loss)
    accelerator.free_memory()


# -- the example script, launched as its users launch it -------------------------------------------
EXAMPLE = REPO / "examples" / "accelerate_clm.py"
EXAMPLE_ARGS = ["--max_lines", "120", "--float64", "--checkpointing_steps", "3", "--with_tracking"]
# AdamW divides by sqrt(v) + 1e-8: gradient entries near zero, where float32 rounding inside Llama's
# RMSNorm leaves relative noise, move by up to lr x that noise. Measured: the door 5.3e-7 from the
# reference, a second exact schedule of the reference itself (micro-batched sums) 4.6e-8; accelerate 1.7e-2.
ADAM_TOL = 2e-6


def _run(command: list[str], **extra_env) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_first_on_path(REPO), "CUDA_VISIBLE_DEVICES": "",
           **extra_env}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-4000:]}"
    return result.stdout


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@functools.lru_cache(maxsize=1)
def _clm_reference() -> dict:
    return scripts.clm_reference(120, 2)


def _saved_distance(folder: Path) -> float:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64)
    return scripts.distance(model.state_dict(), _clm_reference())


def test_clm_example_resumes_mid_epoch(tmp_path):
    """One process: the run saved at step 3, resumed by a second run (load_state, skip_first_batches), ends
    with the uninterrupted run's weights."""
    from transformers import LlamaForCausalLM

    from examples import accelerate_clm

    args = ["--max_lines", "60", "--float64", "--checkpointing_steps", "3"]
    accelerate_clm.main([*args, "--output_dir", str(tmp_path / "straight")])
    accelerate_clm.main([*args, "--output_dir", str(tmp_path / "resumed"),
                         "--resume_from_checkpoint", str(tmp_path / "straight" / "step_3")])
    straight, resumed = (LlamaForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float64).state_dict()
                         for name in ("straight", "resumed"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_clm_example_under_python_m_launch(tmp_path):
    door_dir, control_dir = tmp_path / "door", tmp_path / "control"
    out = _run([sys.executable, "-m", "launch", "--nproc-per-node", "2", str(EXAMPLE), *EXAMPLE_ARGS,
                "--output_dir", str(door_dir)])
    # 108 training rows, 4 per micro-step over 2 processes: 6 windows of 4 micro-steps and a short one of 3
    assert re.search(r"^epoch 0: perplexity: [\d.]+ eval_loss: [\d.]+ steps: 7 lr: 0$", out, re.M), out
    assert (door_dir / "step_6").is_dir() and "eval_loss" in (door_dir / "metrics.jsonl").read_text()
    original = tmp_path / "run_clm_original.py"  # the one line as accelerate users write it
    source = EXAMPLE.read_text()
    changed = "from engine.compat.accelerate import Accelerator"
    assert source.count(changed) == 1
    original.write_text(source.replace(changed, "from accelerate import Accelerator"))
    # accelerate spreads a CPU job over processes only when told cpu (ACCELERATE_USE_CPU, as its --cpu sets)
    _run([sys.executable, "-m", "launch", "--nproc-per-node", "2", str(original), *EXAMPLE_ARGS,
          "--train_file", str(REPO / "examples" / "data" / "corpus.txt"), "--output_dir", str(control_dir)],
         ACCELERATE_USE_CPU="1")
    assert _saved_distance(door_dir) < ADAM_TOL
    assert _saved_distance(control_dir) > MISSES


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_clm_example_under_accelerate_launch(tmp_path):
    config = tmp_path / "accelerate.yaml"  # what `accelerate config` writes for 2 processes on one machine
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_machines: 1\n"
                      "num_processes: 2\nmachine_rank: 0\nmixed_precision: 'no'\ndynamo_config: {}\n"
                      "rdzv_backend: static\nsame_network: true\nuse_cpu: false\n")
    launcher = Path(sys.executable).with_name("accelerate")
    out = _run([str(launcher), "launch", "--config_file", str(config), "--main_process_port", str(_free_port()),
                str(EXAMPLE),
                *EXAMPLE_ARGS, "--output_dir", str(tmp_path / "out")])
    assert re.search(r"^epoch 0: perplexity: [\d.]+ eval_loss: [\d.]+ steps: 7 lr: 0$", out, re.M), out
    assert _saved_distance(tmp_path / "out") < ADAM_TOL
