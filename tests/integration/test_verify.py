"""``python -m engine verify`` / ``engine.verify``: a config on N CPU processes against one
process on the whole global batch. The Hugging Face script of examples/verify_llama.py is
equal on 2 processes with ZeRO 3 and accumulation 4; its classic per-micro-batch token mean
(the broken variant) is not, and the verdict names the tensor and the fix."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine
from engine.cli import main
from engine.config.factories import FactoryError, reference_of
from engine.verify import TOLERANCE_EXACT, TOLERANCE_ROUNDED, VerifyError, prepare_model
from tests.support import verify_models

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ["configs/verify_llama.yaml", "--nproc", "2", "--model", "examples.verify_llama:model",
         "--batch", "examples.verify_llama:batch"]
MLP_CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}}


@pytest.fixture(autouse=True)
def in_repository(monkeypatch):
    monkeypatch.chdir(ROOT)  # the references name modules from the repository root
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def verify_lines(capsys, *args) -> tuple[int, list[str]]:
    status = main(["verify", *args])
    return status, capsys.readouterr().out.splitlines()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_hugging_face_llama_with_sum_count_loss_is_equal_on_zero3_accumulation_4(capsys):
    status, lines = verify_lines(capsys, *LLAMA, "--loss", "examples.verify_llama:loss_sum")
    assert status == 0, "\n".join(lines)
    assert lines[-1].startswith("equal: every tensor within 0.001 of its update after 2 steps on 2 processes")
    assert "it computes parts in float32" in lines[-1]  # Llama's RMSNorm: the looser tolerance, and why
    assert any(line.startswith("2 processes: step 2/2 loss") for line in lines)  # progress while it runs
    assert any(line.startswith("one process: step 2/2 loss") for line in lines)
    assert lines[-7].split() == ["tensor", "relative", "|difference|", "|update|"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_classic_token_mean_loss_is_not_equal_and_names_the_fix(capsys):
    status, lines = verify_lines(capsys, *LLAMA, "--loss", "examples.verify_llama:loss_mean", "--show", "3")
    assert status == 1, "\n".join(lines)
    verdict = lines[-1]
    assert verdict.startswith("not equal: model.") and " differs by " in verdict
    worst = float(verdict.split(" differs by ")[1].split()[0])
    assert worst > 100 * TOLERANCE_ROUNDED[torch.float64]  # far outside, not a rounding call
    assert "tolerance 0.001" in verdict and "fix: loss_fn should return (loss_sum, num_tokens)" in verdict
    assert lines[-2].startswith("cause: loss_fn is not a mean over its micro-batch's samples")


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_float64_model_is_held_to_the_exact_tolerance_and_a_broken_loss_misses_it():
    lines = []
    result = engine.verify(MLP_CONFIG, verify_models.plain_mlp, verify_models.regression, verify_models.mean_loss,
                           nproc=2, steps=3, echo=lines.append)
    assert result.equal and result.tolerance == TOLERANCE_EXACT, lines
    assert result.differences[0].relative < 1e-10  # float64 throughout: last bits only
    assert result.parallel_losses == pytest.approx(result.losses, rel=1e-12)
    assert "computes in float64 throughout" in result.verdict
    broken = engine.verify(MLP_CONFIG, verify_models.plain_mlp, verify_models.regression,
                           "tests.support.verify_models:summed_as_mean", nproc=2, steps=3, echo=None)
    assert not broken.equal and broken.differences[0].relative > 1e-2
    assert "fix: loss_fn should return" in broken.verdict


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_dropout_and_batchnorm_are_named_and_compared_without_what_cannot_be_equal():
    lines = []
    result = engine.verify(MLP_CONFIG, verify_models.mlp_with_dropout_and_batchnorm, verify_models.regression,
                           verify_models.mean_loss, nproc=2, echo=lines.append)
    assert result.equal, lines
    dropout, batchnorm = result.notes[:2]
    assert dropout.startswith("dropout switched off in both runs (3)") and "different random masks" in dropout
    assert batchnorm.startswith("BatchNorm normalises with its running statistics in both runs (1)")
    assert "not the global batch's" in batchnorm
    assert f"note: {dropout}" in lines


# -- without processes -------------------------------------------------------------------------
def test_prepare_model_turns_off_dropout_and_pins_batchnorm():
    model, notes = prepare_model(verify_models.mlp_with_dropout_and_batchnorm(), torch.float64)
    assert model[3].p == 0.0 and len(notes) == 2
    model.train()
    assert not model[1].training and model[0].training  # BatchNorm stays on its running statistics
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                         num_attention_heads=2, attention_dropout=0.1))
    _, notes = prepare_model(llama, torch.float64)
    assert "model.layers.0.self_attn.attention_dropout" in notes[0]
    assert llama.model.layers[0].self_attn.attention_dropout == 0.0


def test_mistakes_are_named_before_any_process_starts(capsys):
    with pytest.raises(FactoryError, match=r"returned different values for weight at two calls.*torch.manual_seed"):
        engine.verify(MLP_CONFIG, verify_models.unseeded_mlp, verify_models.regression, verify_models.mean_loss,
                      echo=None)
    with pytest.raises(VerifyError, match=r"--batch returned 8 rows for step 0, but the config's global batch is "
                                          r"train_batch_size 16"):
        engine.verify({**MLP_CONFIG, "train_batch_size": 16}, verify_models.plain_mlp, verify_models.regression,
                      verify_models.mean_loss, echo=None)
    with pytest.raises(VerifyError, match="no optimizer section"):
        engine.verify({"train_batch_size": 8}, verify_models.plain_mlp, verify_models.regression,
                      verify_models.mean_loss, echo=None)
    with pytest.raises(VerifyError, match="backend deepspeed cannot train float64 parameters.*--dtype float32"):
        engine.verify({**MLP_CONFIG, "backend": "deepspeed"}, verify_models.plain_mlp, verify_models.regression,
                      verify_models.mean_loss, echo=None)
    with pytest.raises(FactoryError, match="not bound to a name at the top level"):
        reference_of(lambda model, batch: 0, "loss")
    assert reference_of(verify_models.mean_loss, "loss") == "tests.support.verify_models:mean_loss"
    status = main(["verify", "configs/verify_llama.yaml", "--nproc", "3", "--model", "examples.verify_llama:model",
                   "--batch", "examples.verify_llama:batch", "--loss", "examples.verify_llama:loss_sum"])
    assert status == 2 and "train_batch_size 16 is not divisible by world size 3" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_process_that_fails_is_reported_with_its_output(monkeypatch):
    monkeypatch.setenv("VERIFY_TEST_FAIL_RANK", "1")
    with pytest.raises(VerifyError, match=r"(?s)rank 1 of the 2 processes failed.*failing on purpose on rank 1"):
        engine.verify(MLP_CONFIG, verify_models.plain_mlp, verify_models.regression, verify_models.fails_on_a_rank,
                      echo=None, timeout_seconds=240)


def test_half_precision_checkpoints_and_monitor_are_switched_off_with_a_note():
    from engine.config.schema import load_config
    from engine.verify import _verify_overrides

    config = load_config({"train_batch_size": 8, "bf16": {"enabled": True}, "checkpoint": {"dir": "runs/x"},
                          "torch_autocast": {"enabled": True, "dtype": "bfloat16"}})
    overrides, notes = _verify_overrides(config)
    assert overrides == ["bf16.enabled=false", "torch_autocast.enabled=false", "checkpoint.dir=null"]
    assert notes[0].startswith("bf16.enabled, torch_autocast.enabled switched off")
    assert notes[1] == "checkpoint.dir off: verify neither resumes from nor writes checkpoints"
    changed = load_config(config, overrides)
    assert not changed.bf16.enabled and changed.checkpoint.dir is None


SCRIPT = '''
import torch
import torch.nn.functional as F
import engine

def model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)

def batch(step):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=generator), torch.randn(8, 2, generator=generator)

def loss(m, b):
    return F.mse_loss(m(b[0]), b[1])

CONFIG = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
'''


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_functions_of_a_script_are_loaded_from_its_file_and_an_unguarded_call_is_explained(tmp_path):
    import subprocess
    import sys

    guarded = tmp_path / "guarded.py"
    guarded.write_text(SCRIPT + 'if __name__ == "__main__":\n    print(engine.verify(CONFIG, model, batch, loss).equal)\n')
    unguarded = tmp_path / "unguarded.py"
    unguarded.write_text(SCRIPT + "engine.verify(CONFIG, model, batch, loss)\n")
    runs = [subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240)
            for script in (guarded, unguarded)]
    assert runs[0].returncode == 0 and runs[0].stdout.splitlines()[-1] == "True", runs[0].stdout + runs[0].stderr
    assert runs[0].stdout.splitlines()[-2].startswith("equal: ")
    assert runs[1].returncode == 1
    assert "engine.verify was called again inside one of the processes it started" in runs[1].stderr
    assert "if __name__ == '__main__':" in runs[1].stderr


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_engine_error_in_a_process_is_its_one_line_cause(capsys):
    """README's verify command with context parallelism: loss_sum shifts its labels itself, which the engine's
    context check refuses; verify says that in one line, not the process's traceback."""
    status = main(["verify", "configs/verify_llama.yaml", "--nproc", "2", "--model", "examples.verify_llama:model",
                   "--batch", "examples.verify_llama:batch", "--loss", "examples.verify_llama:loss_sum",
                   "--set", "context_parallel.size=2"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and 'File "' not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: rank ") and "processes stopped: context_parallel: " \
        in lines[0], err


@pytest.mark.parametrize("kind", ["causal", "t5"])
def test_a_model_own_loss_the_engine_reads_gets_no_advice_to_return_sum_count(kind):
    """verify's cause check weighs a model's own ``.loss`` as the engine reads it (by the items its loss
    type averages, T5's unshifted labels included); a mean it cannot read still gets the advice."""
    from engine.verify import mean_over_samples_check
    from tests.support import own_loss as o

    plan = engine.resolve_batch_plan(1, train_batch_size=8, train_micro_batch_size_per_gpu=2)
    batch = o.batches(kind, 1)[0]
    check = lambda loss_fn: mean_over_samples_check(plan, lambda: o.model(kind), lambda step: batch, loss_fn,  # noqa: E731
                                                    torch.float64, TOLERANCE_EXACT)
    assert check(o.own_loss) is None
    assert check(lambda model, b: model(**b).loss * 1.0).startswith("loss_fn is not a mean over its micro-batch's")
