"""``python -m engine plan / validate``: in-process through ``main`` and as a real process."""
import argparse
import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import engine

from engine.cli import add_override_argument, main
from engine.config.schema import load_config
from tests.support.dist_utils import repo_first_on_path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


def run_module(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": repo_first_on_path(ROOT)}
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


@pytest.mark.parametrize("command, usage", [
    (["microstep"], "usage: microstep "),  # the console script pyproject installs
    (["python", "-m", "engine"], "usage: python -m engine "),
])
def test_usage_names_the_command_that_was_run(command, usage):
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if command[0] == "microstep":  # installed next to this interpreter
        command = [str(Path(sys.executable).parent / "microstep")]
        assert shutil.which(command[0]), "the microstep console script is not installed"
    else:
        command = [sys.executable, *command[1:]]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith(usage), result.stderr


def test_add_override_argument_is_repeatable():
    parser = argparse.ArgumentParser()
    add_override_argument(parser)
    args = parser.parse_args(["--set", "a=1", "--set", "b.c=true"])
    assert args.overrides == ["a=1", "b.c=true"]
    assert parser.parse_args([]).overrides == []


# -- validate: everything that needs no model ------------------------------------------
def validate(tmp_path, capsys, text: str, name: str = "c.yaml", *overrides: str):
    path = tmp_path / name
    path.write_text(text)
    status = main(["validate", str(path), *[arg for item in overrides for arg in ("--set", item)]])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, captured, path


@pytest.mark.parametrize("text, expected", [
    ("optimizer: {type: Adamm, params: {lr: 0.1}}\n",
     ":1: optimizer.type: unknown optimizer type 'Adamm'; did you mean Adam? known types: "),
    ("optimizer: {type: adamw, params: {lr: 0.1, wieght_decay: 0.01}}\n",
     ":1: optimizer.params: AdamW has no parameter 'wieght_decay'; did you mean "
     "weight_decay? its parameters: lr, betas, eps, weight_decay,"),
    ("optimizer: {type: SGD, params: {lr: auto}}\n",
     ":1: optimizer.params.lr: 'auto' is a Hugging Face Trainer placeholder; give a value"),
    ("optimizer: {type: SGD, params: {lr: -1.0}}\n", ":1: optimizer.params: SGD: Invalid learning rate: -1.0"),
    ("scheduler: {type: WarmupLRR}\n", ":1: scheduler.type: unknown scheduler type 'WarmupLRR'; did you mean WarmupLR?"),
    ("scheduler:\n  type: steplr\n  params: {step_sise: 2}\n",
     ":3: scheduler.params: StepLR has no parameter 'step_sise'; did you mean step_size?"),
    ("scheduler:\n  type: WarmupLR\n  params: {warmup_type: cubic}\n",
     ":3: scheduler.params: WarmupLR: warmup_type must be 'log' or 'linear', got 'cubic'"),
])
def test_validate_checks_optimizer_and_scheduler(tmp_path, capsys, text, expected):
    status, captured, path = validate(tmp_path, capsys, text)
    assert status == 2 and f"{path}{expected}" in captured.err


@pytest.mark.parametrize("params", [
    "{lr: 0.001, betas: [0.9, 0.95], adam_w_mode: true, torch_adam: true}",  # DeepSpeed's AdamW
    "{lr: 0.001, adam_w_mode: false}",
])
def test_validate_accepts_deepspeed_adam(tmp_path, capsys, params):
    status, captured, _ = validate(tmp_path, capsys, f"train_batch_size: 8\noptimizer: {{type: Adam, params: {params}}}\n")
    assert status == 0, captured.err


@pytest.mark.parametrize("text, overrides, problem", [
    ("train_batch_size: 32\ngradient_accumulation_steps: 4\n", ["train_micro_batch_size_per_gpu=auto"],
     "train_micro_batch_size_per_gpu 'auto' derives gradient_accumulation_steps; remove gradient_accumulation_steps"),
    ("train_micro_batch_size_per_gpu: explore\n", [], "train_micro_batch_size_per_gpu 'explore' needs train_batch_size"),
    ("train_batch_size: 32\ntrain_micro_batch_size_per_gpu: 3\ngradient_accumulation_steps: 4\n", [],
     "train_batch_size 32 must be train_micro_batch_size_per_gpu 3 × gradient_accumulation_steps 4 × world size, "
     "and 32 / (3 × 4) = 2.667 is no whole number of processes; nearest valid train_batch_size: 24 or 36"),
    ("optimizer: {type: SGD, params: {lr: 0.1}}\n", [], "set train_batch_size or train_micro_batch_size_per_gpu"),
    ("micro_batch_tokens: 64\ngradient_accumulation_steps: 2\n", [], "micro_batch_tokens: needs train_batch_size"),
])
def test_validate_refuses_what_initialize_refuses_at_any_world_size(tmp_path, capsys, text, overrides, problem):
    status, captured, _ = validate(tmp_path, capsys, text, "c.yaml", *overrides)
    assert status == 2 and problem in captured.err, captured.err
    model = torch.nn.Linear(2, 2)
    with pytest.raises(engine.MicrostepError, match=re.escape(problem)):  # the same words from initialize
        engine.initialize(model, str(tmp_path / "c.yaml"), overrides=overrides,
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def test_validate_removes_a_key_with_null(tmp_path, capsys):
    text = "train_batch_size: 32\ngradient_accumulation_steps: 4\n"
    status, captured, _ = validate(tmp_path, capsys, text, "c.yaml", "train_micro_batch_size_per_gpu=auto",
                                   "gradient_accumulation_steps=null")
    assert status == 0 and "micro auto, accumulation -" in captured.out, captured.err


def test_validate_checks_a_scheduler_without_an_optimizer_section(tmp_path, capsys):
    # the script passes its own optimizer; a momentum-cycling schedule still checks out
    status, captured, _ = validate(tmp_path, capsys,
                                   "train_batch_size: 8\nscheduler: {type: OneCycleLR, params: {max_lr: 0.1, "
                                   "total_steps: 10}}\n")
    assert status == 0, captured.err


def test_validate_reports_every_problem_at_once(tmp_path, capsys):
    status, captured, path = validate(tmp_path, capsys, """\
train_batch_size: 8
optimizer:
  type: AdamW
  params: {lr: -1, wieght_decay: 0.1}
scheduler:
  type: WarmupLR
  params: {warmup_num_step: 10}
backend: deepspeed
gradient_allreduce_op: sum
""")
    assert status == 2 and captured.out == ""
    lines = captured.err.splitlines()
    assert lines[0] == "error:"
    assert [line.split(": ")[1] for line in lines[1:]] == [
        "optimizer.params", "optimizer.params", "scheduler.params", "gradient_allreduce_op"]
    assert lines[1].startswith(f"{path}:4: ") and lines[4].startswith(f"{path}:9: ")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_validate_half_precision_on_this_machine(tmp_path, capsys, precision):
    status, captured, _ = validate(tmp_path, capsys, f"train_batch_size: 8\n{precision}: {{enabled: true}}\n")
    assert status == 0, captured.err
    assert captured.out.rstrip().endswith(precision)


def test_validate_refuses_a_dtype_autocast_turns_off(tmp_path, capsys, monkeypatch):
    class RefusingAutocast:
        def __init__(self, device, dtype):
            import warnings
            warnings.warn("In CPU autocast, but the target dtype is not supported. Disabling autocast.")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("torch.autocast", RefusingAutocast)
    status, captured, path = validate(tmp_path, capsys, "seed: 1\nfp16:\n  enabled: true\n")
    assert status == 2
    assert (f"{path}:3: fp16.enabled: autocast on cpu does not run in torch.float16 with torch "
            in captured.err)
    assert "(In CPU autocast, but the target dtype is not supported. Disabling autocast.)" in captured.err


def test_validate_refuses_bf16_on_a_gpu_without_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.is_bf16_supported", lambda: False)
    monkeypatch.setattr("torch.cuda.get_device_name", lambda *args: "Tesla V100")
    status, captured, path = validate(tmp_path, capsys, "bf16: {enabled: true}\n")
    assert status == 2
    assert (f"{path}:1: bf16.enabled: this GPU (Tesla V100) has no bf16 support; use fp16.enabled "
            "instead") in captured.err


def test_validate_deepspeed_backend_without_the_package(tmp_path, capsys, monkeypatch):
    from engine.strategies.deepspeed import INSTALL_HINT

    monkeypatch.setattr("engine.config.checks.find_spec",
                        lambda name: None if name == "deepspeed" else importlib.util.find_spec(name))
    status, captured, path = validate(tmp_path, capsys, "train_batch_size: 8\nbackend: deepspeed\n")
    assert status == 2
    assert f"error: {path}:2: {INSTALL_HINT}" in captured.err


def test_validate_deepspeed_backend_refusals(tmp_path, capsys):
    status, captured, path = validate(tmp_path, capsys, """\
train_batch_size: 8
train_micro_batch_size_per_gpu: auto
zero_optimization: {stage: 3}
backend: deepspeed
""")
    assert status == 2
    assert f"{path}:2: train_micro_batch_size_per_gpu: auto with backend deepspeed needs ZeRO stage 0, 1 or 2" \
        in captured.err


def test_validate_colossal_config(tmp_path, capsys):
    status, captured, _ = validate(tmp_path, capsys, """\
from colossalai.amp import AMP_TYPE
BATCH_SIZE = 128
gradient_accumulation = 4
clip_grad_norm = 1.0
fp16 = dict(mode=AMP_TYPE.TORCH)
parallel = dict(pipeline=1, tensor=dict(size=1, mode=None))
num_epochs = 2
""", "config.py")
    assert status == 0
    assert "accumulation 4" in captured.out and captured.out.rstrip().endswith("fp16")
    assert "warning:" in captured.err and "colossalai_extras: num_epochs" in captured.err


@pytest.mark.parametrize("name", ["mlp.yaml", "deepspeed_zero2.json", "param_unchanged.py", "lm_tiny.yaml",
                                  "colossalai_legacy.py"])
def test_shipped_configs_pass_the_model_free_checks(name):
    from engine.config.checks import check_without_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert check_without_model(load_config(CONFIGS / name)) == []


@pytest.mark.parametrize("value, hint", [("autoo", "; did you mean auto?"), ("Auto", "; did you mean auto?"),
                                         ("nevr", "; did you mean never?"), ("latest", "")])
def test_validate_refuses_a_resume_word_that_is_no_path_as_initialize_does(tmp_path, capsys, value, hint):
    """Issue 45: ``resume: autoo`` passed validate; initialize then refused it (or, with checkpoints in
    checkpoint.dir, resumed from the newest as for any path)."""
    problem = f"checkpoint.resume: '{value}' is neither auto, never nor an existing path{hint} (auto:"
    status, captured, _ = validate(tmp_path, capsys, f"train_batch_size: 2\ncheckpoint: {{resume: {value}}}\n", "c.yaml")
    assert status == 2 and problem in captured.err, captured.err
    with pytest.raises(engine.ConfigError, match=re.escape(problem)):
        engine.initialize(torch.nn.Linear(2, 2), str(tmp_path / "c.yaml"),
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def test_validate_accepts_resume_words_and_paths(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "step_4").mkdir()
    for value in ("auto", "never", "step_4", "runs/step_8", str(tmp_path / "step_4")):
        status, captured, _ = validate(tmp_path, capsys, f"train_batch_size: 2\ncheckpoint: {{resume: {value}}}\n")
        assert status == 0, (value, captured.err)


# -- plot ------------------------------------------------------------------------------
def dense_metrics(tmp_path, steps: int = 5):
    """A dense model's monitor files (JSON lines with an eval record, CSV): token counts, no MFU on a CPU."""
    jsonl, csv_path = tmp_path / "metrics.jsonl", tmp_path / "metrics.csv"
    eng = engine.initialize(torch.nn.Linear(4, 4), {
        "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "monitor": {"enabled": True, "progress": False, "jsonl": str(jsonl), "csv": str(csv_path)}})
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        eng.train_batch(x, lambda m, b: (((m(b) - b) ** 2).sum(), b.numel()))
    eng.monitor.log_eval(eng.global_steps, 0.5)
    eng.close()
    return jsonl, csv_path


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_plot_draws_a_dense_models_metrics(tmp_path, capsys, kind):
    pytest.importorskip("matplotlib")
    metrics = dense_metrics(tmp_path)[0 if kind == "jsonl" else 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        assert main(["plot", str(metrics), "--out", str(tmp_path / "m.png")]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(tmp_path / "m.png") and captured.err == ""  # no "unclosed file"
    assert (tmp_path / "m.png").stat().st_size > 0
    assert main(["plot", str(metrics), "--out", str(tmp_path / "p.png"), "--per-panel"]) == 0
    assert sorted(path.name for path in tmp_path.glob("p_*.png")) == \
        ["p_grad_norm.png", "p_loss.png", "p_lr.png", "p_mfu.png", "p_throughput.png"]


def test_plot_axes_are_readable(tmp_path):
    pytest.importorskip("matplotlib")
    from engine.monitor.plot import draw_figure, read_metrics

    train, evals = read_metrics(dense_metrics(tmp_path, steps=5)[0])
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5] and evals[0]["eval_loss"] == 0.5
    figure = draw_figure(train, evals)
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    axes = [axis for axis in figure.axes if axis.get_visible()]
    assert [axis.get_title() for axis in axes] == ["loss", "learning rate", "gradient norm", "tokens/s", "MFU"]
    for axis in axes:
        ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), (axis.get_title(), ticks)  # no 1.25, 1.5
        legend = axis.get_legend()
        if legend is not None:  # beside the chart, not over it
            assert not legend.get_window_extent(renderer).overlaps(axis.get_window_extent(renderer))
    assert axes[0].get_legend() is not None  # train and eval
    assert "monitor.peak_flops" in axes[-1].texts[0].get_text()  # a CPU run records no MFU: the panel says why


def test_plot_a_missing_or_foreign_file_is_one_line(tmp_path):
    result = run_module("plot", str(tmp_path / "nope.jsonl"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.jsonl'}: no such file (the monitor "
                                                  "writes it where monitor.jsonl or monitor.csv says)"]
    (tmp_path / "notes.txt").write_text("hello\n")
    result = run_module("plot", str(tmp_path / "notes.txt"))
    assert result.returncode == 2 and "not a monitor metrics file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_plot_an_empty_file_says_it_is_empty(tmp_path):
    (tmp_path / "monitor.jsonl").write_text("")
    result = run_module("plot", str(tmp_path / "monitor.jsonl"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'monitor.jsonl'}: is empty: the monitor writes "
                                                  "one record per logged optimizer step (monitor.log_every), and "
                                                  "this run has logged none yet"]
