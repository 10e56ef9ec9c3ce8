"""engine.compat.trl: TRL's SFT script with its import line changed trains the whole global batch's SFT
objective on padding-free packed rows (float64 full-batch reference), a Mixtral's router term over the
global batch included, on 1 and 2 processes and under ZeRO 3, where TRL's own SFTTrainer, run beside it,
misses the term; it saves a model from_pretrained loads."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support import hf_trainer as h
from tests.support import trl_runs as r
from tests.support.dist_utils import repo_first_on_path, run_scenarios
from tests.support.hf_trainer import MISSED, TOL, trained_state
from tests.support.reference import max_param_diff, state

trl = pytest.importorskip("trl")

from engine.compat.trl import SFTConfig, SFTTrainer  # noqa: E402


def test_padding_free_rows_and_router_term_exact_on_one_process_where_trl_misses_the_term(tmp_path):
    assert r.against_reference(0, 1, "dense", str(tmp_path / "dense")) < TOL
    assert r.against_reference(0, 1, "moe", str(tmp_path / "moe")) < TOL
    assert r.against_reference(0, 1, "moe", str(tmp_path / "trl"), door=False) > MISSED


def test_the_sft_model_saved_loads_with_from_pretrained(tmp_path):
    import transformers

    trainer = r.train(SFTTrainer, SFTConfig, "moe", r.dataset(8), str(tmp_path))
    trainer.save_model(str(tmp_path / "saved"))
    loaded = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float64,
                                                             experts_implementation="eager")
    assert max_param_diff(state(loaded), trained_state(trainer)) == 0
    logged = trainer.state.log_history[0]
    assert {"loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "aux_loss"} <= logged.keys()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_processes_padding_free_router_term_and_zero_3(tmp_path):
    out = str(tmp_path)
    results = run_scenarios({
        "moe": functools.partial(r.against_reference, kind="moe", out=out),
        "moe, TRL's own": functools.partial(r.against_reference, kind="moe", out=out, door=False),
        "moe, ZeRO 3": functools.partial(r.against_reference, kind="moe", out=out,
                                         microstep={"zero_optimization": {"stage": 3}}),
    }, world_size=2, timeout=200)
    assert max(results["moe"]) < TOL and max(results["moe, ZeRO 3"]) < TOL, results
    assert min(results["moe, TRL's own"]) > MISSED, results


SFT_ARGS = ["--learning_rate", "0.01", "--padding_free", "true", "--packing", "true", "--max_length", "64",
            "--max_steps", "2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--max_train_samples", "32",
            "--report_to", "none", "--use_cpu", "--bf16", "false", "--logging_steps", "1", "--save_strategy", "no",
            "--disable_tqdm", "true", "--dataset_file", h.CORPUS]


def test_the_sft_example_trains_padding_free_and_differs_from_its_original_import(tmp_path):
    import transformers

    saved = {}
    variants = h.example_variants(tmp_path, "trl_sft.py", door="from engine.compat.trl import SFTConfig, SFTTrainer",
                                  original="from trl import SFTConfig, SFTTrainer")
    for name, source in variants.items():
        h.run_example(source, ["--output_dir", str(tmp_path / name), *SFT_ARGS])
        saved[name] = state(transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / name)))
    assert max_param_diff(saved["door"], saved["original"]) > MISSED


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_the_sft_example_under_launch_on_two_processes(tmp_path):
    import transformers

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": repo_first_on_path(h.REPO)}
    done = subprocess.run([sys.executable, "-m", "launch", "--nproc-per-node", "2", "examples/trl_sft.py",
                           "--output_dir", str(tmp_path), *SFT_ARGS], cwd=h.REPO, env=env, capture_output=True,
                          text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-4000:]
    assert len(re.findall(r"'loss': '[\d.]+'", done.stdout + done.stderr)) == 2
    transformers.MixtralForCausalLM.from_pretrained(str(tmp_path))
