"""``python -m engine plan / validate``: in-process through ``main`` and as a real process."""
import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import add_override_argument, main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def run_module(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


# -- as a process ----------------------------------------------------------------------
def test_plan_prints_a_table():
    result = run_module("plan", "configs/balanced.yaml", "--world-size", "4")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["world", "size:", "4"]
    assert "ranks 0-1:" in result.stdout and "8 samples, micro-batches 4,4" in result.stdout
    assert "ranks 2-3:" in result.stdout and "7 samples, micro-batches 4,3" in result.stdout
    assert "accumulation steps: 2" in result.stdout
    assert "note: train_batch_size 30 does not divide by world size 4" in result.stdout


def test_invalid_config_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train_batch_size: 32\ngradient_acumulation_steps: 4\n")
    result = run_module("plan", str(bad), "--world-size", "2")
    assert result.returncode == 2
    assert "gradient_acumulation_steps: unknown key; did you mean" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_validate_as_a_process():
    result = run_module("validate", "configs/deepspeed_zero2.json", "--set", "backend=deepspeed")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OK: configs/deepspeed_zero2.json")
    assert result.stderr == ""  # the DeepSpeed backend uses steps_per_print: no warning


# -- in process ------------------------------------------------------------------------
def test_plan_with_overrides_and_rank(capsys):
    status = main(["plan", str(CONFIGS / "mlp.yaml"), "--world-size", "2", "--rank", "1",
                   "--set", "train_micro_batch_size_per_gpu=8"])
    out = capsys.readouterr().out
    assert status == 0
    assert "ranks 0-1:" in out and "16 samples, micro-batches 8,8" in out
    assert "micro-batch cap:    8" in out


def test_plan_rejects_an_impossible_world_size(capsys):
    assert main(["plan", str(CONFIGS / "mlp.yaml"), "--world-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "train_batch_size 32 is not divisible by world size 3" in err
    assert "nearest valid train_batch_size: 24 or 36" in err


def test_plan_explains_auto(capsys):
    assert main(["plan", str(CONFIGS / "mlp.yaml"), "--world-size", "2",
                 "--set", "train_micro_batch_size_per_gpu=auto", "--set", "auto_max=4"]) == 0
    assert "4 (auto: provisional" in capsys.readouterr().out


def test_validate_reports_every_problem(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": "32",\n  "zero_optimization": {"stage": 5}\n}\n')
    assert main(["validate", str(bad), "--set", "sed=1"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: train_batch_size: expected an integer, got '32' (str)" in err
    assert f"{bad}:3: zero_optimization.stage: must be <= 3, got 5" in err
    assert "--set: sed: unknown key; did you mean seed?" in err


def test_validate_summary_and_warning(capsys):
    assert main(["validate", str(CONFIGS / "deepspeed_zero2.json")]) == 0
    captured = capsys.readouterr()
    assert "zero stage 2" in captured.out and "optimizer AdamW" in captured.out
    assert "warning:" in captured.err and "steps_per_print" in captured.err


def test_validate_python_config(capsys):
    assert main(["validate", str(CONFIGS / "param_unchanged.py")]) == 0
    assert "accumulation 4" in capsys.readouterr().out


def test_missing_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as caught:
        main([])
    assert caught.value.code == 2


def test_add_override_argument_is_repeatable():
    parser = argparse.ArgumentParser()
    add_override_argument(parser)
    args = parser.parse_args(["--set", "a=1", "--set", "b.c=true"])
    assert args.overrides == ["a=1", "b.c=true"]
    assert parser.parse_args([]).overrides == []
