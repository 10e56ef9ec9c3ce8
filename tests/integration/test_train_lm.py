"""examples/train_lm.py: a small GPT trained on two processes and on one, same numbers."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_lm.py"
STEPS = 8
# Short runs: a short warm-up so the few steps learn something, evaluation every 4 steps.
QUICK = ["--steps", str(STEPS), "--set", "scheduler.params.warmup_num_steps=2",
         "--set", "constants.EVAL_EVERY=4", "--set", "monitor.log_every=1"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train_lm():
    return load("train_lm", EXAMPLE)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """The example under `python -m launch --nproc-per-node 2`, as a user runs it."""
    out = tmp_path_factory.mktemp("lm2")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "launch", "--nproc-per-node", "2", str(EXAMPLE), *QUICK,
         "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    return out, result


def check_learned(summary: dict) -> None:
    assert summary["steps"] == STEPS and len(summary["train_losses"]) == STEPS
    assert summary["first_loss"] == pytest.approx(math.log(61), abs=0.15)  # ~uniform over 61 chars
    assert summary["last_loss"] < summary["first_loss"] - 0.3
    evals = [loss for _, loss in summary["eval_losses"]]
    assert [step for step, _ in summary["eval_losses"]] == [0, 4, 8]
    assert evals[2] < evals[1] < evals[0]


@pytest.mark.distributed
@pytest.mark.timeout(180, func_only=True)  # the module fixture's run has its own timeout
def test_two_processes_learn_and_write_their_files(two_process_run):
    out, result = two_process_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["micro_batch_size"] == 8
    assert summary["accumulation_steps"] == 4 and summary["train_batch_size"] == 64
    check_learned(summary)
    assert (out / "loss.png").read_bytes()[:8] == PNG_MAGIC
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in train] == pytest.approx([loss for _, loss in summary["train_losses"]])
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in train)
    assert len({r["tokens"] for r in train}) > 1  # lines differ in length: token-weighted steps
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 4, 8]
    # Rank 0 alone reports: one summary, one progress line per step.
    assert result.stdout.count("loss curve:") == 1 and str(out / "loss.png") in result.stdout
    assert result.stderr.count(f"step {STEPS}/{STEPS}") == 1


@pytest.mark.distributed
@pytest.mark.timeout(180, func_only=True)
def test_one_process_trains_the_same_model(two_process_run, train_lm, tmp_path):
    """Global batch 64 = 2 × 8 × 4 on two processes, 1 × 16 × 4 on one: the same steps."""
    two = json.loads((two_process_run[0] / "summary.json").read_text())
    one = train_lm.main([*QUICK, "--out", str(tmp_path)])
    assert one["world_size"] == 1 and one["micro_batch_size"] == 16
    assert [loss for _, loss in one["train_losses"]] == pytest.approx(
        [loss for _, loss in two["train_losses"]], rel=1e-4)
    assert one["last_eval_loss"] == pytest.approx(two["last_eval_loss"], rel=1e-4)
    assert (tmp_path / "loss.png").exists() and (tmp_path / "metrics.jsonl").exists()


@pytest.mark.distributed
@pytest.mark.timeout(180, func_only=True)
@pytest.mark.parametrize("setting, says", [
    # the GPT's MLPs split over both processes (the automatic plan)
    ("tensor_parallel.size=2", "1 data-parallel rank(s) x 16 per micro-batch"),
    # every line split over both processes (head and tail chunks, padded by the engine to cut evenly)
    ("context_parallel.size=2", None),
], ids=["tensor", "context"])
def test_one_config_line_splits_the_model_over_two_processes_and_trains_the_same_model(two_process_run, tmp_path,
                                                                                      setting, says):
    """The unchanged script with one --set: one data-parallel rank of 16 × 4 lines, the same steps."""
    two = json.loads((two_process_run[0] / "summary.json").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "launch", "--nproc-per-node", "2", str(EXAMPLE), *QUICK,
         "--set", setting, "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    split = json.loads((tmp_path / "summary.json").read_text())
    assert split["micro_batch_size"] == 16 and split["accumulation_steps"] == 4
    assert [loss for _, loss in split["train_losses"]] == pytest.approx(
        [loss for _, loss in two["train_losses"]], rel=1e-4)
    assert split["last_eval_loss"] == pytest.approx(two["last_eval_loss"], rel=1e-4)
    if says is not None:
        assert says in result.stdout


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_micro_batch_tokens_trains_the_same_model(two_process_run, train_lm, tmp_path):
    """The same global batches formed into micro-batches by tokens: the same steps, less padding."""
    two = json.loads((two_process_run[0] / "summary.json").read_text())
    tokens = train_lm.main([*QUICK, "--micro-batch-tokens", "1024", "--out", str(tmp_path)])
    assert tokens["micro_batch_tokens"] == 1024 and 0 < tokens["padding_fraction"] < 0.2
    assert [loss for _, loss in tokens["train_losses"]] == pytest.approx(
        [loss for _, loss in two["train_losses"]], rel=1e-4)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert all(r["micro_steps"] > 1 and r["padded_tokens"] <= 1024 * r["micro_steps"] for r in train)
    assert all(r["real_tokens"] == r["tokens"] for r in train)  # every real input has a next-token label


@pytest.mark.timeout(240)
def test_resumed_from_a_checkpoint_it_goes_on_with_the_data_where_it_was(train_lm, tmp_path, capsys):
    """--set checkpoint.dir / every_steps (as docs/lm_example.md shows): run 8 steps saving every 4, drop the
    step-8 checkpoint, run the same command again: it resumes at step 4 and steps 5-8 see the same lines."""
    checkpoints = tmp_path / "checkpoints"
    command = [*QUICK, "--out", str(tmp_path / "out"), "--set", f"checkpoint.dir={checkpoints}",
               "--set", "checkpoint.every_steps=4", "--set", "checkpoint.async=false"]
    straight = train_lm.main(command)
    saved = sorted(path.name for path in checkpoints.iterdir() if path.name.startswith("step_"))
    assert saved == ["step_00000004", "step_00000008"]
    import shutil
    shutil.rmtree(checkpoints / saved[-1])
    capsys.readouterr()
    resumed = train_lm.main(command)
    out = capsys.readouterr().out
    assert resumed["first_step"] == 4 and resumed["eval_losses"][0][0] == 4  # not "eval step 0"
    assert [step for step, _ in resumed["train_losses"]] == [5, 6, 7, 8]
    assert [loss for _, loss in resumed["train_losses"]] == pytest.approx(
        [loss for step, loss in straight["train_losses"] if step > 4], rel=1e-6)
    assert "resumed at step 4" in out
    capsys.readouterr()
    train_lm.main(command)  # again: step 8 is saved, nothing is left
    assert "done: the run had already finished at step 8" in capsys.readouterr().out


def test_the_docs_show_the_checkpoint_flags():
    text = (REPO / "docs" / "lm_example.md").read_text()
    assert "--set checkpoint.dir=" in text and "--set checkpoint.every_steps=" in text


def test_hf_gpt2_model_trains(train_lm, tmp_path):
    pytest.importorskip("transformers")
    summary = train_lm.main([*QUICK, "--hf-model", "gpt2", "--out", str(tmp_path),
                             "--set", "monitor.enabled=false"])
    check_learned(summary)
    assert summary["sample"] is None  # sampling is the example's own GPT's
    assert (tmp_path / "loss.png").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_hf_model_without_transformers_says_how_to_install(train_lm, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SystemExit, match=r"needs the transformers package.*pip install transformers"):
        train_lm.main(["--steps", "1", "--hf-model", "gpt2", "--out", str(tmp_path)])


def test_batches_are_padded_and_token_weighted(train_lm):
    text = (REPO / "examples" / "data" / "corpus.txt").read_text()
    tokenizer = train_lm.CharTokenizer(text)
    lines = ["Four and four make eight.", "Rain."]
    data = train_lm.Lines(lines, tokenizer, block_size=192)
    batch = train_lm.collate([data[0], data[1]])
    assert batch["input_ids"].shape == batch["labels"].shape == (2, len(lines[0]) + 1)
    assert torch.equal(batch["attention_mask"], (batch["labels"] != -100).long())
    assert (batch["labels"] != -100).sum(dim=1).tolist() == [len(lines[0]) + 1, len(lines[1]) + 1]
    assert tokenizer.decode(batch["labels"][1, :6].tolist()) == "Rain.\n"
    assert batch["input_ids"][1, 0] == 0 and (batch["input_ids"][1, 6:] == 0).all()

    model = train_lm.GPT(train_lm.GPTConfig(tokenizer.vocab_size, n_layer=1, n_embd=16, n_head=2))
    with torch.no_grad():
        loss_sum, count = train_lm.token_loss(model, batch)
        # Padding changes nothing for the real tokens (causal attention, labels -100).
        alone_sum, _ = train_lm.token_loss(model, train_lm.collate([data[1]]))
        first_sum, _ = train_lm.token_loss(model, train_lm.collate([data[0]]))
    assert int(count) == len(lines[0]) + len(lines[1]) + 2
    assert float(loss_sum) == pytest.approx(float(alone_sum + first_sum), rel=1e-5)


def test_config_plans_for_one_and_two_processes():
    config = engine.load_config(REPO / "configs" / "lm_tiny.yaml")
    assert config.monitor.enabled and config.monitor.jsonl and config.monitor.progress
    two = engine.plan_from_config(config, 2)
    one = engine.plan_from_config(config, 1)
    assert (two.train_micro_batch_size_per_gpu, two.gradient_accumulation_steps) == (8, 4)
    assert (one.train_micro_batch_size_per_gpu, one.gradient_accumulation_steps) == (16, 4)


def test_corpus_is_the_generators_output():
    make_corpus = load("make_corpus", REPO / "examples" / "data" / "make_corpus.py")
    text = (REPO / "examples" / "data" / "corpus.txt").read_text(encoding="utf-8")
    assert make_corpus.make_corpus(1000, seed=7) == text
    lengths = [len(line) for line in text.splitlines()]
    assert 30_000 < len(text.encode()) < 100_000 and max(lengths) <= 180 and min(lengths) < 40
